"""A one-rank FlowGRPO trainer on the tiny offline pipeline, for tests of the trainer's parts (call it inside
a `run_ranks` process: it builds process groups)."""

from __future__ import annotations

PROMPTS = ["a red cube", "a photo of a cat on a mat"]
GROUP = 2


def tiny_trainer(pipeline_dir: str, *overrides: str):
    """2 prompts x 2 samples at 32 x 32, 4 sampling steps, window 2, lr 1e-2, one optimizer step per update
    (a step's loss is computed before its only update), clip 0.2, JPEG reward in process; `overrides` are
    `--set` style ("algorithm.beta=0.5")."""
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.config import JobConfig, apply_overrides
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    cfg = JobConfig(prompts=PROMPTS, seed=5)
    cfg.rollout.height = cfg.rollout.width = 32
    cfg.rollout.num_steps = 4
    cfg.rollout.window_size = 2
    cfg.rollout.prompts_per_step = len(PROMPTS)
    cfg.rollout.group_size = GROUP
    cfg.optim.lr = 1e-2
    cfg.optim.mini_batches = 1
    cfg.algorithm.clip_range = 0.2
    cfg = apply_overrides(cfg, list(overrides))
    cfg.validate(1)
    return FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout()), pipeline_dir,
                           RewardFunction("jpeg_compressibility"))
