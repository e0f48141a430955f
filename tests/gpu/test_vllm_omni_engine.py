"""vLLM-Omni's `Omni` engine driven by the trainer on a CUDA device (`rollout.engine=vllm_omni`, vLLM-Omni's own
CUDA platform).

Needs a GPU and vLLM + vLLM-Omni built for it; skips with the reason otherwise. What runs without a GPU moved to
CPU: the engine against the embedded diffusers engine (with and without CFG), weight updates refused by the
workers, sleep and wake, LoRA adapters over `collective_rpc`, under both executors
(tests/distributed/test_vllm_omni_engine.py, on our CPU platform plugin), and the trainer driving it, FP8 through
the RPC path and killed workers included (tests/distributed/test_trainer_vllm_omni.py, tests/e2e/
test_flowgrpo_vllm_omni.py). What stays here is vLLM-Omni's own CUDA platform under the trainer.
"""

from __future__ import annotations

import pytest

from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline
from tests.gpu.vllm_omni_gpu import require_vllm_omni_gpu

pytestmark = pytest.mark.gpu


def test_trainer_drives_the_engine_by_configuration(tmp_path) -> None:
    """The trainer's path: `rollout.engine=vllm_omni` builds the engine through the rollout registry (vLLM-Omni's
    `Omni` with our pipeline and extension, sleep mode on), one FlowGRPO step puts it to sleep for the update,
    wakes it, syncs through the bridge (full mode, bucket RPCs) and proves the sync with the probe forward; the
    second step samples the synced weights with the trainer's log-probs agreeing."""
    require_vllm_omni_gpu("tests/distributed/test_trainer_vllm_omni.py")
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
    from megatron_omni.trainer.config import JobConfig
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    folder = make_tiny_pipeline(tmp_path / "pipe", seed=0)
    platform.init_distributed(rank=0, world_size=1)
    cfg = JobConfig(run_dir=str(tmp_path / "run"), steps=2, seed=0)
    cfg.rollout.engine = "vllm_omni"
    cfg.rollout.num_steps = 6
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.optim.mini_batches = 2, 2, 1
    cfg.algorithm.clip_range = 0.2
    cfg.validate(1)
    trainer = FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout()), folder,
                              RewardFunction("jpeg_compressibility"))
    try:
        assert type(trainer.engine).__name__ == "VllmOmniRolloutEngine" and trainer.weight_sync.plan.mode == "full"
        for step in range(2):
            m = trainer.train_step(step).metrics
            print(step, {k: m[k] for k in ("reward_mean", "train_rollout_dlogp", "sync_probe_max_diff", "time_sync")})
            assert m["sync_probe_max_diff"] < 1e-4 and m["train_rollout_dlogp"] < 1e-4, m
    finally:
        trainer.close()
        platform.destroy_distributed()
