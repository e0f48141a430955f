"""Process groups built for a layout have Megatron's membership on 4 and 8 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_omni.parallel import ParallelLayout, build_parallel_groups, group_rank_lists
from megatron_omni.parallel.rank_pool import run_ranks

LAYOUTS_4 = [
    ParallelLayout(tp=2, pp=2),
    ParallelLayout(tp=2, ulysses=2),
    ParallelLayout(ulysses=2, ring=2),
    ParallelLayout(pp=2),  # dp = 2
]
LAYOUTS_8 = [
    ParallelLayout(tp=2, ulysses=2, pp=2),
    ParallelLayout(tp=2, ring=2),  # dp = 2
]
NAMES = ("tp", "ulysses", "ring", "cp", "tp_cp", "dp", "dp_cp", "pp", "mp", "replica")


def _membership(rank: int, world_size: int, layouts: list[ParallelLayout]) -> list[dict]:
    out = []
    for layout in layouts:
        groups = build_parallel_groups(layout)
        members = {}
        for name in NAMES:
            extra = {"ulysses": groups.ulysses, "ring": groups.ring, "replica": groups.replica}
            pg = extra.get(name) or getattr(groups.mcore, name)
            # Ask the group itself who is in it: all-gather the global ranks over it.
            gathered = [torch.zeros(1, dtype=torch.long) for _ in range(pg.size())]
            dist.all_gather(gathered, torch.tensor([rank]), group=pg)
            members[name] = [int(t) for t in gathered]
            assert members[name] == groups.rank_lists[name], (name, members[name], groups.rank_lists[name])
        out.append({"members": members, "coords": groups.coords})
    return out


def _expected(layout: ParallelLayout, world_size: int, rank: int, name: str) -> list[int]:
    dims = {"tp": ["tp"], "ulysses": ["ulysses"], "ring": ["ring"], "cp": ["ulysses", "ring"],
            "tp_cp": ["tp", "ulysses", "ring"], "dp": ["dp"], "dp_cp": ["ulysses", "ring", "dp"],
            "pp": ["pp"], "mp": ["tp", "pp"], "replica": ["tp", "ulysses", "ring", "pp"]}[name]
    resolved = layout.resolve(world_size)
    return next(g for g in group_rank_lists(resolved, dims) if rank in g)


@pytest.mark.parametrize("world_size,layouts", [(4, LAYOUTS_4), (8, LAYOUTS_8)])
def test_group_membership(world_size: int, layouts: list[ParallelLayout]) -> None:
    results = run_ranks(_membership, world_size, layouts, timeout_s=180)
    for rank, per_layout in enumerate(results):
        for layout, got in zip(layouts, per_layout):
            for name in NAMES:
                assert got["members"][name] == _expected(layout, world_size, rank, name), (layout, rank, name)


def test_megatron_order_by_hand() -> None:
    """tp fastest, then ulysses, ring, dp, pp (Megatron's tp-cp-dp-pp), checked on explicit lists."""
    layout = ParallelLayout(tp=2, ulysses=2, pp=2).resolve(8)
    assert group_rank_lists(layout, ["tp"]) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert group_rank_lists(layout, ["ulysses", "ring"]) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert group_rank_lists(layout, ["pp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_rank_lists(layout, ["tp", "ulysses", "ring", "pp"]) == [list(range(8))]
    layout = ParallelLayout(tp=2, ring=2).resolve(8)
    assert group_rank_lists(layout, ["dp"]) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_rank_lists(layout, ["ulysses", "ring", "dp"]) == [[0, 2, 4, 6], [1, 3, 5, 7]]
