"""Where the trainer and the rollout run: the same ranks (`colocated`, one step after the other) or separate ones
(`disaggregated`, the rollout ranks generating step k+1 while the trainer ranks train on step k).

`split_world` is pure (a dry run and the planner can call it without a job): it turns `placement.mode` and
`placement.rollout_ranks` (a count, taken from the end of the job, or an explicit list) into the two rank sets,
and refuses a split that cannot run with a `PlacementError` naming the key and the value. `build_placement_groups`
then creates, collectively, every process group the two sides talk over; they are handed to the trainer, the
rollout service and the bridge as one object, never read from globals:

- `trainer`: the trainer ranks (the Megatron grid is built over `Placement.trainer_range` by
  `build_parallel_groups(layout, ranks=...)`);
- `rollout`: the rollout ranks;
- `requests[r]` / `results[r]`: two gloo pairs {trainer root, rollout owner r} for the control messages (small
  pickled objects on CPU tensors, so gloo even on GPU), one per direction so that each is used by one thread on
  each side (a gloo pair is not shared between threads);
- `weights`: the bridge's broadcast groups, one per weight source (the trainer root; with pipeline parallelism each
  stage's first rank, `ParallelLayout.stage_roots`): {source} + rollout owners on the job's collective backend
  (NCCL on GPU: the weights are device tensors), given to `bridge.DistributedTransport(groups=...)` with
  `weight_sources` (stage order);
- `engine_group`: on a rollout rank, its rollout group (below), for the owner's control messages to the others.

Rollout groups (`rollout_tp` > 1, vLLM-Omni's multi-process `Omni` engine): torchrun starts one rank per GPU, but an
engine at tensor parallelism t needs t GPUs for its t worker processes. So the rollout ranks form groups of t
consecutive ranks (`Placement.rollout_groups`); the first rank of each, its owner (`rollout_owners`), runs the
rollout service and owns one engine whose workers run on the group's t GPUs; the others hold their GPU for those
workers and start nothing: they join the job's collectives (the optimizer build's, the resume's, every checkpoint's
save, the end), told by their owner over `engine_group`. The trainer talks to, and pushes weights to, the owners
only. At `rollout_tp` 1 every rollout rank is an owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_omni.parallel import platform

PLACEMENT_MODES = ("colocated", "disaggregated")
CONTROL_BACKEND = "gloo"  # control messages are CPU tensors on every platform


class PlacementError(ValueError):
    """A placement that cannot run: the message names the key (`placement.mode`, `placement.rollout_ranks`) and
    the value."""


@dataclass(frozen=True)
class Placement:
    """The split of a job of `world_size` ranks: `trainer_ranks` and `rollout_ranks` (sorted global ranks; equal
    when colocated). The trainer's root (its first rank) is the one that talks to the rollout ranks."""

    mode: str
    world_size: int
    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    rollout_tp: int = 1  # ranks (GPUs) per rollout group: one engine, its workers on the group's GPUs

    @property
    def disaggregated(self) -> bool:
        return self.mode == "disaggregated"

    @property
    def trainer_root(self) -> int:
        return self.trainer_ranks[0]

    @property
    def trainer_range(self) -> range:
        """The trainer ranks as the contiguous range the Megatron grid spans."""
        return range(self.trainer_ranks[0], self.trainer_ranks[-1] + 1)

    @property
    def rollout_groups(self) -> tuple[tuple[int, ...], ...]:
        """The rollout ranks in groups of `rollout_tp` consecutive ranks (one engine each; colocated: none)."""
        if not self.disaggregated:
            return ()
        t = self.rollout_tp
        return tuple(self.rollout_ranks[i: i + t] for i in range(0, len(self.rollout_ranks), t))

    @property
    def rollout_owners(self) -> tuple[int, ...]:
        """The first rank of each rollout group: the ranks that run the rollout service and own an engine."""
        return tuple(g[0] for g in self.rollout_groups)

    def rollout_group_of(self, rank: int) -> tuple[int, ...]:
        """The rollout group `rank` belongs to (its owner first); () for a trainer rank."""
        return next((g for g in self.rollout_groups if rank in g), ())

    def role(self, rank: int) -> str:
        """'trainer', 'rollout' or, colocated, 'both'."""
        if not self.disaggregated:
            return "both"
        return "rollout" if rank in self.rollout_ranks else "trainer"


