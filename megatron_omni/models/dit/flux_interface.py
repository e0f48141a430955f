"""diffusers' `FluxTransformer2DModel` behind the velocity-model keyword interface (`algorithms.velocity`).

The trajectory holds FLUX's own packed latents (the pipeline's `_pack_latents`: 2 x 2 patches of the 16-channel
latent, channels over (c, ph, pw): `embeddings.patchify_video` with one frame), which is what both diffusers'
transformer and our Megatron `FluxModel` take, so only the position ids and the conditioning inputs are added here:
image ids (0, row, column) on the batch's patch grid, text ids 0, the pooled CLIP embedding and, for a
guidance-distilled model, the guidance scale. The timestep is sigma in the compute dtype, as `FluxPipeline` passes
`timestep / 1000`.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_omni.models.dit.diffusers_interface import one_grid


def flux_image_ids(height: int, width: int, device: torch.device | None = None) -> torch.Tensor:
    """FluxPipeline's image ids [h*w, 3] of a patch grid: (0, row, column) per packed patch."""
    ids = torch.zeros(height, width, 3, device=device)
    ids[..., 1] = torch.arange(height, device=device)[:, None]
    ids[..., 2] = torch.arange(width, device=device)[None, :]
    return ids.reshape(height * width, 3)


class PackedFluxTransformer(nn.Module):
    """`forward(hidden_states [B, S, C], encoder_hidden_states [B, L, D], encoder_hidden_states_mask, timestep [B]
    (sigma), img_shapes, return_dict=False, pooled_projections [B, P], guidance [B] or None) -> ([B, S, C],)` around
    diffusers' `FluxTransformer2DModel.forward` (the mask is not read: FLUX attends to the whole padded T5 text, as
    its pipeline does). The transformer stays reachable as `.transformer`."""

    def __init__(self, transformer: nn.Module) -> None:
        super().__init__()
        self.transformer = transformer

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: list,
        return_dict: bool = False,
        pooled_projections: torch.Tensor | None = None,
        guidance: torch.Tensor | None = None,
        **unused,
    ) -> tuple[torch.Tensor]:
        if pooled_projections is None:
            raise ValueError("FLUX's transformer needs the pooled CLIP embeddings (pooled_projections)")
        if self.transformer.config.guidance_embeds and guidance is None:
            raise ValueError("a guidance-distilled FLUX transformer needs the guidance scale (guidance)")
        f, h, w = one_grid(img_shapes)
        if f != 1:
            raise ValueError(f"an image has one frame, got patch grid {(f, h, w)}")
        dev = hidden_states.device
        txt_ids = torch.zeros(encoder_hidden_states.shape[1], 3, device=dev)
        out = self.transformer(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                               pooled_projections=pooled_projections, timestep=timestep,
                               img_ids=flux_image_ids(h, w, dev), txt_ids=txt_ids,
                               guidance=guidance if self.transformer.config.guidance_embeds else None,
                               return_dict=False)[0]
        return (out,)
