"""SD3.5 recipes: the tiny CPU demo on the offline tiny SD3.5 pipeline, and flow_grpo's published SD3.5-Medium
recipes (OCR, PickScore) at the sizes the launch script plans and runs (`examples/sd3/train_sd35.sh`).
docs/families-sd3.md has what the family supports and the figures."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def tiny() -> JobConfig:
    """FlowGRPO on the tiny offline SD3.5 pipeline (`model.pipeline=tiny`, built into the run folder) toward JPEG
    compressibility, with SD3.5's true CFG (4.5, an empty negative prompt, as flow_grpo samples): 64 x 64 images
    (a 4 x 4 patch grid), 6 sampling steps, 8 RL steps of 32 images in well under a minute on 2 CPU cores.

    The tiny model's noise level is Qwen-Image's 1.2 (at flow_grpo's SD3.5 0.7 the tiny random model explored too
    little to learn in 8 steps). Measured rise (mean reward of the last two steps minus the first two), seeds
    0 / 1 / 2: +0.049 / -0.154 / +0.056: a random tiny model learns at two of three seeds (seed 1's weights drift
    toward larger JPEGs whatever the reward's sign); the e2e test runs seed 0."""
    cfg = JobConfig(run_dir="runs/sd3-tiny", steps=8, seed=0)
    cfg.model.family = "sd3"
    cfg.prompts = ["a red cat", "a bowl of fruit", "a city street at night", "a lighthouse on a cliff"]
    r = cfg.rollout
    r.height = r.width = 64
    r.num_steps = 6
    r.noise_level = 1.2
    r.window_size = 2
    r.guidance_scale = 4.5
    r.negative_prompt = ""
    r.max_sequence_length = 16  # T5's padded length (the text is CLIP's 77 tokens plus these)
    r.prompts_per_step = 4
    r.group_size = 8
    cfg.reward.scorer = "jpeg_compressibility"
    cfg.optim.lr = 3e-3
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.checkpoint.every = 4  # preemption-safe by default: a tiny checkpoint costs well under a second
    return cfg

