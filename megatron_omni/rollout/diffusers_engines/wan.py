"""The embedded rollout engine for Wan text-to-video: `WanPipeline`'s components from a diffusers folder, driven
by the same SDE step and step-wise continuous batching as the image engine (`DiffusersRolloutEngine`, whose
family hooks this overrides), producing the same `Trajectory` record (video shapes: see its docstring).

- Latents: the pipeline's latent video `[c, (F - 1) / t + 1, H / s, W / s]` (t, s the VAE's temporal and
  spatial factors) drawn from each sample's generator exactly as `WanPipeline.prepare_latents` draws it, carried
  as packed 3D patch tokens `[S, C]` (`patchify_video`); the transformer runs behind `PackedVideoTransformer`.
- Sigma grid: the scheduler's static shift (`schedule.static_shift_sigmas`; a UniPC scheduler's `flow_shift`).
- Text: `WanPipeline._get_t5_prompt_embeds`' embeddings of each prompt's own tokens (the encoder masks the
  padding), zero-padded to `max_sequence_length` (or `text_length`) in every forward: Wan attends to all of it.
- Decode: de-normalised by the VAE's `latents_mean/std`, `AutoencoderKLWan.decode`, the pipeline's video
  post-processing: frames [F, 3, H, W] fp32 in [0, 1] per sample.
- True CFG as `WanPipeline` guides (`guidance_scale` 5.0 there by default): plain `v_neg + g (v_pos - v_neg)`,
  no per-token rescale (`cfg_rescale = False`, recorded in the trajectory so the recompute guides the same way);
  the negative prompt is encoded and zero-padded like the prompt (the pipeline's default negative prompt is "").
  The pipeline runs the two rows in two forwards, the engine in one (equal up to float rounding).
- Wan2.2-TI2V (a folder with `expand_timesteps`, e.g. Wan2.2-TI2V-5B): every forward takes per-token timesteps,
  as `WanPipeline` and `WanImageToVideoPipeline` pass them. A prompt that is an image record
  (`model_providers.qwen_image_edit.data.EditRecord.prompt`: the image's path and the instruction) samples
  image-to-video as `WanImageToVideoPipeline` does: the image, resized to the clip, VAE-encoded (`argmax`) and
  normalised, is the first latent frame; its tokens sit at timestep 0 in every forward, no step changes them and
  they carry no log-prob (`Trajectory.clean_tokens`); the text is the instruction. A plain prompt samples
  text-to-video. A folder without `expand_timesteps` refuses image records by name.
- Wan2.2 A14B (a folder with `transformer_2` and `boundary_ratio`, `model_providers.wan.experts`): every step runs
  the expert `WanPipeline` runs at its timestep (`ExpertRouter`, row by row: samples at different steps share a
  forward), the high-noise `transformer` frozen, the low-noise `transformer_2` the policy (`self.transformer`: the
  trainer's config, weights, sync target; a velocity model the trainer injects replaces it, not the high-noise
  expert). The SDE window must lie in the low-noise steps (refused by name before any work otherwise), so every
  recorded log-prob is the trained expert's and its recompute uses the expert the rollout used.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from megatron_omni.algorithms.schedule import static_shift_of, static_shift_sigmas
from megatron_omni.algorithms.velocity import VelocityModel
from megatron_omni.models.dit.embeddings import patchify_video, unpatchify_video
from megatron_omni.models.dit.video_interface import PackedVideoTransformer
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine, _Sample
from model_providers.wan.experts import TRAINED_EXPERT, TwoExperts, read_two_experts


def wan_token_ids(tokenizer: Any, text: str, max_length: int | None = None) -> tuple[int, ...]:
    """The token ids `WanPipeline` feeds its text encoder for `text` (its prompt cleaning, the tokenizer's special
    tokens, truncated to `max_length` as it truncates before encoding), without the padding."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    ids = tokenizer(prompt_clean(text), add_special_tokens=True, truncation=max_length is not None,
                    max_length=max_length).input_ids
    if not ids:
        raise ValueError(f"prompt {text!r} gives no tokens")
    return tuple(ids)


