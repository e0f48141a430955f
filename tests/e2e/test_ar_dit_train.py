"""AR-DiT joint RL end to end on CPU (tiny hybrid, TP=2 on two gloo ranks): the recipe's reward, which
needs both halves (image brightness from the DiT + a rule on the decoder's plan tokens), rises over 8 RL
steps with fixed seeds; both ranks of the tensor-parallel pair see the same rollout and metrics."""

from __future__ import annotations

import pytest

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from tests.distributed.harness import run_ranks

STEPS = 8


def _train(rank: int, world_size: int, out_dir: str) -> list[dict]:
    from examples.ar_dit.recipe import run, tiny_config

    groups = build_parallel_groups(ParallelLayout(tp=2))
    return run(tiny_config(seed=0), groups, STEPS, out_dir=out_dir)


@pytest.mark.slow
def test_joint_reward_rises_tp2(tmp_path) -> None:
    h0, h1 = run_ranks(_train, 2, str(tmp_path), timeout_s=600)
    rewards = [m["reward_mean"] for m in h0]
    assert rewards == [m["reward_mean"] for m in h1], "tensor-parallel ranks disagree on the rollout"
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    print("rewards", [round(r, 3) for r in rewards],
          "image", [round(m["reward_image"], 3) for m in h0], "tokens", [round(m["reward_tokens"], 3) for m in h0])
    assert last > first + 0.1, rewards
    for m in h0:  # the trainer's recompute agrees with what the rollout recorded (before each update)
        assert m["train_rollout_dlogp_token"] < 1e-5 and m["train_rollout_dlogp_window"] < 1e-5, m
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == STEPS
