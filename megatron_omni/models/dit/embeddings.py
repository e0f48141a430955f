"""Timestep embedding, the interleaved 3D rotary position embeddings of the DiTs (Qwen-Image's centred image grid,
Wan's video grid from the origin) and the packing of video latents into 3D patch tokens."""

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

    `scale` multiplies the timestep inside the features (Qwen-Image: the model gets sigma and scales by 1000;
    Wan: it gets t = 1000 sigma, scale 1). `round_timestep`: the features read the timestep rounded to the
    compute dtype (Qwen-Image's pipeline passes it in the latents' dtype) or as given (Wan's passes fp32 t).
    """

    def __init__(self, hidden_size: int, channels: int = 256, dtype: torch.dtype = torch.float32,
                 scale: float = 1000.0, round_timestep: bool = True) -> None:
        super().__init__()
        self.channels = channels
        self.scale = scale
        self.round_timestep = round_timestep
        self.linear_1 = nn.Linear(channels, hidden_size, dtype=dtype)
        self.linear_2 = nn.Linear(hidden_size, hidden_size, dtype=dtype)
        for p in self.parameters():
            p.pipeline_parallel = True

    def forward(self, timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = timestep.to(dtype) if self.round_timestep else timestep
        feats = sinusoidal_timestep_features(t, self.channels, self.scale).to(dtype)
        return self.linear_2(nn.functional.silu(self.linear_1(feats)))


def _axis_inv_freq(dim: int, theta: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(dtype).div(dim))


def qwen_rope_angles(
    frame: int, height: int, width: int, text_len: int, axes_dims: tuple[int, int, int], theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation angles of image tokens [f*h*w, d/2] and text tokens [text_len, d/2] (fp32).

    Qwen-Image centres the image grid (`scale_rope=True`): height positions run -(h - h//2) .. h//2 - 1
    (likewise width), frames 0 .. f-1, and the text tokens continue after the image on all three axes at
    max(h//2, w//2) .. + text_len - 1. `height`/`width` are in patches.
    """
    return qwen_stream_rope_angles(((frame, height, width),), text_len, axes_dims, theta)


def qwen_stream_rope_angles(
    grids: tuple[tuple[int, int, int], ...], text_len: int, axes_dims: tuple[int, int, int], theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation angles of an image stream made of several grids one after another [sum f*h*w, d/2] and of the
    text tokens [text_len, d/2] (fp32), as diffusers' `QwenEmbedRope` builds them for `img_shapes[0]`.

    Grid k (the generated image first, then each conditioning image of Qwen-Image-Edit) takes frame positions
    k .. k + f - 1 and its own centred rows and columns; the text continues at max over the grids of
    max(h//2, w//2). One grid is plain Qwen-Image (`qwen_rope_angles`).
    """
    d_f, d_h, d_w = axes_dims
    parts = []
    for k, (frame, height, width) in enumerate(grids):
        frames = torch.arange(k, k + frame)
        rows = torch.cat([torch.arange(-(height - height // 2), 0), torch.arange(height // 2)])
        cols = torch.cat([torch.arange(-(width - width // 2), 0), torch.arange(width // 2)])
        ang_f = torch.outer(frames, _axis_inv_freq(d_f, theta))
        ang_h = torch.outer(rows, _axis_inv_freq(d_h, theta))
        ang_w = torch.outer(cols, _axis_inv_freq(d_w, theta))
        parts.append(torch.cat(
            [
                ang_f[:, None, None, :].expand(frame, height, width, -1),
                ang_h[None, :, None, :].expand(frame, height, width, -1),
                ang_w[None, None, :, :].expand(frame, height, width, -1),
            ],
            dim=-1,
        ).reshape(frame * height * width, -1))
    start = max(max(h // 2, w // 2) for _, h, w in grids)
    txt_pos = torch.arange(start, start + text_len)
    txt = torch.cat([torch.outer(txt_pos, _axis_inv_freq(a, theta)) for a in axes_dims], dim=-1)
    return torch.cat(parts), txt


def wan_rope_angles(frames: int, height: int, width: int, axes_dims: tuple[int, int, int],
                    theta: float = 10000.0) -> torch.Tensor:
    """Rotation angles [f*h*w, d/2] (float64) of Wan's video tokens, ordered (frame, row, column).

    diffusers' `WanRotaryPosEmbed`: positions run from 0 on every axis (no centring, no text positions: the text
    only meets the video in cross-attention, without RoPE); each axis' frequencies are computed in float64.
    `axes_dims` are the head-dim channels per axis (`WanConfig.rope_axes_dims`); `height`/`width` in patches.
    """
    axes = [torch.outer(torch.arange(n, dtype=torch.float64), _axis_inv_freq(a, theta, torch.float64))
            for n, a in zip((frames, height, width), axes_dims, strict=True)]
    f, h, w = (a.shape[-1] for a in axes)
    return torch.cat(
        [
            axes[0][:, None, None, :].expand(frames, height, width, f),
            axes[1][None, :, None, :].expand(frames, height, width, h),
            axes[2][None, None, :, :].expand(frames, height, width, w),
        ],
        dim=-1,
    ).reshape(frames * height * width, -1)


def patchify_video(video: torch.Tensor, patch: tuple[int, int, int]) -> torch.Tensor:
    """Video latents [b, c, F, H, W] -> packed 3D patch tokens [b, f*h*w, c*pt*ph*pw] (f = F/pt, ...).

    Tokens run over (frame, row, column), each token's channels over (c, pt, ph, pw): the flattening of a
    `Conv3d(kernel=stride=patch)` weight, so a patch embedding is one linear with that weight flattened."""
    b, c, big_f, big_h, big_w = video.shape
    pt, ph, pw = patch
    if big_f % pt or big_h % ph or big_w % pw:
        raise ValueError(f"video latents {tuple(video.shape[2:])} do not split into {tuple(patch)} patches")
    f, h, w = big_f // pt, big_h // ph, big_w // pw
    x = video.reshape(b, c, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return x.reshape(b, f * h * w, c * pt * ph * pw)


def unpatchify_video(tokens: torch.Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> torch.Tensor:
    """Inverse of `patchify_video`: [b, f*h*w, c*pt*ph*pw] with grid (f, h, w) -> [b, c, f*pt, h*ph, w*pw]."""
    b, s, channels = tokens.shape
    f, h, w = grid
    pt, ph, pw = patch
    if s != f * h * w or channels % (pt * ph * pw):
        raise ValueError(f"tokens {tuple(tokens.shape)} do not fit grid {tuple(grid)} and patch {tuple(patch)}")
    c = channels // (pt * ph * pw)
    x = tokens.reshape(b, f, h, w, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return x.reshape(b, c, f * pt, h * ph, w * pw)


def rope_rotations(angles: torch.Tensor) -> torch.Tensor:
    """Angles [s, d/2] (fp32, or float64 rounded once at the end) -> unit complex rotations e^{i angle} [s, d/2]
    (complex64), computed once per forward and shared by every block."""
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_interleaved_rope(x: torch.Tensor, rotations: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2k, 2k+1) of `x` [s, b, n, d] by `rotations` [s, d/2] (complex, from
    `rope_rotations`); math in fp32.

    This is Megatron's `rotary_interleaved=True` convention and diffusers' complex-multiply RoPE: one
    complex product instead of four real products and a stack.
    """
    xc = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)).contiguous())
    return torch.view_as_real(xc * rotations[:, None, None, :]).flatten(-2).to(x.dtype)


def flux_rope_angles(height: int, width: int, text_len: int, axes_dims: tuple[int, int, int],
                     theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation angles (float64) of FLUX.1's image tokens [h*w, d/2] (rows, then columns) and text tokens
    [text_len, d/2], as diffusers' `FluxPosEmbed` computes them from the FLUX pipeline's ids: an image token at
    patch (i, j) has ids (0, i, j), every text token (0, 0, 0) (all its angles 0: no rotation). Each axis' angles
    are float64 like `FluxPosEmbed`'s; `height`/`width` are in patches (packed 2x2 latent patches)."""
    axes = [torch.outer(torch.arange(n, dtype=torch.float64), _axis_inv_freq(a, theta, torch.float64))
            for n, a in zip((1, height, width), axes_dims, strict=True)]
    f, h, w = (a.shape[-1] for a in axes)
    img = torch.cat(
        [
            axes[0].expand(height, width, f),
            axes[1][:, None, :].expand(height, width, h),
            axes[2][None, :, :].expand(height, width, w),
        ],
        dim=-1,
    ).reshape(height * width, -1)
    return img, torch.zeros(text_len, sum(axes_dims) // 2, dtype=torch.float64)
