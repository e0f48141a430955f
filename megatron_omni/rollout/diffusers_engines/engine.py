"""The embedded rollout engine: a diffusers pipeline's components (Qwen-Image here; the Wan video engine,
`rollout.diffusers_engines.wan`, overrides the family hooks: pipeline class, prompt encoding, latent grid and noise,
sigma grid, text length, decode) driven by our SDE step.

- Step-wise continuous batching: every denoising step is one transformer forward over the samples that
  are running; finished samples leave (and are decoded and streamed out) and waiting ones join between
  steps, so the batch stays full. Samples of different prompts, seeds and steps share a forward.
- Determinism: each sample owns a `torch.Generator` seeded with its seed; its initial noise, window start
  and SDE noise come from it in that order, so a sample's result does not depend on what it was batched
  with (up to float rounding of batched matmuls). The initial noise equals what `QwenImagePipeline` draws
  for the same seed (`generator=[torch.Generator().manual_seed(s) ...]`).
- Prompt embeddings are cached by the token ids of the templated prompt (GRPO repeats each prompt G
  times; the negative prompt is one entry), each encoded on its own (bit-identical whatever was encoded before).
- The velocity model is injectable (any callable with the diffusers transformer's forward keywords), so
  the trainer can run the same loop with its own model.
- MixGRPO-Flash (`SamplingParams.tail_steps`): a sample's grid after its window is re-spaced into fewer steps,
  sampled with the multistep DPM-Solver++ (`algorithms.mixgrpo`); every sample keeps its previous x0
  prediction for the solver's second order.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from megatron_omni.algorithms.mixgrpo import dpm_solver_pp_step, flash_grid, second_order_allowed
from megatron_omni.algorithms.schedule import ShiftConfig, qwen_image_sigmas
from megatron_omni.algorithms.sde import windowed_sde_step
from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.algorithms.velocity import VelocityModel, guided_batch, pad_text
from megatron_omni.algorithms.window import sample_window_start
from megatron_omni.bridge.targets import DiffusersTarget
from megatron_omni.parallel import platform
from megatron_omni.rollout.base import FinishedSample, SamplingParams, Trajectory, WeightSink, sample_seeds
from megatron_omni.rollout.lora_receiver import load_lora_into
from megatron_omni.rollout.quantization import (
    FakeQuantizedTransformer,
    QuantizationSpec,
    RefreshStats,
    is_quantizer_state,
)


@dataclass
class _Sample:
    """A sample's state while it is denoised."""

    index: int
    prompt: str
    group_id: int
    seed: int
    params: SamplingParams
    generator: torch.Generator
    sigmas: torch.Tensor  # [T + 1] (Flash: shorter, the tail re-spaced)
    levels: torch.Tensor  # [T] noise level per step
    tail_start: int  # steps from here on take the DPM-Solver++ (len(sigmas) - 1: none)
    window_start: int
    text: torch.Tensor  # [L, D]
    neg_text: torch.Tensor | None
    latents: torch.Tensor  # [S, C] fp32
    img_shape: tuple[int, int, int]
    text_length: int  # every forward pads its text (and negative text) to this many tokens
    step: int = 0
    prev_x0: torch.Tensor | None = None  # the last step's x0 prediction (the solver's second order)
    rec_latents: list[torch.Tensor] = field(default_factory=list)
    rec_next: list[torch.Tensor] = field(default_factory=list)
    rec_log_probs: list[torch.Tensor] = field(default_factory=list)
    image: torch.Tensor | None = None
    cond_latents: torch.Tensor | None = None  # [S_c, C] fp32 source-image tokens (an edit engine's)
    cond_shapes: tuple[tuple[int, int, int], ...] = ()
    pooled: torch.Tensor | None = None  # [P] pooled text embedding (a family conditioned on one: SD3.5)
    neg_pooled: torch.Tensor | None = None
    distilled_guidance: float | None = None  # a guidance-distilled model's guidance input (FLUX.1-dev)
    clean_tokens: int = 0  # leading latent tokens that are a clean image condition (Wan2.2 TI2V image-to-video)

    @property
    def batch_key(self) -> tuple:
        """Samples that may share a forward: same patch grids (sources' included), SDE type and clean tokens."""
        return (self.img_shape, self.cond_shapes, self.params.sde_type, self.clean_tokens)

    @property
    def num_steps(self) -> int:
        """The steps this sample takes (its grid's)."""
        return self.sigmas.numel() - 1


