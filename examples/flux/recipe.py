"""FLUX.1 recipes: the tiny CPU demo on the offline tiny FLUX.1 pipeline (guidance-distilled like FLUX.1-dev). A
FLUX.1-dev recipe and its launch scripts are not written yet (the planner has no FLUX cost model).
docs/families-flux.md has what the family supports and the figures."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def tiny() -> JobConfig:
    """FlowGRPO on the tiny offline FLUX.1 pipeline (`model.pipeline=tiny`, built into the run folder) toward JPEG
    compressibility: the distilled guidance scale 3.5 as the model's input (FluxPipeline's default), no true CFG,
    64 x 64 images (a 4 x 4 grid of packed 2 x 2 latent patches), 6 sampling steps, 8 RL steps of 32 images.

    Settings as the tiny SD3.5 recipe's (noise level 1.2, window 2, lr 3e-3, clip range 0.2); T5's text is padded to
    16 tokens. The measured rise per seed is in docs/families-flux.md; the e2e test runs seed 0."""
    cfg = JobConfig(run_dir="runs/flux-tiny", steps=8, seed=0)
    cfg.model.family = "flux"
    cfg.prompts = ["a red cat", "a bowl of fruit", "a city street at night", "a lighthouse on a cliff"]
    r = cfg.rollout
    r.height = r.width = 64
    r.num_steps = 6
    r.noise_level = 1.2
    r.window_size = 2
    r.distilled_guidance = 3.5
    r.max_sequence_length = 16
    r.prompts_per_step = 4
    r.group_size = 8
    cfg.reward.scorer = "jpeg_compressibility"
    cfg.optim.lr = 3e-3
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.checkpoint.every = 4  # preemption-safe by default: a tiny checkpoint costs well under a second
    return cfg
