"""The flow-matching sampling grid of Qwen-Image: sigmas with the dynamic exponential shift.

Mirrors what diffusers' `QwenImagePipeline` + `FlowMatchEulerDiscreteScheduler.set_timesteps` compute,
in the same float32 order of operations, so the grid is bit-identical to diffusers' `scheduler.sigmas`:

    base  = linspace(1, 1/T, T)                       (float64, then cast to float32 like the scheduler)
    mu    = calculate_shift(image_seq_len, 256, 4096, 0.5, 1.15)
    s     = e^mu / (e^mu + (1/base - 1))              (exponential time shift)
    s     = 1 - (1 - s) / ((1 - s[-1]) / (1 - shift_terminal))     only when shift_terminal is set
    sigmas = [s, 0]                                   (T + 1 values, decreasing from 1 to 0)

The model's timestep input is `1000 * s` (the pipeline then divides by 1000 again).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

NUM_TRAIN_TIMESTEPS = 1000


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """The resolution-dependent shift `mu`: linear in the number of image tokens (diffusers' formula)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


@dataclass(frozen=True)
class ShiftConfig:
    """The scheduler settings that shape the grid (defaults: diffusers' pipeline fallbacks)."""

    base_seq_len: int = 256
    max_seq_len: int = 4096
    base_shift: float = 0.5
    max_shift: float = 1.15
    shift_terminal: float | None = None
    time_shift_type: str = "exponential"

    @classmethod
    def from_scheduler_config(cls, config: Mapping[str, Any]) -> ShiftConfig:
        """Read a `FlowMatchEulerDiscreteScheduler` config (a dict or FrozenDict).

        Raises ValueError for settings this grid does not reproduce (static shift, karras/exponential/beta
        sigmas, inverted sigmas) rather than silently computing a different grid.
        """
        if not config.get("use_dynamic_shifting", False):
            raise ValueError("scheduler config: use_dynamic_shifting must be true for the Qwen-Image grid")
        for flag in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas"):
            if config.get(flag, False):
                raise ValueError(f"scheduler config: {flag}=True is not supported by the Qwen-Image grid")
        if config.get("num_train_timesteps", NUM_TRAIN_TIMESTEPS) != NUM_TRAIN_TIMESTEPS:
            raise ValueError(f"scheduler config: num_train_timesteps must be {NUM_TRAIN_TIMESTEPS}")
        shift_type = config.get("time_shift_type", "exponential")
        if shift_type not in ("exponential", "linear"):
            raise ValueError(f"scheduler config: unknown time_shift_type {shift_type!r}")
        return cls(
            base_seq_len=int(config.get("base_image_seq_len", 256)),
            max_seq_len=int(config.get("max_image_seq_len", 4096)),
            base_shift=float(config.get("base_shift", 0.5)),
            max_shift=float(config.get("max_shift", 1.15)),
            shift_terminal=config.get("shift_terminal") or None,
            time_shift_type=shift_type,
        )


def qwen_image_sigmas(num_steps: int, image_seq_len: int, shift: ShiftConfig | None = None) -> torch.Tensor:
    """The sampling grid `s_0 = 1 > s_1 > ... > s_{T-1} > s_T = 0` for `num_steps` = T denoising steps.

    Args:
        num_steps: T, the number of denoising steps (>= 1).
        image_seq_len: number of packed image tokens ((H/16) * (W/16) for Qwen-Image).
        shift: scheduler settings; None means the pipeline defaults (256, 4096, 0.5, 1.15).

    Returns:
        float32 tensor of shape [T + 1].
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if image_seq_len < 1:
        raise ValueError(f"image_seq_len must be >= 1, got {image_seq_len}")
    shift = shift or ShiftConfig()
    # The pipeline builds the base grid with numpy in float64, the scheduler casts it to float32.
    base = torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64).to(torch.float32)
    sigmas = shift_sigmas(base, image_seq_len, shift)
    if shift.shift_terminal:
        one_minus = 1 - sigmas
        scale = one_minus[-1] / (1 - shift.shift_terminal)
        sigmas = 1 - (one_minus / scale)
    return torch.cat([sigmas.to(torch.float32), torch.zeros(1, dtype=torch.float32)])


def shift_sigmas(base: torch.Tensor, image_seq_len: int, shift: ShiftConfig | None = None) -> torch.Tensor:
    """The resolution-dependent time shift `c / (c + (1 / base - 1))` of noise levels `base` in (0, 1] (any
    shape, float32), with c = e^mu (exponential) or mu (linear): the density the sampling grid has, which
    pretraining also draws its noise levels from. Same shape as `base`."""
    shift = shift or ShiftConfig()
    mu = calculate_shift(
        image_seq_len, shift.base_seq_len, shift.max_seq_len, shift.base_shift, shift.max_shift
    )
    # Tensor-by-tensor divisions on purpose: `scalar / tensor` in torch is `reciprocal(tensor) * scalar`,
    # one rounding more than numpy's true division, and the grid would drift from diffusers' by an ulp.
    one = torch.ones_like(base)
    c = torch.full_like(base, math.exp(mu) if shift.time_shift_type == "exponential" else mu)
    return torch.div(c, c + (torch.div(one, base) - 1))


def model_timesteps(sigmas: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The transformer's timestep input for each sigma in the model's compute `dtype`, exactly as
    `QwenImagePipeline` passes it: the scheduler's `t = sigma * 1000` (float32) is cast to the latents' dtype,
    then divided by 1000 in that dtype, so bf16 gets bf16(bf16(1000 sigma) / 1000), not bf16(sigma) (one bf16
    step apart at about a quarter of the grid points). Same shape as `sigmas`."""
    return (sigmas.to(torch.float32) * NUM_TRAIN_TIMESTEPS).to(dtype) / NUM_TRAIN_TIMESTEPS


def static_shift_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """The grid `s_0 > ... > s_T = 0` of a `FlowMatchEulerDiscreteScheduler(shift=shift)` without dynamic shifting
    (Wan's), as its `set_timesteps(num_steps)` computes it: float32 [T + 1].

    The scheduler shifts its training grid once at construction (`s_max = 1`, `s_min = shift(1/1000)`), then
    `set_timesteps` spaces T points from `1000 s_max` to `1000 s_min` and shifts them again: `s -> shift s /
    (1 + (shift - 1) s)`, in float64 (numpy), cast to float32 at the end; then 0 is appended.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be positive, got {shift}")
    # the scheduler's own float32 training grid end points, read back as Python floats
    train_min = torch.tensor(1.0 / NUM_TRAIN_TIMESTEPS, dtype=torch.float32)
    s_max = float(torch.tensor(1.0, dtype=torch.float32) * shift / (1 + (shift - 1) * torch.tensor(1.0)))
    s_min = float(shift * train_min / (1 + (shift - 1) * train_min))
    t = torch.linspace(s_max * NUM_TRAIN_TIMESTEPS, s_min * NUM_TRAIN_TIMESTEPS, num_steps, dtype=torch.float64)
    s = t / NUM_TRAIN_TIMESTEPS
    s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([s.to(torch.float32), torch.zeros(1, dtype=torch.float32)])


def static_shift_of(config: Mapping[str, Any]) -> float:
    """The static time shift of a scheduler config: `FlowMatchEulerDiscreteScheduler` without dynamic shifting
    (`shift`) or a `UniPCMultistepScheduler` with flow sigmas (`flow_shift`: Wan's published pipelines; our
    sampler then runs the Euler/SDE steps on the Euler grid of that shift). Raises ValueError for a config that
    is neither."""
    cls = config.get("_class_name", "FlowMatchEulerDiscreteScheduler")
    if cls == "UniPCMultistepScheduler" and config.get("use_flow_sigmas", False):
        return float(config.get("flow_shift", 1.0))
    if cls == "FlowMatchEulerDiscreteScheduler" and not config.get("use_dynamic_shifting", False):
        for flag in ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas", "invert_sigmas",
                     "shift_terminal"):
            if config.get(flag):
                raise ValueError(f"scheduler config: {flag}={config[flag]!r} is not supported by the static grid")
        if config.get("num_train_timesteps", NUM_TRAIN_TIMESTEPS) != NUM_TRAIN_TIMESTEPS:
            raise ValueError(f"scheduler config: num_train_timesteps must be {NUM_TRAIN_TIMESTEPS}")
        return float(config.get("shift", 1.0))
    raise ValueError(f"scheduler config ({cls}) has no static flow shift: a FlowMatchEulerDiscreteScheduler without "
                     "dynamic shifting or a UniPCMultistepScheduler with use_flow_sigmas is needed")
