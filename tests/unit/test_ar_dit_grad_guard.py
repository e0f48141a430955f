"""The AR-DiT trainer's NaN/inf guard (shared with the FlowGRPO trainer, `trainer.grad_guard`): an update
whose gradients are not finite is skipped (weights and optimizer untouched, counted in the metrics), a
finite one resets the count, and `max_bad_steps` skipped updates in a row stop the run naming the setting.
World size 1 in this process (gloo)."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.rollout.diffusers_engines.ar_dit import ARDiTSamplingParams
from megatron_omni.trainer.ar_dit import ARDiTTrainConfig, ARDiTTrainer
from megatron_omni.trainer.grad_guard import GradGuard


@pytest.fixture(scope="module")
def trainer():
    platform.init_distributed(rank=0, world_size=1)
    cfg = ARDiTTrainConfig(prompts=[[5, 6, 7], [9, 10, 11]], group_size=2, max_bad_steps=2,
                           sampling=ARDiTSamplingParams(max_plan_tokens=4, temperature=1.0, num_steps=4,
                                                                noise_level=0.7))
    yield ARDiTTrainer(cfg, build_parallel_groups(ParallelLayout()), lambda t: t.plan_lens.float())
    platform.destroy_distributed()


def test_non_finite_gradients_skip_the_update_and_stop_the_run(trainer: ARDiTTrainer) -> None:
    traj = trainer.engine.generate(trainer.cfg.prompts, trainer.cfg.sampling, group_size=2)
    old_tok, old_win = trainer.recompute(traj)
    good = torch.tensor([1.0, -1.0, 0.5, -0.5])
    bad = good.clone()
    bad[1] = float("nan")
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    metrics, _ = trainer._update(traj, old_tok, old_win, bad, step=0)
    assert metrics["skipped_updates"] == 1.0 and math.isnan(metrics["grad_norm"])
    after = trainer.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a skipped update changed weights"
    assert trainer.guard.bad_steps == 1
    metrics, _ = trainer._update(traj, old_tok, old_win, good, step=1)  # a finite update resets the count
    assert metrics["skipped_updates"] == 0.0 and math.isfinite(metrics["grad_norm"]) and trainer.guard.bad_steps == 0
    assert any(not torch.equal(trainer.model.state_dict()[k], v) for k, v in before.items())
    trainer._update(traj, old_tok, old_win, bad, step=2)
    with pytest.raises(FloatingPointError, match=r"2 updates in a row had NaN/inf gradients \(max_bad_steps\)"):
        trainer._update(traj, old_tok, old_win, bad, step=3)


def test_guard_rejects_a_zero_limit() -> None:
    with pytest.raises(ValueError, match="optim.max_bad_steps must be >= 1"):
        GradGuard(0, "optim.max_bad_steps")
