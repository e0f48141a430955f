"""`plan_micro_batches`: every (sample, window step) transition of a mini-batch exactly once, in chunks of
`optim.micro_batch_size` transitions; a size that does not divide the mini-batch is refused by name."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.trainer.pipeline_step import plan_micro_batches

ROWS = torch.tensor([5, 1, 3])  # a mini-batch of 3 samples (a random split of the step's samples)


def _pairs(mbs) -> list[tuple[int, int]]:
    return [(int(r), int(j)) for mb in mbs for r, j in zip(mb.rows, mb.js, strict=True)]


@pytest.mark.parametrize("size", [None, 1, 2, 3, 6])
def test_each_transition_once_in_equal_chunks(size: int | None) -> None:
    plan = plan_micro_batches(ROWS, window=2, micro_batch_size=size)
    assert sorted(_pairs(plan)) == sorted((r, j) for r in ROWS.tolist() for j in range(2))
    assert len({len(mb.rows) for mb in plan}) == 1
    assert len(plan[0].rows) == (size or len(ROWS))


def test_default_is_one_window_step_of_every_sample_per_forward() -> None:
    plan = plan_micro_batches(ROWS, window=2, micro_batch_size=None)
    assert [(mb.rows.tolist(), mb.js.tolist()) for mb in plan] == [([5, 1, 3], [0, 0, 0]), ([5, 1, 3], [1, 1, 1])]


def test_a_chunk_may_span_window_steps() -> None:
    plan = plan_micro_batches(ROWS, window=2, micro_batch_size=2)
    assert [(mb.rows.tolist(), mb.js.tolist()) for mb in plan] == [([5, 1], [0, 0]), ([3, 5], [0, 1]),
                                                                      ([1, 3], [1, 1])]


@pytest.mark.parametrize("size", [4, 0])
def test_a_size_that_does_not_divide_is_refused(size: int) -> None:
    with pytest.raises(ValueError, match=rf"optim.micro_batch_size={size} does not divide the mini-batch's 6 "
                                         r"transitions on this rank \(3 samples x 2 window steps\)"):
        plan_micro_batches(ROWS, window=2, micro_batch_size=size)
