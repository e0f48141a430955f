"""The embedded rollout engine for FLUX.1 text-to-image: `FluxPipeline`'s components from a diffusers folder, driven
by the same SDE step and step-wise continuous batching as the image engine, producing the same `Trajectory` record.
It is the SD3.5 engine's (`SD3RolloutEngine`: one prompt per encoder call, cached with its pooled embedding; 2 x 2
patch tokens; plain CFG; the VAE's scaling and shift) with FLUX's differences:

- Latents: the pipeline's 16-channel latent `[16, H / 8, W / 8]` drawn from each sample's generator exactly as
  `FluxPipeline.prepare_latents` draws it, packed 2 x 2 (`FluxPipeline._pack_latents`, the same layout as the SD3
  engine's patch tokens: the trajectory's tokens are the transformer's own input); the transformer runs behind
  `PackedFluxTransformer`.
- Sigma grid: the scheduler's resolution-dependent (dynamic) shift, the same grid function as Qwen-Image's
  (`FluxPipeline` computes `mu` from the image tokens with the scheduler config's constants).
- Text: `FluxPipeline.encode_prompt`: T5's states padded to `max_sequence_length` tokens, all attended (the mask is
  all ones), and CLIP's pooled output, carried in the trajectory (`Trajectory.pooled_embeds`).
- Guidance: FLUX.1-dev is guidance-distilled: the guidance scale is a model input (`SamplingParams.distilled_guidance`,
  default `FluxPipeline`'s 3.5), recorded per sample in `Trajectory.distilled_guidance`; no true CFG by default
  (the family's traits refuse `rollout.guidance_scale > 1`; called directly with a negative prompt the engine guides
  plainly, as `FluxPipeline`'s `true_cfg_scale` does, without per-token rescale).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from megatron_omni.algorithms.velocity import VelocityModel
from megatron_omni.models.dit.flux_interface import PackedFluxTransformer
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine, _Sample
from megatron_omni.rollout.diffusers_engines.sd3 import SD3RolloutEngine

DEFAULT_DISTILLED_GUIDANCE = 3.5  # FluxPipeline's default `guidance_scale` (FLUX.1-dev's model card uses 3.5)


class FluxRolloutEngine(SD3RolloutEngine):
    """Rollout with diffusers' FLUX.1 components (see the module docstring); the arguments are
    `DiffusersRolloutEngine`'s (`model_path`: a diffusers `FluxPipeline` folder)."""

    default_max_sequence_length = 512  # FluxPipeline's
    # The resolution-shifted grid of the image engine (Qwen-Image's function), not SD3.5's static shift.
    _grid_shift = DiffusersRolloutEngine._grid_shift
    _sigmas = DiffusersRolloutEngine._sigmas

    def _load_pipeline(self, model_path: str | os.PathLike, dtype: torch.dtype):
        from diffusers import FluxPipeline

        return FluxPipeline.from_pretrained(model_path, local_files_only=True, dtype=dtype)

    @property
    def patch_size(self) -> int:
        return 2  # FLUX packs 2 x 2 latent patches before the transformer (whose own patch_size is 1)

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

    def _pipeline_encode(self, prompt: str, max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, _ = self.pipe.encode_prompt(prompt=prompt, prompt_2=None, device=self.device,
                                                    max_sequence_length=max_length)
        return embeds, pooled

    def _new_sample(self, index: int, prompt: str, group_id: int, seed: int, params: SamplingParams, text, neg_text,
                    text_length: int | None = None) -> _Sample:
        s = super()._new_sample(index, prompt, group_id, seed, params, text, neg_text, text_length)
        s.distilled_guidance = self.distilled_guidance(params)
        return s
