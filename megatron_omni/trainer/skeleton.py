"""The pieces every RL trainer shares, whatever the model family: which prompts and seeds a data-parallel
rank samples at a step, the order of the step's mini-batches, one update (zero the grads, backward,
finalize, the NaN guard, the optimizer and scheduler step), and the metrics every step writes
(`step_metrics`, `UpdateTally`; docs/metrics.md).

`StepResult` is what a step of either returns to the one run loop (`trainer.run`).
FlowGRPO (`trainer.flowgrpo`) and AR-DiT (`trainer.ar_dit`) both call these, so a sample's seed, a mini-batch's
rows and what an update does are the same for every family.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from megatron.core.distributed import finalize_model_grads

from megatron_omni.trainer.grad_guard import GradGuard

P = TypeVar("P")


@dataclass
class StepResult:
    """One RL step of a trainer, whatever the family. metrics: the step's scalars (metrics.jsonl); trajectory:
    this rank's samples in the trainer's own record (`Trajectory`, `ARDiTTrajectory`); rewards [N] fp32 of
    them; images [N, 3, H, W] fp32 in [0, 1] and prompts (N texts): what a sample grid shows."""

    metrics: dict[str, float]
    trajectory: Any
    rewards: torch.Tensor
    images: torch.Tensor
    prompts: list[str]

# The seed of sample k of global group g: seed * SEED_STRIDE + g * group_size + k (distinct for every run seed
# up to a million samples per run).
SEED_STRIDE = 1_000_003
# The mini-batch split of step s is drawn from a generator seeded seed * ORDER_STRIDE + s.
ORDER_STRIDE = 7919


def step_prompts(prompts: Sequence[P], seed: int, step: int, prompts_per_step: int, group_size: int,
                 dp_rank: int, dp_size: int) -> tuple[list[P], list[int], list[int]]:
    """This data-parallel rank's prompts, global group ids and per-sample seeds (`group_size` per prompt,
    row-major) for RL step `step`: the step's `prompts_per_step` global groups are dealt round-robin over
    the `dp_size` ranks, and prompt g is `prompts[g % len(prompts)]`."""
    mine = [step * prompts_per_step + i for i in range(prompts_per_step)][dp_rank::dp_size]
    seeds = [seed * SEED_STRIDE + g * group_size + k for g in mine for k in range(group_size)]
    return [prompts[g % len(prompts)] for g in mine], mine, seeds


def mini_batch_rows(n: int, seed: int, step: int, mini_batches: int) -> tuple[torch.Tensor, ...]:
    """RL step `step`'s mini-batches: a fixed random split of the rows 0..n-1 into `mini_batches` chunks
    (1-D long tensors), the same on every rank."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * ORDER_STRIDE + step))
    return order.chunk(mini_batches)


@dataclass
class UpdateResult:
    """What one `update` did: `stepped` (False: the guard skipped it), `ok` (the optimizer's own success flag,
    False when it skipped for overflow) and the pre-clip `grad_norm` (nan when skipped or unknown)."""

    stepped: bool
    ok: bool
    grad_norm: float


def update(ddp: Any, optimizer: Any, scheduler: Any, guard: GradGuard, pg_collection: Any,
           backward: Callable[[], Any]) -> tuple[UpdateResult, Any]:
    """One optimizer update of Megatron-Core DDP `ddp`: zero its grad buffers and the optimizer's grads, run
    `backward()` (the forward and backward of one mini-batch; its value is returned), finalize the grads
    (the data-parallel reduction), then step optimizer and scheduler unless `guard` finds non-finite grads."""
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    out = backward()
    finalize_model_grads([ddp], pg_collection=pg_collection)
    if not guard.allow_update(ddp):
        return UpdateResult(stepped=False, ok=False, grad_norm=math.nan), out
    ok, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    return UpdateResult(stepped=True, ok=bool(ok), grad_norm=float(grad_norm) if grad_norm is not None
                        else math.nan), out


@dataclass
class UpdateTally:
    """A step's optimizer updates, for the keys every trainer writes: `grad_norm` (mean pre-clip norm over the
    updates that stepped; nan when none did), `skipped_updates` (the guard's skips) and `lr` (after the step)."""

    norms: list[float] = field(default_factory=list)
    skipped: int = 0

    def add(self, result: UpdateResult) -> None:
        """Count one `update`'s result."""
        if result.stepped:
            self.norms.append(result.grad_norm)
        else:
            self.skipped += 1

    def metrics(self, optimizer: Any) -> dict[str, float]:
        """grad_norm, skipped_updates and the learning rate of the optimizer's first parameter group."""
        return {"grad_norm": sum(self.norms) / len(self.norms) if self.norms else math.nan,
                "skipped_updates": float(self.skipped), "lr": float(optimizer.param_groups[0]["lr"])}


def step_metrics(rewards: torch.Tensor, zero_std_ratio: float, dlogp: float, times: dict[str, float],
                 world_size: int) -> dict[str, float]:
    """The keys every trainer's step writes: reward_mean and reward_std (population) of the step's rewards [R]
    over all data-parallel ranks, zero_std_ratio, train_rollout_dlogp (mean |trainer - rollout| log-prob of
    the SDE window steps), time_<phase> per phase of `times` (seconds), time_step (their sum) and
    images_per_s_per_rank (R / time_step / world_size)."""
    total = sum(times.values())
    return {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(correction=0)),
            "zero_std_ratio": float(zero_std_ratio), "train_rollout_dlogp": float(dlogp),
            **{f"time_{k}": float(v) for k, v in times.items()}, "time_step": total,
            "images_per_s_per_rank": len(rewards) / total / world_size if total > 0 else math.nan}
