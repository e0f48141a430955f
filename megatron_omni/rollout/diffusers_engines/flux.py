"""The embedded rollout engine for FLUX.1 text-to-image: `FluxPipeline`'s components from a diffusers folder, driven
by the same SDE step and step-wise continuous batching as the image engine (`DiffusersRolloutEngine`, whose family
hooks this overrides), producing the same `Trajectory` record.

- Latents: the pipeline's 16-channel latent `[16, H / 8, W / 8]` drawn from each sample's generator exactly as
  `FluxPipeline.prepare_latents` draws it, packed 2 x 2 (`FluxPipeline._pack_latents`: the trajectory's tokens are the
  transformer's own input); the transformer runs behind `PackedFluxTransformer`.
- Sigma grid: the scheduler's resolution-dependent (dynamic) shift, the same grid function as Qwen-Image's
  (`FluxPipeline` computes `mu` from the image tokens with the scheduler config's constants).
- Text: `FluxPipeline.encode_prompt` of each prompt on its own: T5's states padded to `max_sequence_length` tokens, all
  attended (the mask is all ones), and CLIP's pooled output, carried in the trajectory (`Trajectory.pooled_embeds`)
  so the trainer's recompute sees it.
- Guidance: FLUX.1-dev is guidance-distilled: the guidance scale is a model input (`SamplingParams.distilled_guidance`,
  default `FluxPipeline`'s 3.5), recorded per sample in `Trajectory.distilled_guidance`; no true CFG by default
  (the family's traits refuse `rollout.guidance_scale > 1`; called directly with a negative prompt the engine guides
  plainly, as `FluxPipeline`'s `true_cfg_scale` does, without per-token rescale).
- Decode: `FluxPipeline._unpack_latents`, `latents / scaling_factor + shift_factor`, `AutoencoderKL.decode`, the
  pipeline's post-processing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from megatron_omni.algorithms.velocity import VelocityModel
from megatron_omni.models.dit.flux_interface import PackedFluxTransformer
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine, _Sample

DEFAULT_DISTILLED_GUIDANCE = 3.5  # FluxPipeline's default `guidance_scale` (FLUX.1-dev's model card uses 3.5)


class FluxRolloutEngine(DiffusersRolloutEngine):
    """Rollout with diffusers' FLUX.1 components (see the module docstring); the arguments are
    `DiffusersRolloutEngine`'s (`model_path`: a diffusers `FluxPipeline` folder)."""

    cfg_rescale = False

    def _load_pipeline(self, model_path: str | os.PathLike, dtype: torch.dtype):
        from diffusers import FluxPipeline

        return FluxPipeline.from_pretrained(model_path, local_files_only=True, dtype=dtype)

    def _transformer_velocity(self) -> VelocityModel:
        return PackedFluxTransformer(self.transformer)

    def _tail_grid(self, sigmas: torch.Tensor, tail_start: int, tail_steps: int,
                   img_shape: tuple[int, int, int]) -> torch.Tensor:
        raise ValueError("MixGRPO-Flash's compressed ODE tail (SamplingParams.tail_steps) is not wired for the FLUX "
                         "engine")

    def _initial_latents(self, generator: torch.Generator, img_shape: tuple[int, int, int],
                         params: SamplingParams) -> torch.Tensor:
        c, h, w = self.transformer.config.in_channels // 4, 2 * img_shape[1], 2 * img_shape[2]
        # Same draw as FluxPipeline.prepare_latents with a per-sample generator.
        noise = torch.randn(1, c, h, w, generator=generator)
        return self.pipe._pack_latents(noise, 1, c, h, w)[0]

    def distilled_guidance(self, params: SamplingParams) -> float | None:
        """The guidance input of this engine's transformer for `params`: the setting, FluxPipeline's default 3.5
        when unset, None for a model without guidance embedding (which refuses a setting)."""
        if not self.transformer.config.guidance_embeds:
            if params.distilled_guidance is not None:
                raise ValueError(f"distilled_guidance={params.distilled_guidance} is set but this FLUX transformer "
                                 "has no guidance embedding (guidance_embeds=False)")
            return None
        return DEFAULT_DISTILLED_GUIDANCE if params.distilled_guidance is None else float(params.distilled_guidance)

    # ------------------------------------------------------------------ prompts
    def _call_text_length(self, longest: int, params: SamplingParams) -> int:
        # Every prompt gives the same fixed length: T5's states padded to max_sequence_length.
        return params.max_sequence_length

    def text_lengths(self, prompts: Sequence[str]) -> list[int]:
        """T5 tokens each prompt has before the pipeline pads it (its text is always max_sequence_length)."""
        return [len(self.pipe.tokenizer_2(p).input_ids) for p in prompts]

    def _encode(self, prompt: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (prompt, max_length)
        if key in self._cache:
            self.stats["cache_hits"] += 1
            self._cache.move_to_end(key)
            return self._cache[key]
        self.stats["cache_misses"] += 1
        # One prompt per call: an embedding is a function of its prompt alone (see the base engine's cache).
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompt, prompt_2=None, device=self.device,
                                                    max_sequence_length=max_length)
        self._cache[key] = (embeds[0].float().clone(), pooled[0].float().clone())
        while len(self._cache) > self.embed_cache_size:
            self._cache.popitem(last=False)
        return self._cache[key]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str], max_length: int | None = None) -> list[torch.Tensor]:
        """T5 states of each prompt as `FluxPipeline.encode_prompt` computes them: a list of [max_length, D] fp32
        (max_length: the call's `max_sequence_length`)."""
        length = 512 if max_length is None else max_length  # the pipeline's default
        return [self._encode(p, length)[0] for p in prompts]

    def pooled_embeds(self, prompt: str, max_length: int) -> torch.Tensor:
        """The pooled CLIP embedding [P] fp32 of `prompt`."""
        return self._encode(prompt, max_length)[1]

    def _new_sample(self, index: int, prompt: str, group_id: int, seed: int, params: SamplingParams, text, neg_text,
                    text_length: int | None = None) -> _Sample:
        s = super()._new_sample(index, prompt, group_id, seed, params, text, neg_text, text_length)
        s.text_length = self._call_text_length(0, params)
        s.pooled = self.pooled_embeds(prompt, params.max_sequence_length)
        if params.do_cfg:
            s.neg_pooled = self.pooled_embeds(params.negative_prompt, params.max_sequence_length)
        s.distilled_guidance = self.distilled_guidance(params)
        return s

    # ------------------------------------------------------------------ decode
    @torch.no_grad()
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents [B, S, C] -> images [B, 3, H, W] fp32 in [0, 1] (FluxPipeline's decode and
        post-processing)."""
        pipe, vae = self.pipe, self.pipe.vae
        lat = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(vae.dtype)
        lat = lat / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(lat, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type="pt").float()

    def transformer_config(self) -> dict[str, Any]:
        """The diffusers config of the transformer (what `model_providers.flux` builds from)."""
        return dict(self.transformer.config)
