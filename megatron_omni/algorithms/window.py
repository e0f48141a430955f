"""The SDE window: noise (and training) only on steps [k, k + W) of the T sampling steps.

As flow_grpo and VeRL-Omni draw it: `k` uniform in `[lo, hi - W]` (inclusive) so the whole window lies
inside `window_range = [lo, hi)`; every other step is the deterministic ODE step (noise level 0).
"""

from __future__ import annotations

import torch


def check_window(num_steps: int, window_size: int, window_range: tuple[int, int]) -> None:
    """Raise ValueError naming the problem when the window cannot fit the grid."""
    lo, hi = window_range
    if window_size < 1:
        raise ValueError(f"window_size must be >= 1, got {window_size}")
    if not 0 <= lo < hi <= num_steps:
        raise ValueError(f"window_range {window_range} must satisfy 0 <= lo < hi <= num_steps={num_steps}")
    if hi - lo < window_size:
        raise ValueError(f"window_range {window_range} is shorter than window_size {window_size}")


def sample_window_start(
    num_steps: int, window_size: int, window_range: tuple[int, int], generator: torch.Generator | None = None
) -> int:
    """Draw the window start k uniformly from [lo, hi - W] with `generator` (deterministic per seed)."""
    check_window(num_steps, window_size, window_range)
    lo, hi = window_range
    return int(torch.randint(lo, hi - window_size + 1, (1,), generator=generator).item())


def window_noise_levels(
    num_steps: int, window_start: int, window_size: int, noise_level: float
) -> torch.Tensor:
    """Noise level per step: `noise_level` on [k, k + W), 0 (ODE) elsewhere. Returns float32 [T]."""
    check_window(num_steps, window_size, (window_start, window_start + window_size))
    if noise_level <= 0:
        raise ValueError(f"noise_level must be > 0 inside the window, got {noise_level}")
    levels = torch.zeros(num_steps, dtype=torch.float32)
    levels[window_start : window_start + window_size] = noise_level
    return levels


def window_step_indices(window_start: torch.Tensor | int, window_size: int) -> torch.Tensor:
    """Step indices of the window: [B] starts (or an int) -> [B, W] (or [W]) long."""
    start = torch.as_tensor(window_start, dtype=torch.long)
    offsets = torch.arange(window_size, dtype=torch.long)
    return start.unsqueeze(-1) + offsets if start.ndim else start + offsets
