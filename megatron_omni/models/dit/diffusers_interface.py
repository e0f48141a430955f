"""Our DiT (the MMDiT, the Wan model) behind diffusers' `QwenImageTransformer2DModel.forward` keyword interface.

Rollout code (and the log-prob recompute it shares with the trainer) calls a velocity model the way
diffusers' pipeline calls its transformer; this adapter lets the Megatron model stand in. It needs the
whole model on this rank's pipeline (pp = 1); under context parallelism it runs on this rank's image
shard and all-gathers the output over the CP group (backward: each rank keeps its own slice, the right
adjoint when every CP rank computes the same loss on the gathered output).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from torch import nn

from megatron_omni.models.dit.model import DiTBatch, DiTStage


def gather_image_shards(out: torch.Tensor, cp_group: dist.ProcessGroup) -> torch.Tensor:
    """[b, s_img / cp, c] (this CP rank's image tokens) -> [b, s_img, c] on every CP rank; backward keeps
    each rank's own slice (the right adjoint when every CP rank computes the same loss on the result)."""
    if cp_group.size() == 1:
        return out
    return gather_from_sequence_parallel_region(
        out.transpose(0, 1).contiguous(), tensor_parallel_output_grad=False, group=cp_group
    ).transpose(0, 1)


def one_grid(img_shapes: list) -> tuple[int, int, int]:
    """The one (frames, height, width) patch grid of a batch's `img_shapes` ([[grid]] per row); ValueError
    when the rows differ or a row has several grids."""
    grids = {tuple(tuple(g) for g in shapes) for shapes in img_shapes}
    if len(grids) != 1 or len(next(iter(grids))) != 1:
        raise ValueError(f"one image grid per batch is supported, got {img_shapes}")
    return tuple(next(iter(grids))[0])


def stream_grids(img_shapes: list) -> tuple[tuple[int, int, int], ...]:
    """The patch grids of a batch's image stream from `img_shapes` ([grid, *condition grids] per row, as
    Qwen-Image-Edit's pipeline passes them): the generated latent's first, then each conditioning image's.
    ValueError when the rows differ."""
    rows = {tuple(tuple(g) for g in shapes) for shapes in img_shapes}
    if len(rows) != 1 or not next(iter(rows)):
        raise ValueError(f"one list of image grids per batch is supported, got {img_shapes}")
    return next(iter(rows))


class DiffusersForward(nn.Module):
    """`forward(hidden_states [b, s, c], encoder_hidden_states [b, l, d], encoder_hidden_states_mask [b, l],
    timestep [b] (= sigma), img_shapes [[(f, h, w), *condition grids]] * b, return_dict=False,
    pooled_projections [b, p] or None, guidance [b] (a guidance-distilled model's input) or None) ->
    ([b, s, c_out],)`; with condition grids (Qwen-Image-Edit) `s` counts the conditioning tokens too and so does the
    output."""

    def __init__(self, model: DiTStage) -> None:
        super().__init__()
        if not (model.pre_process and model.post_process):
            raise ValueError("the diffusers interface needs the whole model on one pipeline stage (pp=1)")
        self.model = model

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
        grid, *cond = stream_grids(img_shapes)
        out = self.model(DiTBatch(hidden_states, encoder_hidden_states, encoder_hidden_states_mask, timestep, grid,
                                  cond_grids=tuple(cond), pooled=pooled_projections, guidance=guidance))
        return (gather_image_shards(out, self.model.cp_group),)
