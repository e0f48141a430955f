"""Advice for a job that does not fit: changes of the job's config fields (and of its GPU count) that the
planner has planned again and found to fit. Nothing is suggested unchecked: a candidate is listed only when
its own plan is valid and its peak memory fits.

The search is small and stated: one change at a time of recompute (to a mode that keeps less), parallel.tp
(a larger divisor of the heads), parallel.ulysses, parallel.pp, optim.distributed_optimizer, a smaller
optim.micro_batch_size, or 2x / 4x the trainer GPUs; when no single change fits, every pair of them, then
every three.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import combinations

from megatron_omni.parallel.layout import LayoutError
from megatron_omni.planner.arch import arch_of
from megatron_omni.planner.job import JobPlan, fits, plan_job, total_bytes
from megatron_omni.planner.memory import RECOMPUTE_MODES

# A change: `--set` overrides and a world-size factor (1 = same GPUs).
Change = tuple[tuple[str, ...], int]


@dataclass(frozen=True)
class Suggestion:
    """One change that fits: `overrides` are `field=value` strings for `--set`, `world_size` the trainer ranks
    it needs (the job's own when unchanged), `total_bytes` / `step_s` its planned peak memory and step time."""

    overrides: tuple[str, ...]
    world_size: int
    total_bytes: int
    capacity: int
    step_s: float
    images_per_s_per_gpu: float

    def describe(self, world_size: int) -> str:
        """`WORLD_SIZE=N --set a=b ...` (WORLD_SIZE only when it changes)."""
        parts = [f"WORLD_SIZE={self.world_size}"] if self.world_size != world_size else []
        return " ".join(parts + [f"--set {o}" for o in self.overrides])


def _single_changes(job: JobPlan, micro_batch_size: int) -> Iterator[Change]:
    lay, cfg = job.layout, arch_of(job.model).config
    for mode in RECOMPUTE_MODES[RECOMPUTE_MODES.index(job.recompute) + 1:]:
        yield (f"model.recompute={mode}",), 1
    heads = cfg["num_attention_heads"]
    for tp in range(lay.tp + 1, heads + 1):
        if heads % tp == 0:
            yield (f"parallel.tp={tp}",), 1
    for ulysses in (2, 4, 8):
        if ulysses > lay.ulysses:
            yield (f"parallel.ulysses={ulysses}",), 1
    for pp in (2, 4):
        if pp > lay.pp:
            yield (f"parallel.pp={pp}",), 1
    if not job.precision.distributed_optimizer:
        yield ("optim.distributed_optimizer=true",), 1
    for mbs in range(1, micro_batch_size):
        if micro_batch_size % mbs == 0:
            yield (f"optim.micro_batch_size={mbs}",), 1
    for factor in (2, 4):
        yield (), factor


def _field(override: str) -> str:
    return override.split("=", 1)[0]


def suggest(job: JobPlan, replan: Callable[[tuple[str, ...], int], JobPlan], limit: int = 6,
            max_changes: int = 3) -> list[Suggestion]:
    """Changes that make `job` fit, fastest first (at most `limit`). `replan(overrides, world_size)` builds the
    job those `--set` overrides and that world size give, exactly as a dry run with them would (it raises
    ValueError, LayoutError included, for a config that is invalid). The fewest changes first: single ones,
    then pairs when no single change fits, up to `max_changes` together. Empty when nothing tried fits."""
    singles = list(_single_changes(job, job.workload.micro_batch_size))

    def check(changes: tuple[Change, ...]) -> Suggestion | None:
        overrides = tuple(o for c in changes for o in c[0])
        factor = 1
        for c in changes:
            factor *= c[1]
        if len({_field(o) for o in overrides}) < len(overrides) or sum(c[1] > 1 for c in changes) > 1:
            return None  # two values for one field, or two GPU factors: not one change each
        try:
            candidate = replan(overrides, job.world_size * factor)
            report = plan_job(candidate)
        except (ValueError, LayoutError):
            return None
        if not fits(candidate, report):
            return None
        return Suggestion(overrides, candidate.world_size, total_bytes(candidate, report), report.memory.capacity,
                          report.time.step_s, report.time.images_per_s_per_gpu)

    found: list[Suggestion] = []
    for size in range(1, max_changes + 1):  # the fewest changes that fit
        found = [s for group in combinations(singles, size) if (s := check(group)) is not None]
        if found:
            break
    found.sort(key=lambda s: (s.world_size, s.step_s))
    return found[:limit]
