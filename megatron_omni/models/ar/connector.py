"""The connector of an AR-DiT hybrid: the decoder's hidden states -> the DiT's text-conditioning width.

RMSNorm over the decoder width, then one linear layer to the DiT's `joint_attention_dim` (which the DiT then
normalises again with its own `txt_norm` and projects with `txt_in`). It is small (h * j weights) and kept
replicated over tensor parallelism: its inputs are the decoder's full (gathered) hidden states, identical on
every tp rank, so its gradients agree across tp without communication.
"""

from __future__ import annotations

import torch
from torch import nn


class Connector(nn.Module):
    """`forward(hidden [..., decoder_hidden]) -> [..., joint_attention_dim]`."""

    def __init__(self, decoder_hidden: int, joint_attention_dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(decoder_hidden, eps=eps)
        self.proj = nn.Linear(decoder_hidden, joint_attention_dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(hidden))
