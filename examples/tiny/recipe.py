"""CPU recipes on the tiny offline Qwen-Image pipeline (`make demo` runs `jpeg_demo`)."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def jpeg_demo() -> JobConfig:
    """FlowGRPO toward JPEG compressibility (a reward a tiny random model can learn in minutes)."""
    cfg = JobConfig(run_dir="runs/tiny-jpeg", steps=12, seed=0)
    cfg.rollout.height = cfg.rollout.width = 64
    cfg.rollout.num_steps = 6
    cfg.rollout.window_size = 2
    cfg.rollout.prompts_per_step = 4
    cfg.rollout.group_size = 4
    cfg.optim.lr = 3e-3
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.reward.scorer = "jpeg_compressibility"
    return cfg


def ocr_demo() -> JobConfig:
    """The same loop scored by the local OCR reader (prompts quote the text to render)."""
    cfg = jpeg_demo()
    cfg.run_dir = "runs/tiny-ocr"
    cfg.reward.scorer = "ocr"
    cfg.prompts = ['a sign that says "CAT"', 'a poster with the word "SUN"', 'the text "OK"', 'a label "HI"']
    return cfg
