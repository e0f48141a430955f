"""The tiny AR-DiT recipe: joint RL of the tiny hybrid on CPU against a reward that needs both halves.

Reward = image brightness (mean pixel of the DiT's image, in [0, 1]) + a weight (0.1) times the share of plan
tokens drawn from the lower half of the vocabulary (a rule on what the decoder writes). `run` trains it
with the trainer's loop (`trainer.ar_dit_loop.run_ar_dit`: metrics.jsonl, checkpoints, resume).
Launch: `torchrun --nproc-per-node N -m examples.ar_dit.train --out runs/ar_dit --tp 2`.
"""

from __future__ import annotations

import os

import torch

from megatron_omni.rollout.ar_dit_engine import ARDiTSamplingParams, ARDiTTrajectory
from megatron_omni.trainer.ar_dit import ARDiTTrainConfig, ARDiTTrainer
from megatron_omni.trainer.ar_dit_loop import run_ar_dit


def brightness(traj: ARDiTTrajectory) -> torch.Tensor:
    """[N] mean pixel value of each image, in [0, 1]."""
    return traj.image.images.mean(dim=(1, 2, 3))


def low_token_share(traj: ARDiTTrajectory, vocab_size: int) -> torch.Tensor:
    """[N] share of each plan's tokens with id < vocab_size / 2 (the EOS token counts like any other)."""
    low = (traj.tokens < vocab_size // 2).float()
    idx = traj.prompt_lens[:, None] + torch.arange(traj.plan_mask.shape[1])[None]
    picked = low.gather(1, idx.clamp(max=low.shape[1] - 1)) * traj.plan_mask
    return picked.sum(1) / traj.plan_lens.float()


def tiny_config(seed: int = 0) -> ARDiTTrainConfig:
    """The tiny recipe (8 samples per step: 2 prompts x 4, plans of up to 8 tokens, 4 steps with a 2-step window)."""
    return ARDiTTrainConfig(
        hybrid="tiny", seed=seed, prompts_per_step=2, group_size=4, lr=3e-3, token_clip=0.2, window_clip=1e-2,
        sampling=ARDiTSamplingParams(max_plan_tokens=8, temperature=1.0, grid=(1, 2, 4), num_steps=4,
                                     noise_level=0.7, window_size=2),
    )


def run(cfg: ARDiTTrainConfig, groups, steps: int, out_dir: str | os.PathLike | None = None,
        token_reward_weight: float = 0.1, save_every: int = 0, resume: bool = False) -> list[dict]:
    """Train until `steps` RL steps are done; returns each step's metrics (reward parts included). The reward
    is `brightness + token_reward_weight * low_token_share`. `save_every` > 0 checkpoints into
    `out_dir/checkpoints` every that many steps and after the last; `resume` continues from the newest
    complete checkpoint there (its metric history included), if any."""
    trainer: ARDiTTrainer | None = None

    def reward(traj: ARDiTTrajectory) -> torch.Tensor:
        vocab = trainer.engine.hybrid.config.decoder["vocab_size"]
        return brightness(traj) + token_reward_weight * low_token_share(traj, vocab)

    trainer = ARDiTTrainer(cfg, groups, reward)
    vocab = trainer.engine.hybrid.config.decoder["vocab_size"]

    def parts(traj: ARDiTTrajectory) -> dict[str, float]:
        return {"reward_image": float(brightness(traj).mean()),
                "reward_tokens": float(low_token_share(traj, vocab).mean())}

    return run_ar_dit(trainer, steps, out_dir, save_every=save_every, resume=resume, step_metrics=parts)