class ExpertRouter(torch.nn.Module):
    """The velocity-model keyword interface over Wan2.2 A14B's two experts: each row runs `high` when its timestep
    is at or above the boundary (`TwoExperts.high_noise`), `low` below, as `WanPipeline` switches its transformer per
    step. Rows of both kinds in one batch (continuous batching) run as two forwards, scattered back in order.
    `timestep` is sigma [B] (or per token [B, S], the row's largest: the noisy tokens')."""

    def __init__(self, high: VelocityModel, low: VelocityModel, experts: TwoExperts) -> None:
        super().__init__()
        self.high, self.low, self.experts = high, low, experts

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor, img_shapes: list, **kwargs: Any):
        b = hidden_states.shape[0]
        sigma = timestep if timestep.ndim == 1 else timestep.amax(1)
        high = self.experts.high_noise(sigma)
        out = None
        for model, rows in ((self.high, high), (self.low, ~high)):
            if not bool(rows.any()):
                continue
            if bool(rows.all()):
                return model(hidden_states=hidden_states, timestep=timestep, img_shapes=img_shapes, **kwargs)
            idx = rows.nonzero().flatten()
            part = {k: (v[idx] if isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == b else v)
                    for k, v in kwargs.items()}
            v = model(hidden_states=hidden_states[idx], timestep=timestep[idx],
                      img_shapes=[img_shapes[i] for i in idx.tolist()], **part)
            v = v[0] if isinstance(v, tuple | list) else v
            if out is None:
                out = v.new_empty(b, *v.shape[1:])
            out[idx] = v
        return (out,)


