"""Wan2.2's two-expert (A14B) pipeline folders: `transformer` (the high-noise expert) and `transformer_2` (the
low-noise expert), switched at `boundary_ratio` of the scheduler's training timesteps, as diffusers' `WanPipeline`
samples them: a step at timestep `t = num_train_timesteps * sigma` runs `transformer` while
`t >= boundary_ratio * num_train_timesteps`, `transformer_2` below (Wan2.2-T2V-A14B: 0.875, I2V-A14B: 0.9).

The RL choice (the issue is silent): the policy the trainer updates is the low-noise expert, `transformer_2`
(`TRAINED_EXPERT`); the high-noise expert samples the early steps frozen. The SDE window (where log-probs are
recorded, so where the policy gradient and its recompute act) must lie wholly in the low-noise steps: the rollout
refuses a window that can reach a high-noise step (`check_window`), so every recorded transition was sampled by
the expert the trainer recomputes it with. Why the low-noise expert: one trained expert keeps the trainer's
one-model machinery (bridge plans, checkpoints, optimizer, LoRA, the sync probe at sigma 0.8 < every published
boundary) unchanged and trains 14B parameters, not 28B. The cost: the window is confined to the low-noise steps,
which at a high shift are the late ones (20 steps at boundary 0.875: steps 8-19 at shift 5.0, 13-19 at shift 12.0),
so RL acts on the detail the low-noise expert draws, not the layout the high-noise one sets; training the high-noise
expert too is not built.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

HIGH_NOISE_EXPERT = "transformer"
TRAINED_EXPERT = "transformer_2"  # the low-noise expert: the policy the trainer updates


@dataclass(frozen=True)
class TwoExperts:
    """The expert switch of a two-expert Wan pipeline folder."""

    boundary_ratio: float
    num_train_timesteps: int = 1000

    def high_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """[...] bool: the steps at `sigma` [...] (fp32) that `WanPipeline` runs on the high-noise expert. Its test is
        `t >= boundary_ratio * num_train_timesteps` with the scheduler's fp32 timestep `t = sigma * T`, which this
        computes the same way (the bound rounded to fp32 by the comparison, as torch rounds it there)."""
        t = sigma.float() * self.num_train_timesteps
        return t >= self.boundary_ratio * self.num_train_timesteps

    def check_window(self, sigmas: torch.Tensor, first_step: int) -> None:
        """Refuse an SDE window that can start at step `first_step` of grid `sigmas` [T + 1] when that step runs on
        the high-noise expert (the trained expert is the low-noise one; sigmas decrease, so later steps are low
        noise too). Raises ValueError naming the first low-noise step."""
        high = self.high_noise(sigmas[:-1])
        if bool(high[first_step]):
            low = [i for i, h in enumerate(high.tolist()) if not h]
            raise ValueError(
                f"the SDE window can start at step {first_step}, a high-noise step of this two-expert (Wan2.2 A14B) "
                f"folder (t >= {self.boundary_ratio} x {self.num_train_timesteps}); the trained policy is the "
                f"low-noise expert ({TRAINED_EXPERT}), whose steps start at "
                f"{low[0] if low else 'no step of this grid'}: set rollout.window_range (or window_start) from there")


def read_two_experts(pipeline_dir: str | os.PathLike) -> TwoExperts | None:
    """The expert switch of a diffusers Wan pipeline folder (`model_index.json`'s `transformer_2` and
    `boundary_ratio`, the scheduler's `num_train_timesteps`), or None for a one-transformer folder. A folder with
    two transformers and no boundary (or a boundary without the second transformer) is refused by name."""
    root = Path(pipeline_dir)
    index = json.loads((root / "model_index.json").read_text())
    second = index.get(TRAINED_EXPERT)
    has_second = bool(second) and second[0] is not None
    ratio = index.get("boundary_ratio")
    if not has_second and ratio is None:
        return None
    if not has_second or ratio is None:
        raise ValueError(f"{root}: a two-expert Wan folder names both {TRAINED_EXPERT} and boundary_ratio in "
                         f"model_index.json; it has {TRAINED_EXPERT}={second!r}, boundary_ratio={ratio!r}")
    if not 0.0 < float(ratio) < 1.0:
        raise ValueError(f"{root}: boundary_ratio must lie in (0, 1), got {ratio}")
    steps = json.loads((root / "scheduler" / "scheduler_config.json").read_text()).get("num_train_timesteps", 1000)
    return TwoExperts(float(ratio), int(steps))


def expert_dirs(pipeline_dir: str | os.PathLike) -> dict[str, Path]:
    """{expert name: its transformer folder} of a two-expert folder, high-noise first (what the converter takes one
    at a time)."""
    root = Path(pipeline_dir)
    if read_two_experts(root) is None:
        raise ValueError(f"{root} is not a two-expert Wan folder (no {TRAINED_EXPERT}, no boundary_ratio)")
    return {name: root / name for name in (HIGH_NOISE_EXPERT, TRAINED_EXPERT)}
