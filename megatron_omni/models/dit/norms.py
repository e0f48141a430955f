"""RMSNorm with diffusers' rounding order, so our model's bf16 activations equal the diffusers transformer's.

torch's `nn.RMSNorm` multiplies the fp32 normalised value by the weight and rounds once to the input dtype;
diffusers' `RMSNorm` (which `QwenImageTransformer2DModel` uses for its text input and QK norms) first rounds
the normalised value to the (half-precision) weight's dtype, then multiplies by the weight in that dtype. In
bf16 the two differ by one rounding on about a third of the elements, which the rollout (diffusers) and the
trainer (this model) would see as a train/rollout log-prob gap. In fp32 both orders are the same math.
"""

from __future__ import annotations

import torch
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
