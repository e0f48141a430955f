"""SD3.5's image latents as the packed tokens the rollout and the trainer carry, and diffusers'
`SD3Transformer2DModel` behind the velocity-model keyword interface (`algorithms.velocity`).

The trajectory holds a latent image `[c, H, W]` as `p x p` patch tokens `[S, c * p * p]` (rows, then columns;
each token's channels over (c, ph, pw): `embeddings.patchify_video` with one frame), so the SDE step and the
log-prob see the same elements whichever side computes them. diffusers' transformer takes the latent image, the
timestep `t = 1000 sigma`, the text states and the pooled CLIP embedding (`pooled_projections`), and attends to
the whole text (SD3's pipeline pads CLIP and T5 prompts to fixed lengths and masks nothing). Our Megatron
`SD3Model` takes the packed form behind `DiffusersForward` through the same two functions.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_omni.algorithms.schedule import NUM_TRAIN_TIMESTEPS
from megatron_omni.models.dit.diffusers_interface import one_grid
from megatron_omni.models.dit.embeddings import patchify_video, unpatchify_video


def pack_image_latents(latents: torch.Tensor, patch: int) -> torch.Tensor:
    """[b, c, H, W] -> packed patch tokens [b, (H/p)(W/p), c p p]."""
    return patchify_video(latents.unsqueeze(2), (1, patch, patch))


def unpack_image_latents(tokens: torch.Tensor, grid: tuple[int, int, int], patch: int) -> torch.Tensor:
    """Inverse of `pack_image_latents`: [b, h*w, c p p] on patch grid (1, h, w) -> [b, c, h p, w p]."""
    if grid[0] != 1:
        raise ValueError(f"an image has one frame, got patch grid {tuple(grid)}")
    return unpatchify_video(tokens, tuple(grid), (1, patch, patch))[:, :, 0]


class PackedSD3Transformer(nn.Module):
    """`forward(hidden_states [B, S, C], encoder_hidden_states [B, L, D], encoder_hidden_states_mask, timestep [B]
    (sigma), img_shapes, return_dict=False, pooled_projections [B, P]) -> ([B, S, C],)` around diffusers'
    `SD3Transformer2DModel.forward(hidden_states [B, c, H, W], encoder_hidden_states, pooled_projections, timestep
    [B] (1000 sigma), return_dict=False)`. The transformer stays reachable as `.transformer`."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer
        self.patch_size = int(transformer.config.patch_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: list,
        return_dict: bool = False,
        pooled_projections: torch.Tensor | None = None,
        **unused,
    ) -> tuple[torch.Tensor]:
        if pooled_projections is None:
            raise ValueError("SD3's transformer needs the pooled CLIP embeddings (pooled_projections)")
        image = unpack_image_latents(hidden_states, one_grid(img_shapes), self.patch_size)
        out = self.transformer(hidden_states=image, encoder_hidden_states=encoder_hidden_states,
                               pooled_projections=pooled_projections,
                               timestep=timestep.float() * NUM_TRAIN_TIMESTEPS, return_dict=False)[0]
        return (pack_image_latents(out, self.patch_size),)