def split_world(mode: str, world_size: int, rollout_ranks: int | Sequence[int] | None = None,
                rollout_tp: int = 1) -> Placement:
    """The placement of a job of `world_size` ranks.

    colocated: `rollout_ranks` must be None, 0 or empty; every rank trains and rolls out.
    disaggregated: `rollout_ranks` is a count n (the last n ranks roll out: the trainer keeps rank 0, where the run
    folder, the logs and the checkpoints' metadata are written) or a list of global ranks; at least one rank on
    each side, and the trainer ranks contiguous (Megatron's grid enumerates a contiguous block).
    `rollout_tp` (disaggregated): the rollout ranks per engine (`rollout.tp`); their number must be a multiple of
    it, each group of `rollout_tp` consecutive rollout ranks owning one engine (see the module docstring).
    Raises `PlacementError` naming the key and the value.
    """
    if mode not in PLACEMENT_MODES:
        raise PlacementError(f"placement.mode={mode!r}: expected one of {PLACEMENT_MODES}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlacementError(f"world size {world_size!r} must be a positive integer")
    everyone = tuple(range(world_size))
    if mode == "colocated":
        if rollout_ranks not in (None, 0) and not (isinstance(rollout_ranks, Sequence) and len(rollout_ranks) == 0):
            raise PlacementError(f"placement.rollout_ranks={rollout_ranks!r} with placement.mode='colocated': "
                                 "colocated rollout runs on every trainer rank; set placement.mode=disaggregated")
        return Placement(mode, world_size, everyone, everyone)
    if rollout_ranks is None:
        raise PlacementError("placement.rollout_ranks is required with placement.mode='disaggregated' (a count or "
                             "a list of ranks)")
    if isinstance(rollout_ranks, bool):
        raise PlacementError(f"placement.rollout_ranks={rollout_ranks!r}: expected a count or a list of ranks")
    if isinstance(rollout_ranks, int):
        if not 1 <= rollout_ranks <= world_size - 1:
            raise PlacementError(f"placement.rollout_ranks={rollout_ranks}: a count must be in [1, {world_size - 1}] "
                                 f"for {world_size} ranks (at least one rank on each side)")
        rollout = everyone[world_size - rollout_ranks:]
    else:
        values = list(rollout_ranks)
        bad = [r for r in values if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size]
        if bad:
            raise PlacementError(f"placement.rollout_ranks={values!r}: {bad} are not ranks of a job of {world_size}")
        if len(set(values)) != len(values):
            raise PlacementError(f"placement.rollout_ranks={values!r}: a rank is listed twice")
        if not values or len(values) >= world_size:
            raise PlacementError(f"placement.rollout_ranks={values!r}: at least one rank on each side of "
                                 f"{world_size} ranks")
        rollout = tuple(sorted(values))
    trainer = tuple(r for r in everyone if r not in rollout)
    if trainer[-1] - trainer[0] + 1 != len(trainer):
        raise PlacementError(f"placement.rollout_ranks={list(rollout)!r} leaves the trainer ranks {list(trainer)}, "
                             "which are not contiguous (Megatron's grid spans a contiguous block of ranks)")
    if isinstance(rollout_tp, bool) or not isinstance(rollout_tp, int) or rollout_tp < 1:
        raise PlacementError(f"rollout.tp={rollout_tp!r}: expected a positive integer")
    if len(rollout) % rollout_tp:
        raise PlacementError(f"placement.rollout_ranks={len(rollout)} rollout ranks with rollout.tp={rollout_tp}: each "
                             f"engine takes {rollout_tp} rollout ranks (its workers on their GPUs), so the rollout "
                             f"ranks must be a multiple of {rollout_tp}")
    return Placement(mode, world_size, trainer, rollout, rollout_tp)


@dataclass
class PlacementGroups:
    """The process groups of one rank for a placement (see the module docstring); a group this rank is not in is
    None. Colocated: `trainer` and `rollout` are the whole job and there are no pairs or weights group."""

    placement: Placement
    rank: int
    trainer: dist.ProcessGroup | None
    rollout: dist.ProcessGroup | None
    requests: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)
    results: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)
    weights: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)
    weight_sources: tuple[int, ...] = ()  # the trainer ranks that send the weights, stage by stage
    engine_group: dist.ProcessGroup | None = None  # this rollout rank's rollout group (gloo), its owner first


def build_placement_groups(placement: Placement, weight_sources: Sequence[int] | None = None) -> PlacementGroups:
    """Create the groups of `placement` on the initialised default group; every rank calls it, in the same order
    (group creation is collective over the job). `weight_sources`: the trainer ranks that send each pipeline
    stage's weights (default: the trainer root alone)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_distributed() first")
    if dist.get_world_size() != placement.world_size:
        raise PlacementError(f"the placement is for {placement.world_size} ranks, the job has {dist.get_world_size()}")
    rank = dist.get_rank()

    def member(ranks: Sequence[int], backend: str | None = None) -> dist.ProcessGroup | None:
        group = dist.new_group(sorted(ranks), backend=backend)  # collective: every rank, every group
        return group if rank in ranks else None

    if not placement.disaggregated:
        world = member(range(placement.world_size))
        return PlacementGroups(placement, rank, world, world)
    trainer = member(placement.trainer_ranks)
    rollout = member(placement.rollout_ranks)
    root = placement.trainer_root
    owners = placement.rollout_owners
    requests = {r: member((root, r), CONTROL_BACKEND) for r in owners}
    results = {r: member((root, r), CONTROL_BACKEND) for r in owners}
    sources = tuple(weight_sources) if weight_sources else (root,)
    outside = [r for r in sources if r not in placement.trainer_ranks]
    if outside:
        raise PlacementError(f"weight sources {outside} are not trainer ranks of {placement}")
    weights = {src: member((src, *owners), platform.backend()) for src in dict.fromkeys(sources)}
    engine_group = None
    if placement.rollout_tp > 1:
        for g in placement.rollout_groups:
            engine_group = member(g, CONTROL_BACKEND) or engine_group
    return PlacementGroups(placement, rank, trainer, rollout, requests, results, weights, sources, engine_group)
