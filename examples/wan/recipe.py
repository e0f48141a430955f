"""Wan (video) recipes: the tiny video demo on CPU, and the published shapes the launch script plans and runs
(`examples/wan/train_wan.sh`). docs/video.md, "Training Wan", has the keys, the refusals and the figures."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def wan_video_demo() -> JobConfig:
    """FlowGRPO on the tiny offline Wan pipeline (`model.pipeline=tiny`, built into the run folder) toward
    temporal consistency (`1 - mean |frame_{k+1} - frame_k|` over 5 of the 9 frames): 9-frame 32 x 32 clips, a
    patch grid of 3 x 2 x 2 tokens, 12 RL steps of 16 videos in well under a minute on 2 CPU cores."""
    cfg = JobConfig(run_dir="runs/wan-video-demo", steps=12, seed=0)
    cfg.model.family = "wan"
    cfg.prompts = ["a red cat", "waves on a beach", "a city street at night", "a spinning top"]
    r = cfg.rollout
    r.height = r.width = 32
    r.num_frames = 9  # 3 latent frames (Wan's VAE: 4k + 1 frames)
    r.num_steps = 6
    r.noise_level = 1.0
    r.window_size = 2
    r.max_sequence_length = 16  # Wan pads every prompt's text to this: short prompts, small cross-attention
    r.prompts_per_step = 4
    r.group_size = 4
    cfg.reward.scorer = "temporal_consistency"
    cfg.reward.video_frames = 5
    cfg.optim.lr = 1e-2
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.logging.image_every = 4
    cfg.logging.video_format = "gif"
    cfg.checkpoint.every = 4  # preemption-safe by default: a tiny checkpoint costs well under a second
    return cfg
