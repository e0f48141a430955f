"""Build every process group a `ParallelLayout` needs, as one explicit object passed to models and trainers.

Megatron-Core 0.16.1 takes process groups explicitly through `ProcessGroupCollection` (layers take
`tp_group`, transformer layers and schedules take `pg_collection`). We build it from Megatron-Core's
`HyperCommGrid`, so the rank enumeration is exactly Megatron's, and add the two groups USP needs that
Megatron does not know: the Ulysses (all-to-all) and ring (point-to-point) halves of context parallelism.
Nothing here reads or writes `megatron.core.parallel_state` globals.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_omni.parallel.layout import GRID_DIMS, ParallelLayout


@dataclass
class ParallelGroups:
    """The process groups of one rank, plus where the rank sits in the layout.

    `mcore` is the `ProcessGroupCollection` handed to Megatron-Core modules and schedules.
    `ulysses` and `ring` split `mcore.cp`; `rank_lists` records the member ranks of each group this
    rank is in (useful for tests and for the bridge planner).
    """

    layout: ParallelLayout
    rank: int
    mcore: ProcessGroupCollection
    ulysses: dist.ProcessGroup
    ring: dist.ProcessGroup
    replica: dist.ProcessGroup  # the tp x cp x pp ranks that hold one model replica
    grid: HyperCommGrid
    coords: dict[str, int] = field(default_factory=dict)
    rank_lists: dict[str, list[int]] = field(default_factory=dict)
    first_rank: int = 0  # the global rank of the grid's rank 0 (a disaggregated job's trainer root)

    @property
    def tp(self) -> dist.ProcessGroup:
        return self.mcore.tp

    @property
    def cp(self) -> dist.ProcessGroup:
        return self.mcore.cp

    @property
    def pp(self) -> dist.ProcessGroup:
        return self.mcore.pp

    @property
    def dp(self) -> dist.ProcessGroup:
        return self.mcore.dp

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1

    @property
    def last_stage_rank(self) -> int:
        """The global rank of this rank's pipeline's last stage (this rank without pipeline parallelism)."""
        return dist.get_global_rank(self.pp, self.layout.pp - 1) if self.layout.pp > 1 else dist.get_rank()


# Groups to create: our name -> grid dimensions it spans.
_GROUP_DIMS: dict[str, list[str]] = {
    "tp": ["tp"],
    "ulysses": ["ulysses"],
    "ring": ["ring"],
    "cp": ["ulysses", "ring"],
    "tp_cp": ["tp", "ulysses", "ring"],
    "dp": ["dp"],
    "dp_cp": ["ulysses", "ring", "dp"],
    "tp_dp_cp": ["tp", "ulysses", "ring", "dp"],
    "pp": ["pp"],
    # Megatron's model-parallel group is tp x pp: CP ranks hold replicas of every parameter (their grads are
    # reduced over dp x cp), so counting them in the grad norm would inflate it by sqrt(cp).
    "mp": ["tp", "pp"],
    "replica": ["tp", "ulysses", "ring", "pp"],  # all ranks of one model replica
}


def group_rank_lists(layout: ParallelLayout, dims: list[str]) -> list[list[int]]:
    """All groups spanning `dims` as rank lists, in Megatron's enumeration; no process group needed."""
    layout = layout if layout.dp is not None else layout.resolve(layout.model_parallel_size)
    outer = [d for d in reversed(GRID_DIMS) if d not in dims]
    inner = [d for d in reversed(GRID_DIMS) if d in dims]
    groups: dict[tuple[int, ...], list[tuple[tuple[int, ...], int]]] = {}
    for rank in range(layout.world_size):
        coords = layout.coordinates(rank)
        key = tuple(coords[d] for d in outer)
        groups.setdefault(key, []).append((tuple(coords[d] for d in inner), rank))
    return [[r for _, r in sorted(members)] for _, members in sorted(groups.items())]


def build_parallel_groups(layout: ParallelLayout, ranks: range | None = None) -> ParallelGroups | None:
    """Create all process groups for `layout` on the already-initialised default group.

    Every rank of the job must call this (group creation is collective). `ranks`: the contiguous global ranks
    the layout spans (default: the whole job); a disaggregated placement gives the trainer's
    (`placement.Placement.trainer_range`), and the ranks outside it (rollout ranks) join the collective creation
    and get None. The layout's dp is resolved from the number of ranks; a layout that does not divide it raises
    `LayoutError` before any group exists.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call init_distributed() first")
    world_size = dist.get_world_size()
    ranks = range(world_size) if ranks is None else ranks
    if ranks.step != 1 or not ranks or ranks.start < 0 or ranks.stop > world_size:
        raise ValueError(f"the grid's ranks {ranks} must be a non-empty contiguous range inside the job's "
                         f"{world_size} ranks")
    layout = layout.resolve(len(ranks))
    rank = dist.get_rank()
    grid = HyperCommGrid(layout.grid_shape(), list(GRID_DIMS), rank_offset=ranks.start)
    pgs = {name: grid.create_pg(dims) for name, dims in _GROUP_DIMS.items()}
    # No experts: DDP still wants an expert data-parallel group. Created collectively here (one group per
    # rank), because Megatron's own fallback calls new_group with a different rank list on every rank.
    singleton, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world_size)])
    if rank not in ranks:
        return None

    mcore = ProcessGroupCollection(
        tp=pgs["tp"],
        cp=pgs["cp"],
        tp_cp=pgs["tp_cp"],
        pp=pgs["pp"],
        mp=pgs["mp"],
        dp=pgs["dp"],
        dp_cp=pgs["dp_cp"],
        tp_dp_cp=pgs["tp_dp_cp"],
        intra_dp_cp=pgs["dp_cp"],
        # The DiT has no tied or position embeddings shared across pipeline stages, and no experts; the
        # optimizer and DDP still ask for these groups by name.
        embd=None,
        pos_embd=None,
        ep=None,
        expt_tp=None,
        tp_ep=None,
        tp_ep_pp=None,
        expt_dp=singleton,
        intra_expt_dp=singleton,
        inter_dist_opt=None,
        intra_dist_opt=None,
    )
    rank_lists = {}
    for name, dims in _GROUP_DIMS.items():
        rank_lists[name] = next(g for g in grid.get_rank_enum(dims) if rank in g)
    return ParallelGroups(
        layout=layout,
        rank=rank,
        mcore=mcore,
        ulysses=pgs["ulysses"],
        ring=pgs["ring"],
        replica=pgs["replica"],
        grid=grid,
        coords=layout.coordinates(rank - ranks.start),
        rank_lists=rank_lists,
        first_rank=ranks.start,
    )
