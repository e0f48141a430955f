"""The DiTs' RMSNorms: `RMSNorm` with diffusers' rounding order, so our model's bf16 activations equal the
diffusers transformer's, and `HeadsRMSNorm`, Wan's q/k norm over all heads of a tensor-parallel projection.

torch's `nn.RMSNorm` multiplies the fp32 normalised value by the weight and rounds once to the input dtype;
diffusers' `RMSNorm` (which `QwenImageTransformer2DModel` uses for its text input and QK norms) first rounds
the normalised value to the (half-precision) weight's dtype, then multiplies by the weight in that dtype. In
bf16 the two differ by one rounding on about a third of the elements, which the rollout (diffusers) and the
trainer (this model) would see as a train/rollout log-prob gap. In fp32 both orders are the same math.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from torch import nn


class RMSNorm(nn.Module):
    """`x [..., dim] -> x / rms(x) * weight` over the last dim, weight [dim] in `dtype`; the statistics in
    fp32, the result rounded to the weight's dtype before the weight multiplies it (diffusers' order)."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.to(torch.float32).pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        if self.weight.dtype in (torch.float16, torch.bfloat16):
            x = x.to(self.weight.dtype)
        return x * self.weight


class HeadsRMSNorm(nn.Module):
    """RMSNorm over all attention heads of a tensor-parallel projection: `x [..., dim / tp]` (this rank's
    heads) -> `x / rms(x over every rank's heads) * weight`, weight [dim / tp] this rank's slice.

    Wan normalises q and k across heads (diffusers' `qk_norm="rms_norm_across_heads"`, a `torch.nn.RMSNorm`
    over the whole projection), so under tensor parallelism the sum of squares is all-reduced over tp. Backward
    all-reduces its gradient as well: every rank's loss depends on the shared statistic through its own heads.
    Statistics and the product with the weight in fp32, rounded once to the input dtype (vLLM-Omni's
    `DistributedRMSNorm` does the same). The weight is marked tensor-parallel (partition dim 0), so checkpoints,
    the grad norm and the optimizer treat it as the split tensor it is.
    """

    def __init__(self, dim_local: int, eps: float, tp_group, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.eps = eps
        self.tp_group = tp_group
        self.tp_size = tp_group.size() if tp_group is not None else 1
        self.dim = dim_local * self.tp_size
        self.weight = nn.Parameter(torch.ones(dim_local, dtype=dtype))
        set_tensor_model_parallel_attributes(self.weight, self.tp_size > 1, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        sum_sq = xf.pow(2).sum(-1, keepdim=True)
        if self.tp_size > 1:
            # all-reduce forward (reduce_from) and backward (copy_to's adjoint)
            sum_sq = reduce_from_tensor_model_parallel_region(
                copy_to_tensor_model_parallel_region(sum_sq, group=self.tp_group), group=self.tp_group)
        return (xf * torch.rsqrt(sum_sq / self.dim + self.eps) * self.weight.float()).to(x.dtype)
