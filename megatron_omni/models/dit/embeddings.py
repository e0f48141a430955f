"""Timestep embedding and the interleaved 3D rotary position embedding of Qwen-Image-style MMDiTs."""

from __future__ import annotations

import math

import torch
from torch import nn


def sinusoidal_timestep_features(timestep: torch.Tensor, channels: int, scale: float = 1000.0) -> torch.Tensor:
    """Sinusoidal features of `timestep` [b] -> [b, channels], ordered (cos, sin), fp32.

    Same as diffusers' `Timesteps(channels, flip_sin_to_cos=True, downscale_freq_shift=0, scale=scale)`.
    """
    half = channels // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half
    args = scale * (timestep[:, None].float() * torch.exp(exponent)[None, :])
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    """sigma [b] -> conditioning vector [b, hidden]: sinusoidal features, Linear, SiLU, Linear.

    Replicated on every tensor- and pipeline-parallel rank (it is tiny); its parameters are marked
    `pipeline_parallel` so Megatron-Core sums their grads across pipeline stages.
    """

    def __init__(self, hidden_size: int, channels: int = 256, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.channels = channels
        self.linear_1 = nn.Linear(channels, hidden_size, dtype=dtype)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, dtype=dtype)
        for p in self.parameters():
            p.pipeline_parallel = True

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        feats = sinusoidal_timestep_features(timestep.to(dtype), self.channels).to(dtype)
        return self.linear_2(nn.functional.silu(self.linear_1(feats)))


def _axis_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim))


def qwen_rope_angles(
    frame: int, height: int, width: int, text_len: int, axes_dims: tuple[int, int, int], theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation angles of image tokens [f*h*w, d/2] and text tokens [text_len, d/2] (fp32).

    Qwen-Image centres the image grid (`scale_rope=True`): height positions run -(h - h//2) .. h//2 - 1
    (likewise width), frames 0 .. f-1, and the text tokens continue after the image on all three axes at
    max(h//2, w//2) .. + text_len - 1. `height`/`width` are in patches.
    """
    d_f, d_h, d_w = axes_dims
    frames = torch.arange(frame)
    rows = torch.cat([torch.arange(-(height - height // 2), 0), torch.arange(height // 2)])
    cols = torch.cat([torch.arange(-(width - width // 2), 0), torch.arange(width // 2)])
    ang_f = torch.outer(frames, _axis_inv_freq(d_f, theta))
    ang_h = torch.outer(rows, _axis_inv_freq(d_h, theta))
    ang_w = torch.outer(cols, _axis_inv_freq(d_w, theta))
    img = torch.cat(
        [
            ang_f[:, None, None, :].expand(frame, height, width, -1),
            ang_h[None, :, None, :].expand(frame, height, width, -1),
            ang_w[None, None, :, :].expand(frame, height, width, -1),
        ],
        dim=-1,
    ).reshape(frame * height * width, -1)
    start = max(height // 2, width // 2)
    txt_pos = torch.arange(start, start + text_len)
    txt = torch.cat([torch.outer(txt_pos, _axis_inv_freq(a, theta)) for a in axes_dims], dim=-1)
    return img, txt


def rope_rotations(angles: torch.Tensor) -> torch.Tensor:
    """Angles [s, d/2] (fp32) -> unit complex rotations e^{i angle} [s, d/2] (complex64), computed once per
    forward and shared by every block."""
    return torch.polar(torch.ones_like(angles), angles)


def apply_interleaved_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2k, 2k+1) of `x` [s, b, n, d] by `rotations` [s, d/2] (complex, from
    `rope_rotations`); math in fp32.

    This is Megatron's `rotary_interleaved=True` convention and diffusers' complex-multiply RoPE: one
    complex product instead of four real products and a stack.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(xc * rotations[:, None, None, :]).flatten(-2).to(x.dtype)
