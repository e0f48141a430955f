"""The shared trainer pieces: prompt seeding and the mini-batch split are the same figures for every family."""

import torch

from megatron_omni.trainer.skeleton import mini_batch_rows, step_prompts


def test_step_prompts_deals_groups_round_robin_with_distinct_seeds():
    prompts = ["a", "b", "c"]
    got0 = step_prompts(prompts, seed=2, step=1, prompts_per_step=4, group_size=2, dp_rank=0, dp_size=2)
    got1 = step_prompts(prompts, seed=2, step=1, prompts_per_step=4, group_size=2, dp_rank=1, dp_size=2)
    assert got0[1] == [4, 6] and got1[1] == [5, 7]
    assert got0[0] == ["b", "a"] and got1[0] == ["c", "b"]
    assert got0[2] == [2 * 1_000_003 + 8, 2 * 1_000_003 + 9, 2 * 1_000_003 + 12, 2 * 1_000_003 + 13]
    assert not set(got0[2]) & set(got1[2])


def test_mini_batch_rows_is_a_fixed_split_of_every_row():
    a = mini_batch_rows(10, seed=3, step=5, mini_batches=3)
    b = mini_batch_rows(10, seed=3, step=5, mini_batches=3)
    assert len(a) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    assert sorted(torch.cat(a).tolist()) == list(range(10))
    other = torch.cat(mini_batch_rows(10, seed=3, step=6, mini_batches=3))
    assert not torch.equal(torch.cat(a), other)
