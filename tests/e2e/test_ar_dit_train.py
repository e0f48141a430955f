"""AR-DiT joint RL end to end on CPU through the one entry point (`python -m megatron_omni.train --recipe
examples.ar_dit.recipe:tiny`, torchrun for TP=2): the recipe's reward, which needs both halves (image
brightness from the DiT + a rule on the decoder's plan tokens), rises over 8 RL steps with fixed seeds, and the
trainer's recompute agrees with what the rollout recorded (a tensor-parallel pair that saw different rollouts
would not); a SIGKILLed run resumes bit-identically, as FlowGRPO's does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import (
    _assert_same_state,
    _final_state,
    _killed_and_resumed_beside,
    _rewards,
    _train,
)

RECIPE = ["--recipe", "examples.ar_dit.recipe:tiny"]
STEPS = 8


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_joint_reward_rises_tp2(tmp_path: Path) -> None:
    run = tmp_path / "tp2"
    proc = _train(run, *RECIPE, "--set", f"steps={STEPS}", "--set", "parallel.tp=2", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    h = _metrics(run)
    rewards = [m["reward_mean"] for m in h]
    print("rewards", [round(r, 3) for r in rewards],
          "image", [round(m["reward_image"], 3) for m in h], "tokens", [round(m["reward_tokens"], 3) for m in h])
    assert [m["step"] for m in h] == list(range(STEPS))
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    assert last > first + 0.1, rewards
    for m in h:  # the trainer's recompute agrees with what the rollout recorded (before each update)
        assert m["train_rollout_dlogp_token"] < 1e-5 and m["train_rollout_dlogp"] < 1e-5, m
    # the shared keys (one builder for every trainer) and the hybrid's own, each documented
    shared = {"reward_mean", "reward_std", "zero_std_ratio", "train_rollout_dlogp", "grad_norm", "skipped_updates",
              "lr", "time_rollout", "time_train", "time_sync", "time_step", "images_per_s_per_rank"}
    assert shared <= set(h[0]), sorted(shared - set(h[0]))
    documented = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    undocumented = [k for k in h[0] if f"`{k}`" not in documented]
    assert not undocumented, f"metric keys missing from docs/metrics.md: {undocumented}"
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["family"] == "ar_dit" and config["parallel"]["tp"] == 2
    assert (run / "reward_curve.png").exists() and any((run / "samples").glob("step_*.png"))
    assert (run / "checkpoints" / f"step_{STEPS:06d}" / "COMPLETE").exists()


@pytest.mark.slow
def test_sigkill_and_resume_is_bit_identical(tmp_path: Path) -> None:
    # A decoder lr of its own: two optimizer parameter groups to match on load.
    args = [*RECIPE, "--set", "steps=4", "--set", "checkpoint.every=1", "--set", "checkpoint.keep=5",
            "--set", "ar_dit.decoder_lr_scale=0.5"]
    ref, run = tmp_path / "uninterrupted", tmp_path / "killed"
    # One rank each: the reference runs while the other is killed and resumed.
    done, resumed = _killed_and_resumed_beside(ref, run, 2, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    a, b = _final_state(ref, 4), _final_state(run, 4)
    assert a["model"] and any(k.startswith("exp_avg_sq.") for k in a["optimizer"]["state"][0])
    _assert_same_state(a, b)
    assert _rewards(ref) == _rewards(run)
    assert [m["step"] for m in _metrics(run)] == [0, 1, 2, 3]  # the redone steps replace, never repeat
