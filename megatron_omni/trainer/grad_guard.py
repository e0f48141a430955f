"""The NaN/inf guard both trainers run before each optimizer step: skip an update whose gradients are not
finite, and stop the run after `max_bad_steps` such updates in a row."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def grads_finite(ddp: Any, group: dist.ProcessGroup | None = None) -> bool:
    """Whether every gradient in Megatron-Core DDP's grad buffers is finite, agreed over the ranks of `group`
    (None: the job; a disaggregated job's trainer ranks otherwise).

    Every parameter's main_grad is a view into one of DDP's contiguous grad buffers (the padding between
    parameters stays zero), and a NaN/inf anywhere makes its sum NaN/inf: one reduction per buffer, no
    per-parameter pass and no mask. A sum of finite grads overflows only when their norm would too.
    """
    buffers = ddp.buffers + ddp.expert_parallel_buffers
    ok = torch.tensor([float(all(bool(torch.isfinite(b.grad_data.sum())) for b in buffers))])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)  # every rank skips together
    return bool(ok.item())


class GradGuard:
    """Counts updates with non-finite gradients in a row; `allow_update` says whether to step the optimizer.
    `setting` names the config field of `max_bad_steps` in the error; `group`: the ranks that agree (None: the
    job)."""

    def __init__(self, max_bad_steps: int, setting: str = "max_bad_steps",
                 group: dist.ProcessGroup | None = None) -> None:
        if max_bad_steps < 1:
            raise ValueError(f"{setting} must be >= 1, got {max_bad_steps}")
        self.max_bad_steps = max_bad_steps
        self.setting = setting
        self.bad_steps = 0
        self.group = group

    def allow_update(self, ddp: Any) -> bool:
        """True when the gradients are finite; False (skip this update) otherwise, raising FloatingPointError
        once `max_bad_steps` updates in a row were skipped."""
        if grads_finite(ddp, self.group):
            self.bad_steps = 0
            return True
        self.bad_steps += 1
        if self.bad_steps >= self.max_bad_steps:
            raise FloatingPointError(f"{self.bad_steps} updates in a row had NaN/inf gradients ({self.setting})")
        return False