def templated_token_ids(pipe, text: str) -> tuple[int, ...]:
    """The token ids `QwenImagePipeline` feeds its text encoder for `text` (its prompt template, truncated as it
    truncates); the first `pipe.prompt_template_encode_start_idx` of them are dropped from the embeddings."""
    drop = pipe.prompt_template_encode_start_idx
    ids = pipe.tokenizer(
        pipe.prompt_template_encode.format(text), max_length=pipe.tokenizer_max_length + drop, truncation=True
    ).input_ids
    if len(ids) <= drop:
        raise ValueError(f"templated prompt has {len(ids)} tokens, not more than the {drop} dropped")
    return tuple(ids)


class DiffusersRolloutEngine:
    """Rollout with a diffusers pipeline's components and step-wise continuous batching: Qwen-Image here, other
    families through the family hooks a subclass overrides (`rollout.diffusers_engines.wan.WanRolloutEngine`).

    Args:
        model_path: a diffusers pipeline folder of the engine's family (loaded offline).
        max_batch_size: samples per transformer forward (CFG samples add a negative row each).
        device: where to compute (default: the platform's device).
        dtype: component dtype (fp32 on CPU; SDE math is fp32 regardless).
        velocity_model: replaces the diffusers transformer's forward (same keywords).
        embed_cache_size: prompt embeddings kept (LRU).
        progress: show a progress bar over finished samples.
        quantization: what the transformer runs quantized (ModelOpt fake quantization, re-quantized after every
            `weight_update` and `load_weights`; see `rollout/quantization.py`).
        vae_dtype: what the VAE decodes (and encodes source images) in; None: `dtype`. flow_grpo keeps its VAE in
            fp32 under a bf16 transformer; on a CPU without bf16 convolution kernels, fp32 is also many times faster.
    """

    # True CFG rescales each token to the conditional velocity's norm (Qwen-Image); a family that guides plainly
    # (SD3.5) sets False, and its trajectories record it.
    cfg_rescale = True

    def __init__(
        self,
        model_path: str | os.PathLike,
        max_batch_size: int = 8,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        velocity_model: VelocityModel | None = None,
        embed_cache_size: int = 4096,
        progress: bool = False,
        quantization: QuantizationSpec | None = None,
        vae_dtype: torch.dtype | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        quantization = quantization or QuantizationSpec()
        if quantization.enabled and velocity_model is not None:
            raise ValueError("a quantized rollout samples with the engine's own transformer; it cannot take a "
                             "velocity_model (the trainer's model)")
        if not os.path.isdir(model_path):
            raise FileNotFoundError(f"no diffusers pipeline folder at {model_path}")
        self.device = device or platform.device()
        self.dtype = dtype
        self.collective = False
        self.pipe = self._load_pipeline(model_path, dtype)
        self.pipe.to(self.device)
        if vae_dtype is not None:  # decodes (and encodes source images) in it; `decode` casts the latents to it
            self.pipe.vae = vae_in_dtype(self.pipe.vae, model_path, vae_dtype)
        self.pipe.set_progress_bar_config(disable=True)
        self.transformer = self._policy_transformer()
        self.quantization = quantization
        self.quantizer = FakeQuantizedTransformer(self.transformer, quantization) if quantization.enabled else None
        self.last_requantize: RefreshStats | None = None
        self.shift = self._grid_shift()
        self.velocity_model: VelocityModel = velocity_model or self._transformer_velocity()
        self.max_batch_size = max_batch_size
        self.embed_cache_size = embed_cache_size
        self.progress = progress
        self._cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._asleep = False
        self.stats = {"forwards": 0, "forward_rows": 0, "cache_hits": 0, "cache_misses": 0}

    # ------------------------------------------------------------------ family hooks (Qwen-Image's)
    def _load_pipeline(self, model_path: str | os.PathLike, dtype: torch.dtype):
        """The diffusers pipeline of the folder (offline)."""
        from diffusers import QwenImagePipeline

        return QwenImagePipeline.from_pretrained(model_path, local_files_only=True, dtype=dtype)

    # the pipeline component the trainer's policy is (its config, weights, sync target, LoRA), `_policy_transformer`
    policy_component = "transformer"

    def _policy_transformer(self):
        """The pipeline's `policy_component` module."""
        return getattr(self.pipe, self.policy_component)

    def _grid_shift(self):
        """The scheduler settings the sigma grid is built from (`self.shift`)."""
        return ShiftConfig.from_scheduler_config(self.pipe.scheduler.config)

    def _transformer_velocity(self) -> VelocityModel:
        """The velocity model over the pipeline's own transformer (the velocity-model keyword interface)."""
        return self.transformer

    def _tail_grid(self, sigmas: torch.Tensor, tail_start: int, tail_steps: int,
                   img_shape: tuple[int, int, int]) -> torch.Tensor:
        """MixGRPO-Flash's grid: sigmas [T + 1] re-spaced into `tail_steps` steps from `tail_start` on."""
        return flash_grid(sigmas, tail_start, tail_steps, img_shape[0] * img_shape[1] * img_shape[2], self.shift)

    def _sigmas(self, num_steps: int, img_shape: tuple[int, int, int]) -> torch.Tensor:
        """The sampling grid [T + 1] fp32 of a sample on patch grid `img_shape`."""
        return qwen_image_sigmas(num_steps, img_shape[0] * img_shape[1] * img_shape[2], self.shift)

    def _initial_latents(self, generator: torch.Generator, img_shape: tuple[int, int, int],
                         params: SamplingParams) -> torch.Tensor:
        """A sample's initial noise, packed [S, C], drawn from its generator as the pipeline draws it."""
        channels = self.transformer.config.in_channels // 4
        # Same draw as QwenImagePipeline.prepare_latents with a per-sample generator.
        noise = torch.randn(1, 1, channels, 2 * img_shape[1], 2 * img_shape[2], generator=generator)
        return self.pipe._pack_latents(noise, 1, channels, 2 * img_shape[1], 2 * img_shape[2])[0]

    def _call_text_length(self, longest: int, params: SamplingParams) -> int:
        """The text length every forward of one `generate` call pads to, given its longest text (negative prompt
        included): the longest (capped at max_sequence_length), or params.text_length."""
        length = min(params.max_sequence_length, longest)
        if params.text_length is not None:
            if length > params.text_length:
                raise ValueError(f"a prompt of this call has {length} text tokens, more than text_length="
                                 f"{params.text_length}")
            length = params.text_length
        return length

    def _negative_texts(self, prompts: list[str], params: SamplingParams) -> list[torch.Tensor]:
        """The negative prompt's text embedding [L, D] for each prompt of a CFG call: one encoding shared by all
        (an edit engine encodes it with each record's source images)."""
        neg = self.encode_prompts([params.negative_prompt], params.max_sequence_length)[0]
        return [neg] * len(prompts)

    # ------------------------------------------------------------------ prompts
    def token_ids(self, text: str, max_length: int | None = None) -> tuple[int, ...]:
        """The templated prompt's token ids (the text encoder's input, the embedding cache's key). `max_length`
        (a call's max_sequence_length) is for pipelines that truncate before encoding; Qwen-Image's truncates
        the embeddings after it (`_new_sample`)."""
        return templated_token_ids(self.pipe, text)

    def text_lengths(self, prompts: Sequence[str]) -> list[int]:
        """Text tokens each prompt gives the transformer (see `RolloutEngine.text_lengths`)."""
        return [len(self.token_ids(p)) - self.pipe.prompt_template_encode_start_idx for p in prompts]

    def encode_token_ids(self, keys: Sequence[tuple[int, ...]]) -> list[torch.Tensor]:
        """Text embeddings of templated token ids (from `token_ids`), uncached and differentiable (a
        pretraining loop that trains the text encoder calls this under autograd): a list of [L_i - drop, D]
        in the text encoder's dtype."""
        drop = self.pipe.prompt_template_encode_start_idx
        ids, mask = self.padded_ids(keys)
        out = self.pipe.text_encoder(
            input_ids=ids, attention_mask=mask, output_hidden_states=True
        )
        hidden = out.hidden_states[-1]
        return [hidden[i, drop : len(k)] for i, k in enumerate(keys)]

    def padded_ids(self, keys: Sequence[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token id sequences right-padded with the tokenizer's pad id: (ids [B, L] long, mask [B, L] long, 1 on
        real tokens), L the longest, on this engine's device."""
        length = max(len(k) for k in keys)
        ids = torch.full((len(keys), length), self.pipe.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(keys), length, dtype=torch.long)
        for i, k in enumerate(keys):
            ids[i, : len(k)] = torch.tensor(k)
            mask[i, : len(k)] = 1
        return ids.to(self.device), mask.to(self.device)

    def clear_prompt_cache(self) -> None:
        """Forget cached prompt embeddings (after the text encoder's weights changed)."""
        self._cache.clear()

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], max_length: int | None = None) -> list[torch.Tensor]:
        """Text embeddings of each prompt as the pipeline computes them (Qwen-Image: template, last hidden
        state, first `prompt_template_encode_start_idx` tokens dropped): a list of [L_i, D] fp32. `max_length`:
        see `token_ids`."""
        keys = [self.token_ids(p, max_length) for p in prompts]
        missing = list(dict.fromkeys(k for k in keys if k not in self._cache))
        self.stats["cache_hits"] += len(keys) - len(missing)
        self.stats["cache_misses"] += len(missing)
        # One prompt per encoder call: an embedding is then a function of its prompt alone, not of which prompts
        # shared its batch (their padding changes the encoder's rounding: 7e-7 on the tiny UMT5), so what the
        # cache holds does not depend on the run's history (an evaluation's prompts first, or a resume) and a
        # resumed run samples bit for bit what the uninterrupted one did.
        for k in missing:
            self._cache[k] = self.encode_token_ids([k])[0].float().clone()
        result = []
        for k in keys:
            self._cache.move_to_end(k)
            result.append(self._cache[k])
        while len(self._cache) > self.embed_cache_size:
            self._cache.popitem(last=False)
        return result

    # ------------------------------------------------------------------ samples
    def _img_shape(self, params: SamplingParams) -> tuple[int, int, int]:
        """The transformer's patch grid (frames, height, width) of a sample with these settings."""
        if params.num_frames != 1:
            raise ValueError(f"an image pipeline samples num_frames=1, got {params.num_frames}")
        f = self.pipe.vae_scale_factor * 2
        if params.height % f or params.width % f:
            raise ValueError(f"height/width must be multiples of {f}, got {params.height}x{params.width}")
        return (1, params.height // f, params.width // f)

    def _new_sample(
        self, index: int, prompt: str, group_id: int, seed: int, params: SamplingParams, text, neg_text,
        text_length: int | None = None,
    ) -> _Sample:
        """A new sample of `prompt` (text [L, D], neg_text [Ln, D] or None); its forwards pad text to
        `text_length` (None: params.text_length, else its own longest text)."""
        img_shape = self._img_shape(params)
        g = torch.Generator().manual_seed(int(seed))
        latents = self._initial_latents(g, img_shape, params)
        sigmas = self._sigmas(params.num_steps, img_shape)
        levels = torch.zeros(params.num_steps, dtype=torch.float32)
        window_start = 0
        if params.stochastic:
            window_start = params.window_start
            if window_start is None:
                window_start = sample_window_start(
                    params.num_steps, params.window_size, params.resolved_window_range, g
                )
            levels[window_start : window_start + params.window_size] = params.noise_level
        tail_start = params.num_steps
        if params.tail_steps is not None:
            tail_start = window_start + params.window_size
            sigmas = self._tail_grid(sigmas, tail_start, params.tail_steps, img_shape)
            levels = torch.cat([levels[:tail_start], torch.zeros(params.tail_steps)])
        return _Sample(
            index=index,
            prompt=prompt,
            group_id=group_id,
            seed=int(seed),
            params=params,
            generator=g,
            sigmas=sigmas.to(self.device),
            levels=levels,
            tail_start=tail_start,
            window_start=window_start,
            text=text[: params.max_sequence_length],
            neg_text=None if neg_text is None else neg_text[: params.max_sequence_length],
            latents=latents.to(self.device, torch.float32),
            img_shape=img_shape,
            text_length=text_length or params.text_length or min(
                params.max_sequence_length, max(text.shape[0], 0 if neg_text is None else neg_text.shape[0])),
        )

    def _step_guidance(self, s: _Sample) -> float:
        """The true-CFG scale of sample `s`'s current step (a family whose guidance changes over the grid, Wan2.2
        A14B's per expert, overrides it)."""
        return s.params.guidance_scale

    def _window_guidance(self, s: _Sample) -> float:
        """The scale the trajectory records for sample `s`: its window steps' (what the recompute guides with)."""
        return s.params.guidance_scale

    @torch.no_grad()
    def _denoise_step(self, batch: list[_Sample]) -> None:
        """One transformer forward and one SDE step for every sample of `batch` (same batch_key)."""
        dev = self.device
        # Samples may run grids of different lengths (num_steps), so index each one's own grid.
        sigma = torch.stack([s.sigmas[s.step] for s in batch])
        sigma_next = torch.stack([s.sigmas[s.step + 1] for s in batch])
        sigma_one = torch.stack([s.sigmas[1] if s.sigmas.numel() > 2 else s.sigmas[0] for s in batch])
        levels = torch.tensor([float(s.levels[s.step]) for s in batch], device=dev)
        latents = torch.stack([s.latents for s in batch])
        length = max(s.text_length for s in batch)
        text, mask = pad_text([s.text for s in batch], length)
        guidance = torch.tensor([self._step_guidance(s) for s in batch], device=dev)
        neg_text = neg_mask = None
        if any(s.neg_text is not None for s in batch):
            # rows without CFG get a placeholder that the guided batch never reads
            neg_text, neg_mask = pad_text([s.text[:1] if s.neg_text is None else s.neg_text for s in batch],
                                          length)
        cond = {}
        if batch[0].cond_latents is not None:
            cond = dict(cond_latents=torch.stack([s.cond_latents for s in batch]), cond_shapes=batch[0].cond_shapes)
        pooled = neg_pooled = None
        if batch[0].pooled is not None:
            pooled = torch.stack([s.pooled for s in batch])
            neg_pooled = torch.stack([s.pooled if s.neg_pooled is None else s.neg_pooled for s in batch])
        if batch[0].distilled_guidance is not None:
            cond["distilled_guidance"] = torch.tensor([s.distilled_guidance for s in batch], device=dev)
        k = batch[0].clean_tokens
        if k:
            cond["clean_tokens"] = k
        v = guided_batch(latents, sigma, text, mask, batch[0].img_shape, guidance_scale=guidance,
                         negative_embeds=neg_text, negative_mask=neg_mask, pooled=pooled, negative_pooled=neg_pooled,
                         cfg_rescale=self.cfg_rescale, **cond).velocity(self.velocity_model, self.dtype)
        self.stats["forwards"] += 1
        self.stats["forward_rows"] += len(batch) + int((guidance > 1).sum())
        # clean condition tokens stay as they are and carry no log-prob (their SDE noise is not drawn)
        next_latents, rows, lp = windowed_sde_step(latents[:, k:], v[:, k:], sigma, sigma_next, sigma_one, levels,
                                                   batch[0].params.sde_type, [s.generator for s in batch])
        if k:
            next_latents = torch.cat([latents[:, :k].float(), next_latents], 1)
        next_latents = self._flash_tail(batch, latents, v, sigma, sigma_next, next_latents)
        if rows.numel():
            for j, r in enumerate(rows.tolist()):
                batch[r].rec_latents.append(latents[r])
                batch[r].rec_next.append(next_latents[r])
                batch[r].rec_log_probs.append(lp[j])
        for i, s in enumerate(batch):
            s.latents = next_latents[i]
            s.step += 1

    @staticmethod
    def _flash_tail(batch: list[_Sample], latents: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor,
                    sigma_next: torch.Tensor, next_latents: torch.Tensor) -> torch.Tensor:
        """The rows of `batch` in their Flash tail take the DPM-Solver++ step instead of Euler; every row
        records its x0 prediction for the solver (latents, v, next_latents [B, S, C]; sigma, sigma_next [B])."""
        tail = [i for i, s in enumerate(batch) if s.step >= s.tail_start]
        if tail:
            rows = torch.tensor(tail, device=latents.device)
            prev = [batch[i].prev_x0 for i in tail]
            have_prev = all(p is not None for p in prev)
            order2 = torch.tensor([second_order_allowed(batch[i].step, batch[i].num_steps) for i in tail],
                                  device=latents.device)
            sigma_prev = torch.stack([batch[i].sigmas[batch[i].step - 1] if batch[i].step else batch[i].sigmas[0]
                                      for i in tail])
            x_next, _ = dpm_solver_pp_step(latents[rows], v[rows], sigma[rows], sigma_next[rows],
                                           torch.stack(prev) if have_prev else None, sigma_prev, order2)
            next_latents = next_latents.clone()
            next_latents[rows] = x_next
        x0 = latents.float() - sigma.float().view(-1, 1, 1) * v.float()
        for i, s in enumerate(batch):
            s.prev_x0 = x0[i] if s.params.tail_steps is not None else None
        return next_latents

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents [B, S, C] -> images [B, 3, H, W] fp32 in [0, 1] (QwenImagePipeline's decode)."""
        pipe, vae = self.pipe, self.pipe.vae
        lat = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(lat.device, lat.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(lat.device, lat.dtype)
        lat = lat / inv_std + mean
        image = vae.decode(lat, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type="pt").float()

    def _decode_samples(self, latents: torch.Tensor, like: _Sample) -> torch.Tensor:
        """Finished samples' packed latents [B, S, C], all shaped like sample `like` -> what they show, fp32 in
        [0, 1]: images [B, 3, H, W] (a video engine: [B, F, 3, H, W])."""
        return self.decode(latents, like.params.height, like.params.width)

    def _finish(self, done: list[_Sample]) -> None:
        by_size: dict[tuple, list[_Sample]] = {}
        for s in done:
            by_size.setdefault((s.params.height, s.params.width, s.img_shape), []).append(s)
        for group in by_size.values():
            images = self._decode_samples(torch.stack([s.latents for s in group]), group[0])
            for s, img in zip(group, images):
                s.image = img

    def run(self, samples: Iterable[_Sample], on_finish: Callable[[_Sample], None] | None = None) -> list[_Sample]:
        """Denoise samples with step-wise continuous batching; returns them in completion order.

        Between two steps, finished samples leave (decoded, `on_finish` called) and waiting ones join, up
        to `max_batch_size`; the batch is formed from samples sharing the oldest running sample's key.
        """
        if self._asleep:
            raise RuntimeError("engine is asleep; call wake_up() first")
        pending = deque(samples)
        running: list[_Sample] = []
        finished: list[_Sample] = []
        while pending or running:
            key = running[0].batch_key if running else pending[0].batch_key
            waiting: deque[_Sample] = deque()
            while pending and len(running) < self.max_batch_size:
                s = pending.popleft()
                (running if s.batch_key == key else waiting).append(s)
            pending = waiting + pending
            self._denoise_step(running)
            done = [s for s in running if s.step == s.num_steps]
            if done:
                running = [s for s in running if s.step < s.num_steps]
                self._finish(done)
                for s in done:
                    finished.append(s)
                    if on_finish is not None:
                        on_finish(s)
        return finished

    # ------------------------------------------------------------------ the protocol
    def generate(
        self,
        prompts: Sequence[str],
        params: SamplingParams,
        group_size: int = 1,
        seeds: Sequence[int] | None = None,
        on_sample: Callable[[FinishedSample], None] | None = None,
    ) -> Trajectory:
        """`group_size` samples of each prompt; sample k of prompt p is row p * group_size + k, with
        seed `seeds[row]` (default: the row number). See `RolloutEngine.generate`."""
        if params.guidance_scale_2 is not None and getattr(self, "experts", None) is None:
            raise ValueError(f"guidance_scale_2={params.guidance_scale_2} guides a low-noise expert: it needs a "
                             "two-expert (Wan2.2 A14B) folder, and this one has one transformer")
        seeds = sample_seeds(len(prompts), group_size, seeds)
        n = len(seeds)
        texts = self.encode_prompts(list(prompts), params.max_sequence_length)
        negs = self._negative_texts(list(prompts), params) if params.do_cfg else [None] * len(prompts)
        # One text length for every forward of the call (params.text_length, else the longest prompt, negative
        # included): the trainer recomputes from the trajectory's text, padded to this length, and another
        # padding changes the bf16 attention's rounding (masked keys still move the kernel's blocking).
        length = self._call_text_length(max(t.shape[0] for t in texts + [n for n in negs if n is not None]), params)
        samples = [
            self._new_sample(p * group_size + k, prompts[p], p, seeds[p * group_size + k], params, texts[p], negs[p],
                             length)
            for p in range(len(prompts))
            for k in range(group_size)
        ]
        bar = tqdm(total=n, desc="rollout", disable=not self.progress, leave=False)

        def _done(s: _Sample) -> None:
            bar.update(1)
            if on_sample is not None:
                on_sample(FinishedSample(s.index, s.prompt, s.group_id, s.seed, s.image))

        try:
            finished = self.run(samples, _done)
        finally:
            bar.close()
        return self._to_trajectory(sorted(finished, key=lambda s: s.index), params)

    def _to_trajectory(self, samples: list[_Sample], params: SamplingParams) -> Trajectory:
        w = len(samples[0].rec_log_probs)
        if any(len(s.rec_log_probs) != w for s in samples):
            raise RuntimeError("samples recorded different numbers of window steps")
        length = max(s.text_length for s in samples)
        text, mask = pad_text([s.text for s in samples], length)
        neg_text = neg_mask = None
        if params.do_cfg:
            neg_text, neg_mask = pad_text([s.neg_text for s in samples], length)
        s0 = samples[0]
        empty = s0.latents.new_zeros(0, *s0.latents.shape)

        def _stack(items: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
            return torch.stack(items) if items else like

        return Trajectory(
            prompts=[s.prompt for s in samples],
            group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
            seeds=torch.tensor([s.seed for s in samples], dtype=torch.long),
            prompt_embeds=text,
            prompt_embeds_mask=mask,
            negative_prompt_embeds=neg_text,
            negative_prompt_embeds_mask=neg_mask,
            guidance_scale=torch.tensor([self._window_guidance(s) for s in samples], dtype=torch.float32),
            latents=torch.stack([_stack(s.rec_latents, empty) for s in samples]),
            next_latents=torch.stack([_stack(s.rec_next, empty) for s in samples]),
            log_probs=torch.stack([_stack(s.rec_log_probs, s0.latents.new_zeros(0)) for s in samples]),
            sigmas=torch.stack([s.sigmas for s in samples]),
            window_start=torch.tensor([s.window_start for s in samples], dtype=torch.long),
            images=torch.stack([s.image for s in samples]),
            img_shape=s0.img_shape,
            noise_level=params.noise_level if params.stochastic else 0.0,
            sde_type=params.sde_type,
            final_latents=torch.stack([s.latents for s in samples]).float(),
            **self._trajectory_conditioning(samples),
            pooled_embeds=None if s0.pooled is None else torch.stack([s.pooled for s in samples]),
            negative_pooled_embeds=(torch.stack([s.neg_pooled for s in samples])
                                    if s0.pooled is not None and params.do_cfg else None),
            cfg_rescale=self.cfg_rescale,
            distilled_guidance=(None if s0.distilled_guidance is None else
                                torch.tensor([s.distilled_guidance for s in samples], dtype=torch.float32)),
            clean_tokens=self._clean_tokens(samples),
        )

    @staticmethod
    def _clean_tokens(samples: list[_Sample]) -> int:
        """The samples' one count of clean condition tokens (image-to-video); a call mixing them is refused."""
        counts = {s.clean_tokens for s in samples}
        if len(counts) != 1:
            raise ValueError(f"the samples of one generate call mix image-conditioned and unconditioned samples "
                             f"(clean tokens {sorted(counts)}): give every prompt of a call an image, or none")
        return counts.pop()

    @staticmethod
    def _trajectory_conditioning(samples: list[_Sample]) -> dict[str, Any]:
        """The samples' source-image tokens for the Trajectory (`cond_latents`, `cond_shapes`); none without."""
        if samples[0].cond_latents is None:
            return {}
        if len({s.cond_shapes for s in samples}) != 1:
            raise ValueError("the samples of one generate call must share their source images' grids, got "
                             f"{sorted({s.cond_shapes for s in samples})}")
        return {"cond_latents": torch.stack([s.cond_latents for s in samples]).float(),
                "cond_shapes": samples[0].cond_shapes}

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy diffusers-named transformer tensors (with or without the `transformer.` prefix) into the
        engine's transformer in place. Raises KeyError on an unknown name, ValueError on a shape mismatch
        (nothing is skipped silently). Returns the names loaded."""
        params = dict(self.transformer.named_parameters())
        params.update(dict(self.transformer.named_buffers()))
        loaded = []
        with torch.no_grad():
            for name, tensor in named_tensors:
                key = name.removeprefix("transformer.")
                if key not in params:
                    raise KeyError(f"unknown transformer weight {name!r}")
                target = params[key]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != engine's {tuple(target.shape)}")
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))
                loaded.append(key)
        self.requantize()
        return loaded

    def requantize(self) -> RefreshStats | None:
        """Quantize the transformer's current weights again (nothing for an unquantized engine); the stats are
        also kept in `last_requantize`."""
        if self.quantizer is not None:
            self.last_requantize = self.quantizer.refresh()
        return self.last_requantize

    def load_lora(self, state: dict[str, torch.Tensor], rank: int, alpha: float) -> tuple[list[str], list[str]]:
        """Receive LoRA adapters as diffusers peft keys into the engine's transformer (`load_lora_into`)."""
        if self.quantizer is not None:
            raise ValueError("a quantized engine takes merged weights (rollout.lora_sync=merge), not adapters: its "
                             "FP8 linears are ModelOpt's, which peft does not wrap")
        return load_lora_into(self.transformer, state, rank, alpha, self.dtype)

    # ------------------------------------------------------------------ the trainer's side
    def transformer_config(self) -> dict[str, Any]:
        """The diffusers config of the transformer (see `RolloutEngine`)."""
        return dict(self.transformer.config)

    def initial_state_dict(self) -> dict[str, torch.Tensor]:
        """The transformer's tensors as loaded from the folder (live tensors: call it before the first sync;
        a quantized engine's quantizer scales are not among them)."""
        return {k: v for k, v in self.transformer.state_dict().items() if not is_quantizer_state(k)}

    def weight_sink(self) -> WeightSink:
        """The diffusers transformer, whole on this rank (rollout tp 1), written in place."""
        return WeightSink(kind="diffusers", tp=1, target=DiffusersTarget(self.transformer), in_place=True)

    @contextlib.contextmanager
    def weight_update(self) -> Iterator[None]:
        """The bridge's coverage check covers the one in-process module; a quantized engine re-quantizes the
        synced weights on exit (`requantize`)."""
        yield
        self.requantize()

    @torch.no_grad()
    def probe(self, traj: Trajectory) -> torch.Tensor:
        """Transition means [N, W, S, C] of `traj` under the velocity model the engine samples with."""
        return recompute_log_probs(traj, self.velocity_model, dtype=self.dtype, return_means=True).means

    @torch.no_grad()
    def probe_unquantized(self, traj: Trajectory) -> torch.Tensor:
        """`probe` with the quantizers off: the same weights without FP8 rounding (an unquantized engine: its
        `probe`)."""
        if self.quantizer is None:
            return self.probe(traj)
        with self.quantizer.disabled():
            return self.probe(traj)

    def sleep(self) -> None:
        """Nothing to release in the embedded engine; generate() refuses to run until wake_up()."""
        self._asleep = True

    def wake_up(self) -> None:
        self._asleep = False

    def close(self) -> None:
        """Nothing to release (the pipeline goes with the object)."""


def vae_in_dtype(vae: torch.nn.Module, folder: str | os.PathLike, dtype: torch.dtype) -> torch.nn.Module:
    """The pipeline folder's VAE (`vae/`) in `dtype` on `vae`'s device: `vae` itself when it is in `dtype` already,
    else loaded again from the folder in `dtype` (casting `vae` would keep what the model's dtype rounded away:
    flow_grpo's fp32 VAE holds the checkpoint's values, not bf16 ones)."""
    params = list(vae.parameters())
    if not params or params[0].dtype == dtype:  # a parameter-free VAE (a pixel-space fold) has nothing to cast
        return vae
    device = params[0].device
    return type(vae).from_pretrained(Path(folder) / "vae", torch_dtype=dtype, local_files_only=True).to(device)


# The engine class of a pipeline folder by its model_index.json's `_class_name` (imported only when built); any
# other class: `DiffusersRolloutEngine` (Qwen-Image's).
ENGINE_CLASSES = {
    "WanPipeline": "megatron_omni.rollout.diffusers_engines.wan:WanRolloutEngine",
    "StableDiffusion3Pipeline": "megatron_omni.rollout.diffusers_engines.sd3:SD3RolloutEngine",
    "FluxPipeline": "megatron_omni.rollout.diffusers_engines.flux:FluxRolloutEngine",
    "QwenImageEditPlusPipeline": "megatron_omni.rollout.diffusers_engines.edit:EditRolloutEngine",
}


def build_diffusers_engine(pipeline_dir: str | os.PathLike, settings: Any) -> DiffusersRolloutEngine:
    """The registry's builder (`rollout.engine=diffusers`): one embedded engine per rank, rollout tp 1; the class
    that samples the folder's pipeline (`ENGINE_CLASSES`, by its model_index.json's class: Wan's video
    engine, SD3.5's, Qwen-Image-Edit's)."""
    if settings.tp != 1:
        raise ValueError(f"the diffusers engine runs at rollout tp 1 (one per rank), got tp={settings.tp}")
    index = Path(pipeline_dir) / "model_index.json"
    cls = DiffusersRolloutEngine
    name = json.loads(index.read_text()).get("_class_name") if index.is_file() else None
    if name in ENGINE_CLASSES:
        import importlib

        module, attr = ENGINE_CLASSES[name].split(":")
        cls = getattr(importlib.import_module(module), attr)
    return cls(pipeline_dir, max_batch_size=settings.max_batch_size, dtype=settings.dtype,
               quantization=settings.quantization, vae_dtype=getattr(settings, "vae_dtype", None))