class WanRolloutEngine(DiffusersRolloutEngine):
    """Rollout with diffusers' Wan text-to-video components (see the module docstring); the arguments are
    `DiffusersRolloutEngine`'s (`model_path`: a diffusers `WanPipeline` folder)."""

    cfg_rescale = False  # WanPipeline's guidance is plain
    expand_timesteps = False  # a Wan2.2-TI2V folder's per-token timesteps (set from the folder by _load_pipeline)
    experts: TwoExperts | None = None  # a Wan2.2 A14B folder's expert switch (set from the folder by _load_pipeline)

    def _load_pipeline(self, model_path: str | os.PathLike, dtype: torch.dtype):
        from diffusers import WanPipeline

        self.experts = read_two_experts(model_path)  # Wan2.2 A14B's switch, None for one transformer
        pipe = WanPipeline.from_pretrained(model_path, local_files_only=True, dtype=dtype)
        if self.experts is not None and (pipe.transformer is None or pipe.transformer_2 is None):
            raise ValueError(f"{model_path}: a two-expert folder needs both transformer/ and {TRAINED_EXPERT}/")
        self.expand_timesteps = bool(pipe.config.get("expand_timesteps", False))
        self._conditions: dict[tuple, torch.Tensor] = {}
        return pipe

    @property
    def policy_component(self) -> str:
        # A14B: the low-noise expert is the policy (model_providers.wan.experts)
        return "transformer" if self.experts is None else TRAINED_EXPERT

    @property
    def velocity_model(self) -> VelocityModel:
        """What the engine samples with: the policy's velocity model, behind the expert switch for an A14B folder
        (the high-noise steps on the folder's frozen `transformer`)."""
        return self._router if self.experts is not None else self._policy_velocity

    @velocity_model.setter
    def velocity_model(self, model: VelocityModel) -> None:
        # the trainer may inject its own model (a shared model): it replaces the policy expert only
        self._policy_velocity = model
        if self.experts is not None:
            high = PackedVideoTransformer(self.pipe.transformer, self.patch_size,
                                          expand_timesteps=self.expand_timesteps)
            self._router = ExpertRouter(high, model, self.experts)

    def _grid_shift(self) -> float:
        return static_shift_of(self.pipe.scheduler.config)

    @property
    def patch_size(self) -> tuple[int, int, int]:
        return tuple(self.transformer.config.patch_size)

    def _transformer_velocity(self) -> VelocityModel:
        return PackedVideoTransformer(self.transformer, self.patch_size, expand_timesteps=self.expand_timesteps)

    def _sigmas(self, num_steps: int, img_shape: tuple[int, int, int]) -> torch.Tensor:
        return static_shift_sigmas(num_steps, self.shift)

    def _tail_grid(self, sigmas: torch.Tensor, tail_start: int, tail_steps: int,
                   img_shape: tuple[int, int, int]) -> torch.Tensor:
        raise ValueError("MixGRPO-Flash's compressed ODE tail (SamplingParams.tail_steps) re-spaces Qwen-Image's "
                         "dynamically shifted grid; the Wan engine samples a static-shift grid and has no Flash tail")

    def _latent_shape(self, params: SamplingParams) -> tuple[int, int, int, int]:
        """The latent video's (channels, frames, height, width) for these settings."""
        t, s = self.pipe.vae_scale_factor_temporal, self.pipe.vae_scale_factor_spatial
        _, ph, pw = self.patch_size
        if (params.num_frames - 1) % t:
            raise ValueError(f"num_frames - 1 must be a multiple of {t} (the VAE's temporal factor), got "
                             f"num_frames={params.num_frames}")
        if params.height % (s * ph) or params.width % (s * pw):
            raise ValueError(f"height/width must be multiples of {s * ph}x{s * pw}, got {params.height}x{params.width}")
        return (self.transformer.config.in_channels, (params.num_frames - 1) // t + 1, params.height // s,
                params.width // s)

    def _img_shape(self, params: SamplingParams) -> tuple[int, int, int]:
        _, f, h, w = self._latent_shape(params)
        pt, ph, pw = self.patch_size
        if f % pt:
            raise ValueError(f"{f} latent frames do not split into temporal patches of {pt}")
        return (f // pt, h // ph, w // pw)

    def _initial_latents(self, generator: torch.Generator, img_shape: tuple[int, int, int],
                         params: SamplingParams) -> torch.Tensor:
        c, f, h, w = self._latent_shape(params)
        # Same draw as WanPipeline.prepare_latents with a per-sample generator.
        noise = torch.randn(1, c, f, h, w, generator=generator)
        return patchify_video(noise, self.patch_size)[0]

    def _call_text_length(self, longest: int, params: SamplingParams) -> int:
        # Prompts longer than max_sequence_length are truncated, as the pipeline's tokenizer truncates them.
        if params.text_length is not None and min(longest, params.max_sequence_length) > params.text_length:
            raise ValueError(f"a prompt of this call has {longest} text tokens, more than text_length="
                             f"{params.text_length}")
        return params.text_length or params.max_sequence_length

    # ------------------------------------------------------------------ image-to-video (Wan2.2 TI2V)
    def image_record(self, prompt: str):
        """The image record a prompt string is (`EditRecord`), or None for a plain text prompt; a record on a
        folder without expanded timesteps is refused by name."""
        if not prompt.startswith("{"):
            return None
        from model_providers.qwen_image_edit.data import EditRecord

        record = EditRecord.parse(prompt)
        if not self.expand_timesteps:
            raise ValueError("an image prompt (image-to-video) needs a Wan2.2-TI2V folder (expand_timesteps: the "
                             "first frame's latents as the condition); this folder samples text-to-video only")
        return record

    @torch.no_grad()
    def condition_latents(self, image, params: SamplingParams) -> torch.Tensor:
        """The first latent frame of an image-to-video sample, packed [h * w, C] fp32: `WanImageToVideoPipeline`'s
        `prepare_latents` with `expand_timesteps` (the image resized to the clip, VAE-encoded with `argmax`,
        normalised by the VAE's `latents_mean/std`)."""
        pipe, vae = self.pipe, self.pipe.vae
        pixels = pipe.video_processor.preprocess(image, height=params.height, width=params.width)
        lat = vae.encode(pixels.to(self.device, torch.float32).unsqueeze(2).to(vae.dtype)).latent_dist.mode()
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(lat.device, torch.float32)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(lat.device, torch.float32)
        return patchify_video((lat.float() - mean) * inv_std, self.patch_size)[0]

    def _new_sample(self, index: int, prompt: str, group_id: int, seed: int, params: SamplingParams, text, neg_text,
                    text_length: int | None = None) -> _Sample:
        sample = super()._new_sample(index, prompt, group_id, seed, params, text, neg_text, text_length)
        record = self.image_record(prompt)
        if record is None:
            return sample
        if self.patch_size[0] != 1:
            raise ValueError(f"image-to-video conditions the first latent frame; temporal patch {self.patch_size[0]}"
                             " mixes it with the next")
        key = (record.image, params.height, params.width)
        self._conditions = getattr(self, "_conditions", {})
        if key not in self._conditions:
            self._conditions[key] = self.condition_latents(record.load_image(), params).to(self.device)
        cond = self._conditions[key]
        # the pipeline draws the whole latent video and feeds the condition in place of its first frame
        sample.latents = torch.cat([cond, sample.latents[cond.shape[0]:]])
        sample.clean_tokens = cond.shape[0]
        return sample

    def _step_guidance(self, s: _Sample) -> float:
        """`WanPipeline`'s per-step guidance: `guidance_scale` on the high-noise expert's steps, `guidance_scale_2`
        (None: the same) on the low-noise expert's (A14B; a one-transformer folder: `guidance_scale`)."""
        g2 = s.params.guidance_scale_2
        if g2 is None or self.experts is None or bool(self.experts.high_noise(s.sigmas[s.step: s.step + 1])[0]):
            return s.params.guidance_scale
        return g2

    def _window_guidance(self, s: _Sample) -> float:
        """The low-noise expert's scale on an A14B folder: its SDE window lies in that expert's steps
        (`TwoExperts.check_window`), where the rollout guided with `guidance_scale_2`."""
        g2 = s.params.guidance_scale_2
        return s.params.guidance_scale if g2 is None or self.experts is None else g2

    def clear_prompt_cache(self) -> None:
        super().clear_prompt_cache()
        getattr(self, "_conditions", {}).clear()

    def generate(self, prompts, params: SamplingParams, group_size: int = 1, seeds=None, on_sample=None):
        """See `RolloutEngine.generate`; a call whose prompts mix image records and text is refused before any work
        (one trajectory holds one count of clean condition tokens), and on an A14B folder an SDE window that can
        start at a high-noise step (`TwoExperts.check_window`)."""
        if len({self.image_record(p) is None for p in prompts}) > 1:
            raise ValueError("the prompts of one generate call mix image-conditioned and unconditioned samples: "
                             "give every prompt of a call an image, or none")
        if self.experts is not None and params.stochastic:
            first = params.window_start if params.window_start is not None else params.resolved_window_range[0]
            self.experts.check_window(static_shift_sigmas(params.num_steps, self.shift), first)
        return super().generate(prompts, params, group_size, seeds, on_sample)

    # ------------------------------------------------------------------ prompts
    def token_ids(self, text: str, max_length: int | None = None) -> tuple[int, ...]:
        """The token ids `WanPipeline` feeds its text encoder for `text` (`wan_token_ids`; an image record's
        instruction)."""
        record = self.image_record(text)
        return wan_token_ids(self.pipe.tokenizer, text if record is None else record.instruction, max_length)

    def text_lengths(self, prompts) -> list[int]:
        """Text tokens each prompt gives the transformer before the zero padding."""
        return [len(self.token_ids(p)) for p in prompts]

    def encode_token_ids(self, keys) -> list[torch.Tensor]:
        """Text embeddings [L_i, D] of token ids (from `token_ids`), the encoder's last hidden state at the
        prompt's own tokens (the padding masked), as `WanPipeline._get_t5_prompt_embeds` keeps them."""
        hidden = self.pipe.text_encoder(*self.padded_ids(keys)).last_hidden_state
        return [hidden[i, : len(k)] for i, k in enumerate(keys)]

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode_video(self, latents: torch.Tensor, img_shape: tuple[int, int, int]) -> torch.Tensor:
        """Packed latents [B, S, C] on patch grid `img_shape` -> videos [B, F, 3, H, W] fp32 in [0, 1]
        (WanPipeline's decode and post-processing)."""
        vae = self.pipe.vae
        lat = unpatchify_video(latents, img_shape, self.patch_size).to(vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(lat.device, lat.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(lat.device, lat.dtype)
        video = vae.decode(lat / inv_std + mean, return_dict=False)[0]
        return self.pipe.video_processor.postprocess_video(video, output_type="pt").float()

    def _decode_samples(self, latents: torch.Tensor, like: _Sample) -> torch.Tensor:
        return self.decode_video(latents, like.img_shape)

    def transformer_config(self) -> dict[str, Any]:
        """The diffusers config of the transformer (what `model_providers.wan` builds from)."""
        return dict(self.transformer.config)

