"""BAGEL recipes: FlowGRPO on BAGEL's text-to-image generation with vLLM-Omni's BAGEL pipeline as the rollout
(`model.family=bagel`; docs/families-bagel.md has what the family's RL covers and the figures)."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def tiny() -> JobConfig:
    """FlowGRPO on the tiny offline BAGEL (`model.pipeline=tiny`: the preset's seeded folder in the published
    layout, written into the run folder) toward JPEG compressibility, on CPU: 32 x 32 images (a 2 x 2
    latent-token grid), BAGEL's schedule with 4 steps (shift 3.0), a 2-step SDE window at noise 1.0, BAGEL's
    text CFG at 4.0 (its default scale; the unconditional branch is the empty text cache), 8 RL steps of 8 images
    (2 prompts x 4). Prompts are token ids (the tiny BAGEL has no tokenizer)."""
    cfg = JobConfig(run_dir="runs/bagel-tiny", steps=8, seed=0)
    cfg.model.family = "bagel"
    cfg.model.preset = "tiny"
    cfg.prompts = ["17 42 99 7", "5 6", "20 21 22 23", "60 61 62"]
    r = cfg.rollout
    r.engine = "vllm_omni"
    r.vllm_omni_process = "inline"
    r.height = r.width = 32
    r.num_steps = 4
    r.noise_level = 1.0
    r.window_size = 2
    r.guidance_scale = 4.0
    r.prompts_per_step = 2
    r.group_size = 4
    cfg.reward.scorer = "jpeg_compressibility"
    cfg.optim.lr = 3e-3
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.checkpoint.every = 4
    return cfg
