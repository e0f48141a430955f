"""The embedded rollout engine for SD3.5 text-to-image: `StableDiffusion3Pipeline`'s components from a diffusers
folder, driven by the same SDE step and step-wise continuous batching as the image engine
(`DiffusersRolloutEngine`, whose family hooks this overrides), producing the same `Trajectory` record.

- Latents: the pipeline's latent image `[c, H / 8, W / 8]` drawn from each sample's generator exactly as
  `StableDiffusion3Pipeline.prepare_latents` draws it, carried as packed `p x p` patch tokens `[S, c p p]`
  (`models.dit.sd3_interface`); the transformer runs behind `PackedSD3Transformer`.
- Sigma grid: the scheduler's static shift (SD3.5: 3.0; `schedule.static_shift_sigmas`), as the pipeline's
  `set_timesteps` computes it.
- Text: `StableDiffusion3Pipeline.encode_prompt` of each prompt on its own (the same prompt to CLIP-L, CLIP-G and
  T5): CLIP-L's and CLIP-G's penultimate states side by side, zero-padded to T5's width, followed by T5's states
  padded to `max_sequence_length` tokens; 77 + max_sequence_length tokens, all attended (the mask is all ones).
  The pooled CLIP embeddings (CLIP-L's and CLIP-G's projected outputs) ride in the trajectory
  (`Trajectory.pooled_embeds`, and the negative prompt's for CFG), so the trainer's recompute sees them.
- True CFG is the pipeline's (and flow_grpo's) plain `v_neg + g (v_pos - v_neg)`, no per-token rescale
  (`cfg_rescale = False`, recorded in the trajectory); flow_grpo's SD3.5 recipes guide with 4.5.
- Decode: `latents / scaling_factor + shift_factor`, `AutoencoderKL.decode`, the pipeline's post-processing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from megatron_omni.algorithms.schedule import static_shift_of, static_shift_sigmas
from megatron_omni.algorithms.velocity import VelocityModel
from megatron_omni.models.dit.sd3_interface import PackedSD3Transformer, pack_image_latents, unpack_image_latents
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine, _Sample


class SD3RolloutEngine(DiffusersRolloutEngine):
    """Rollout with diffusers' SD3 / SD3.5 components (see the module docstring); the arguments are
    `DiffusersRolloutEngine`'s (`model_path`: a diffusers `StableDiffusion3Pipeline` folder)."""

    cfg_rescale = False
    default_max_sequence_length = 256  # StableDiffusion3Pipeline's

    def _load_pipeline(self, model_path: str | os.PathLike, dtype: torch.dtype):
        from diffusers import StableDiffusion3Pipeline

        return StableDiffusion3Pipeline.from_pretrained(model_path, local_files_only=True, dtype=dtype)

    def _grid_shift(self) -> float:
        return static_shift_of(self.pipe.scheduler.config)

    @property
    def patch_size(self) -> int:
        return int(self.transformer.config.patch_size)

    def _transformer_velocity(self) -> VelocityModel:
        return PackedSD3Transformer(self.transformer)

    def _sigmas(self, num_steps: int, img_shape: tuple[int, int, int]) -> torch.Tensor:
        return static_shift_sigmas(num_steps, self.shift)

    def _tail_grid(self, sigmas: torch.Tensor, tail_start: int, tail_steps: int,
                   img_shape: tuple[int, int, int]) -> torch.Tensor:
        raise ValueError("MixGRPO-Flash's compressed ODE tail (SamplingParams.tail_steps) re-spaces Qwen-Image's "
                         "dynamically shifted grid; the SD3 engine samples a static-shift grid and has no Flash tail")

    def _img_shape(self, params: SamplingParams) -> tuple[int, int, int]:
        if params.num_frames != 1:
            raise ValueError(f"an image pipeline samples num_frames=1, got {params.num_frames}")
        f = self.pipe.vae_scale_factor * self.patch_size
        if params.height % f or params.width % f:
            raise ValueError(f"height/width must be multiples of {f}, got {params.height}x{params.width}")
        return (1, params.height // f, params.width // f)

    def _initial_latents(self, generator: torch.Generator, img_shape: tuple[int, int, int],
                         params: SamplingParams) -> torch.Tensor:
        p = self.patch_size
        # Same draw as StableDiffusion3Pipeline.prepare_latents with a per-sample generator.
        noise = torch.randn(1, self.transformer.config.in_channels, img_shape[1] * p, img_shape[2] * p,
                            generator=generator)
        return pack_image_latents(noise, p)[0]

    # ------------------------------------------------------------------ prompts
    def _call_text_length(self, longest: int, params: SamplingParams) -> int:
        # Every prompt gives the same fixed length: CLIP's 77 tokens, then T5's padded to max_sequence_length.
        return self.pipe.tokenizer_max_length + params.max_sequence_length

    def text_lengths(self, prompts: Sequence[str]) -> list[int]:
        """T5 tokens each prompt has before the pipeline pads it (its text is always 77 + max_sequence_length)."""
        return [len(self.pipe.tokenizer_3(p).input_ids) for p in prompts]

    def _pipeline_encode(self, prompt: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline's text states [1, L, D] and pooled embedding [1, P] of one prompt."""
        embeds, _, pooled, _ = self.pipe.encode_prompt(prompt=prompt, prompt_2=None, prompt_3=None,
                                                       device=self.device, do_classifier_free_guidance=False,
                                                       max_sequence_length=max_length)
        return embeds, pooled

    def _encode(self, prompt: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (prompt, max_length)
        if key in self._cache:
            self.stats["cache_hits"] += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        self.stats["cache_misses"] += 1
        # One prompt per call: an embedding is a function of its prompt alone (see the base engine's cache).
        embeds, pooled = self._pipeline_encode(prompt, max_length)
        self._cache[key] = (embeds[0].float().clone(), pooled[0].float().clone())
        while len(self._cache) > self.embed_cache_size:
            self._cache.popitem(last=False)
        return self._cache[key]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], max_length: int | None = None) -> list[torch.Tensor]:
        """Text states of each prompt as `StableDiffusion3Pipeline.encode_prompt` computes them: a list of
        [77 + max_length, D] fp32 (max_length: T5's padded length, the call's `max_sequence_length`)."""
        length = self.default_max_sequence_length if max_length is None else max_length
        return [self._encode(p, length)[0] for p in prompts]

    def pooled_embeds(self, prompt: str, max_length: int) -> torch.Tensor:
        """The pooled CLIP embedding [P] fp32 of `prompt` (CLIP-L's and CLIP-G's projected outputs)."""
        return self._encode(prompt, max_length)[1]

    def _new_sample(self, index: int, prompt: str, group_id: int, seed: int, params: SamplingParams, text, neg_text,
                    text_length: int | None = None) -> _Sample:
        s = super()._new_sample(index, prompt, group_id, seed, params, text, neg_text, text_length)
        # SD3's text is CLIP's 77 tokens before T5's max_sequence_length: keep all of it (the base truncates to
        # max_sequence_length, the length of a one-encoder prompt).
        s.text, s.neg_text = text, neg_text
        s.text_length = self._call_text_length(0, params)
        s.pooled = self.pooled_embeds(prompt, params.max_sequence_length)
        if params.do_cfg:
            s.neg_pooled = self.pooled_embeds(params.negative_prompt, params.max_sequence_length)
        return s

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode_image(self, latents: torch.Tensor, img_shape: tuple[int, int, int]) -> torch.Tensor:
        """Packed latents [B, S, C] on patch grid `img_shape` -> images [B, 3, H, W] fp32 in [0, 1]
        (StableDiffusion3Pipeline's decode and post-processing)."""
        vae = self.pipe.vae
        lat = unpack_image_latents(latents, img_shape, self.patch_size).to(vae.dtype)
        lat = lat / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(lat, return_dict=False)[0]
        return self.pipe.image_processor.postprocess(image, output_type="pt").float()

    def _decode_samples(self, latents: torch.Tensor, like: _Sample) -> torch.Tensor:
        return self.decode_image(latents, like.img_shape)

    def transformer_config(self) -> dict[str, Any]:
        """The diffusers config of the transformer (what `model_providers.sd3` builds from)."""
        return dict(self.transformer.config)
