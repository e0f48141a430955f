"""ParallelLayout validation: clear errors naming the size that is wrong."""

from __future__ import annotations

import pytest

from megatron_omni.parallel import LayoutError, ParallelLayout


def test_resolve_fills_dp() -> None:
    layout = ParallelLayout(tp=2, ulysses=2, ring=1, pp=2).resolve(16)
    assert layout.dp == 2 and layout.cp == 2 and layout.world_size == 16


@pytest.mark.parametrize(
    "layout,world,match",
    [
        (ParallelLayout(tp=2, pp=3), 8, r"world size 8 is not divisible by tp\*ulysses\*ring\*pp"),
        (ParallelLayout(tp=2, dp=4), 4, r"dp=4 does not match the world size"),
    ],
)
def test_bad_world_size(layout: ParallelLayout, world: int, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        layout.resolve(world)


@pytest.mark.parametrize("kwargs,match", [({"tp": 0}, "tp=0"), ({"pp": -1}, "pp=-1"), ({"ring": 1.5}, "ring=1.5")])
def test_bad_sizes(kwargs: dict, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        ParallelLayout(**kwargs)


def test_model_divisibility() -> None:
    layout = ParallelLayout(tp=4, ulysses=2, pp=4).resolve(32)
    layout.validate_model(num_heads=24, num_layers=60, image_tokens=1024)
    with pytest.raises(LayoutError, match="heads 24 are not divisible by tp=5"):
        ParallelLayout(tp=5).validate_model(num_heads=24, num_layers=60)
    with pytest.raises(LayoutError, match=r"heads per tensor-parallel rank 6 are not divisible by ulysses=4"):
        ParallelLayout(tp=4, ulysses=4).validate_model(num_heads=24, num_layers=60)
    with pytest.raises(LayoutError, match="60 transformer blocks are not divisible by pp"):
        ParallelLayout(pp=7).validate_model(num_heads=24, num_layers=60)
    with pytest.raises(LayoutError, match="1000 image tokens are not divisible by cp=16"):
        ParallelLayout(ulysses=4, ring=4).validate_model(num_heads=24, num_layers=60, image_tokens=1000)


def test_coordinates_follow_megatron_order() -> None:
    layout = ParallelLayout(tp=2, ulysses=2, ring=2, pp=2).resolve(16)
    assert layout.coordinates(0) == {"tp": 0, "ulysses": 0, "ring": 0, "dp": 0, "pp": 0, "cp": 0}
    assert layout.coordinates(1)["tp"] == 1
    assert layout.coordinates(2)["ulysses"] == 1 and layout.coordinates(2)["cp"] == 1
    assert layout.coordinates(4)["ring"] == 1 and layout.coordinates(4)["cp"] == 2
    assert layout.coordinates(8)["pp"] == 1
    with pytest.raises(LayoutError, match="rank 16 is outside"):
        layout.coordinates(16)


@pytest.mark.parametrize("kwargs", [dict(pp=2), dict(tp=2, pp=2), dict(tp=2, ulysses=2, pp=2), dict(pp=4)])
def test_stage_roots_are_rank_0s_pipeline_group(kwargs: dict) -> None:
    """Each stage's sender is the stage's rank in rank 0's pipeline group (Megatron's enumeration), shifted to
    where the grid starts (a disaggregated job's trainer ranks)."""
    from megatron_omni.parallel import group_rank_lists

    layout = ParallelLayout(**kwargs).resolve(2 * ParallelLayout(**kwargs).model_parallel_size)
    first_pipeline = next(g for g in group_rank_lists(layout, ["pp"]) if 0 in g)
    assert layout.stage_roots() == first_pipeline
    assert layout.stage_roots(3) == [3 + r for r in first_pipeline]
    assert ParallelLayout(tp=2).resolve(4).stage_roots(1) == [1]
