"""`rollout.transformer`: at a one-rank model replica the engine samples with the trainer's Megatron module.

Two trainers from one tiny pipeline and seed, one sampling with the engine's own diffusers copy (refreshed
through the bridge after every update), one with the trainer's module (no copy, no sync). Their steps must
agree: the same rewards and log-probs at step 0 (same initial weights, two implementations of one model),
and at step 1, after an update, which the shared engine sees without any sync while its own diffusers copy
stays at the initial weights.

World size 1 in this process (gloo).
"""

from __future__ import annotations

import pytest
import torch

from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.trainer.config import ConfigError, JobConfig
from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
from megatron_omni.trainer.rewards import RewardFunction


def _trainer(root, mode: str) -> FlowGRPOTrainer:
    cfg = JobConfig(run_dir=str(root / f"run_{mode}"), steps=2, seed=0)
    cfg.rollout.transformer = mode
    cfg.rollout.num_steps = 6
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 2, 2
    cfg.optim.mini_batches = 1
    cfg.optim.lr = 3e-3  # a visible change of the policy after one update
    cfg.validate(1)
    return FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout()), root / "pipeline",
                           RewardFunction("jpeg_compressibility", None, 60.0))


@pytest.fixture(scope="module")
def trainers(tmp_path_factory: pytest.TempPathFactory):
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    platform.init_distributed(rank=0, world_size=1)
    root = tmp_path_factory.mktemp("shared_rollout")
    make_tiny_pipeline(root / "pipeline", seed=0)
    yield _trainer(root, "engine"), _trainer(root, "auto")
    platform.destroy_distributed()


def test_auto_shares_the_trainer_module_at_one_rank(trainers) -> None:
    own, shared = trainers
    assert not own.shares_model and own.engine.velocity_model is own.engine.transformer
    assert shared.shares_model and isinstance(shared.engine.velocity_model, DiffusersForward)
    assert shared.engine.velocity_model.model is shared.model


def test_shared_rollout_follows_the_updates_without_a_sync(trainers) -> None:
    own, shared = trainers
    initial = {k: v.clone() for k, v in shared.engine.transformer.state_dict().items()}
    for step in range(2):
        a, b = own.train_step(step), shared.train_step(step)
        assert "time_sync" in a.metrics and "time_sync" not in b.metrics
        torch.testing.assert_close(b.trajectory.log_probs, a.trajectory.log_probs, rtol=0, atol=1e-5)
        torch.testing.assert_close(b.trajectory.latents, a.trajectory.latents, rtol=0, atol=1e-5)
        torch.testing.assert_close(b.rewards, a.rewards, rtol=0, atol=1e-3)
    # Step 1 sampled with updated weights (the own engine got them by sync, the shared one by sharing) ...
    moved = max(float((own.engine.transformer.state_dict()[k] - v).abs().max()) for k, v in initial.items())
    assert moved > 1e-3
    # ... and the shared trainer never wrote its engine's diffusers copy.
    for k, v in shared.engine.transformer.state_dict().items():
        assert torch.equal(v, initial[k]), k


def test_trainer_mode_needs_a_one_rank_replica(tmp_path) -> None:
    cfg = JobConfig(run_dir=str(tmp_path / "run"))
    cfg.rollout.transformer, cfg.parallel.tp = "trainer", 2
    with pytest.raises(ConfigError, match="rollout.transformer='trainer'.*one-rank model replica"):
        cfg.validate(2)
    cfg.rollout.transformer = "vllm"
    with pytest.raises(ConfigError, match="must be auto\\|engine\\|trainer"):
        cfg.validate(2)


def test_auto_falls_back_to_the_engine_copy() -> None:
    from megatron_omni.trainer.flowgrpo import _rollout_uses_trainer_model

    cfg = JobConfig()
    fp32, bf16 = torch.float32, torch.bfloat16
    assert _rollout_uses_trainer_model(cfg, fp32, fp32)
    assert not _rollout_uses_trainer_model(cfg, bf16, fp32)  # a bf16 model and an fp32 engine: engine copy
    cfg.rollout.quantization = "fp8"  # a quantized rollout samples with the engine's own (quantized) copy
    assert not _rollout_uses_trainer_model(cfg, fp32, fp32)
    cfg.rollout.quantization, cfg.parallel.tp = "none", 2
    assert not _rollout_uses_trainer_model(cfg, fp32, fp32)
    cfg.parallel.tp, cfg.rollout.transformer = 1, "engine"
    assert not _rollout_uses_trainer_model(cfg, fp32, fp32)
    cfg.rollout.transformer = "trainer"
    with pytest.raises(ValueError, match="rollout.transformer=trainer.*bfloat16"):
        _rollout_uses_trainer_model(cfg, bf16, fp32)
