"""A Wan-style video transformer (diffusers' `WanTransformer3DModel`, vLLM-Omni's Wan2.2 module) behind the
velocity-model keyword interface the rollout and the log-prob recompute call (`algorithms.velocity`).

That interface is diffusers' Qwen-Image one: `hidden_states [B, S, C]` packed tokens, `encoder_hidden_states
[B, L, D]`, `encoder_hidden_states_mask [B, L]`, `timestep [B]` (sigma, as `schedule.model_timesteps` gives it),
`img_shapes` the patch grid, returning `([B, S, C],)`. For video the packed tokens are 3D patches
(`embeddings.patchify_video`: channels ordered c, pt, ph, pw); Wan's transformer takes the latent video
`[B, c, F, H, W]` and the timestep `t = 1000 sigma` (fp32) and ignores the text mask (its pipeline attends to
the zero padding). Our Megatron `WanModel` takes the packed form directly (behind `DiffusersForward`), so
both sides of a train/rollout comparison run the same packing.
"""

from __future__ import annotations

import torch
from torch import nn

from megatron_omni.algorithms.schedule import NUM_TRAIN_TIMESTEPS
from megatron_omni.models.dit.diffusers_interface import one_grid
from megatron_omni.models.dit.embeddings import patchify_video, unpatchify_video


class PackedVideoTransformer(nn.Module):
    """`forward(hidden_states [B, S, C], encoder_hidden_states [B, L, D], encoder_hidden_states_mask, timestep [B]
    (sigma), img_shapes, return_dict=False) -> ([B, S, C],)` around a Wan transformer's
    `forward(hidden_states [B, c, F, H, W], timestep [B] (1000 sigma), encoder_hidden_states, return_dict=False)`.

    `patch_size` is the transformer's (pt, ph, pw). A per-token timestep [B, S] (image-to-video's clean first
    frame at 0) goes to the transformer per token, as do all timesteps with `expand_timesteps` (Wan2.2 TI2V's
    pipelines expand them). The transformer stays reachable as `.transformer` (the engine loads weights into it)."""

    def __init__(self, transformer: nn.Module, patch_size: tuple[int, int, int],
                 expand_timesteps: bool = False) -> None:
        super().__init__()
        self.transformer = transformer
        self.patch_size = tuple(patch_size)
        self.expand_timesteps = expand_timesteps

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_mask: torch.Tensor | None,
        timestep: torch.Tensor,
        img_shapes: list,
        return_dict: bool = False,
        **unused,
    ) -> tuple[torch.Tensor]:
        grid = one_grid(img_shapes)
        video = unpatchify_video(hidden_states, grid, self.patch_size)
        t = timestep.float() * NUM_TRAIN_TIMESTEPS
        if self.expand_timesteps and t.ndim == 1:
            t = t[:, None].expand(-1, hidden_states.shape[1])  # Wan2.2 TI2V's pipelines pass one per token
        out = self.transformer(hidden_states=video, timestep=t, encoder_hidden_states=encoder_hidden_states,
                               return_dict=False)[0]
        return (patchify_video(out, self.patch_size),)
