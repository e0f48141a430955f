"""The rollout registry: engines by `rollout.engine` name, built lazily, and the probe's refusal."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.rollout.probe import ProbeMismatch, check_probe, probe_tolerance, probe_trajectory
from megatron_omni.rollout.registry import ENGINES, EngineSettings, build_engine
from megatron_omni.trainer.config import ROLLOUT_ENGINES


def test_every_configurable_engine_is_registered() -> None:
    assert set(ENGINES) == set(ROLLOUT_ENGINES)


def test_unknown_engine_and_bad_settings_raise(tmp_path) -> None:
    with pytest.raises(KeyError, match="unknown rollout engine 'sglang'.*diffusers"):
        build_engine("sglang", tmp_path, EngineSettings())
    with pytest.raises(ValueError, match="diffusers engine runs at rollout tp 1"):
        build_engine("diffusers", tmp_path, EngineSettings(tp=2))


def test_probe_batch_is_fixed_and_mismatch_names_the_difference() -> None:
    cfg = {"in_channels": 16, "joint_attention_dim": 24}
    a, b = probe_trajectory(cfg), probe_trajectory(cfg)
    assert torch.equal(a.latents, b.latents) and a.latents.shape == (1, 1, 4, 16)
    assert probe_tolerance(torch.float32, torch.bfloat16) == probe_tolerance(torch.bfloat16)
    means = torch.randn(1, 1, 4, 16)
    assert check_probe(means, means.clone(), 1e-4, "x") == 0.0
    with pytest.raises(ProbeMismatch, match=r"after sync 3.*max \|difference\| 0\.5 > tolerance 0\.0001"):
        check_probe(means + 0.5, means, 1e-4, "after sync 3")
    with pytest.raises(ProbeMismatch, match="nan"):
        check_probe(means * float("nan"), means, 1e-4, "x")
