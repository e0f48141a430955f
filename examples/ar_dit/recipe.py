"""The tiny AR-DiT recipe: joint RL of the tiny hybrid on CPU against a reward that needs both halves.

Reward = image brightness (mean pixel of the DiT's image, in [0, 1]) + a weight (0.1) times the share of plan
tokens drawn from the lower half of the vocabulary (a rule on what the decoder writes). It trains through the
one entry point, like every recipe:
`python -m megatron_omni.train --recipe examples.ar_dit.recipe:tiny [--set parallel.tp=2 under torchrun]`.
"""

from __future__ import annotations

import torch

from megatron_omni.rollout.diffusers_engines.ar_dit import ARDiTTrajectory
from megatron_omni.trainer.ar_dit import ARDiTTrainConfig
from megatron_omni.trainer.config import (
    AlgorithmConfig,
    ARDiTConfig,
    CheckpointConfig,
    JobConfig,
    ModelConfig,
    OptimConfig,
    RolloutConfig,
)


def brightness(traj: ARDiTTrajectory) -> torch.Tensor:
    """[N] mean pixel value of each image, in [0, 1]."""
    return traj.image.images.mean(dim=(1, 2, 3))


def low_token_share(traj: ARDiTTrajectory, vocab_size: int) -> torch.Tensor:
    """[N] share of each plan's tokens with id < vocab_size / 2 (the EOS token counts like any other)."""
    low = (traj.tokens < vocab_size // 2).float()
    idx = traj.prompt_lens[:, None] + torch.arange(traj.plan_mask.shape[1])[None]
    picked = low.gather(1, idx.clamp(max=low.shape[1] - 1)) * traj.plan_mask
    return picked.sum(1) / traj.plan_lens.float()


class BrightnessAndLowTokens:
    """The recipe's reward (`ar_dit.reward`): brightness + token_weight * low_token_share, [N] per trajectory;
    `parts` gives the two terms' means as metrics (reward_image, reward_tokens)."""

    def __init__(self, vocab_size: int, token_weight: float = 0.1) -> None:
        self.vocab_size, self.token_weight = vocab_size, token_weight

    def __call__(self, traj: ARDiTTrajectory) -> torch.Tensor:
        return brightness(traj) + self.token_weight * low_token_share(traj, self.vocab_size)

    def parts(self, traj: ARDiTTrajectory) -> dict[str, float]:
        return {"reward_image": float(brightness(traj).mean()),
                "reward_tokens": float(low_token_share(traj, self.vocab_size).mean())}


def tiny() -> JobConfig:
    """8 samples per step (2 prompts x 4), plans of up to 8 tokens, 4 sampling steps with a 2-step window at
    noise 0.7; 8 RL steps, a checkpoint every 4."""
    return JobConfig(
        run_dir="runs/ar_dit", steps=8, seed=0,
        prompts=["5 6 7", "9 10", "20 21 22 23"],
        model=ModelConfig(family="ar_dit", preset="tiny"),
        rollout=RolloutConfig(prompts_per_step=2, group_size=4, num_steps=4, noise_level=0.7, window_size=2),
        algorithm=AlgorithmConfig(clip_range=1e-2),
        optim=OptimConfig(lr=3e-3, weight_decay=0.0, mini_batches=1),
        checkpoint=CheckpointConfig(every=4),
        ar_dit=ARDiTConfig(max_plan_tokens=8, temperature=1.0, grid=[1, 2, 4], token_clip=0.2,
                           reward="examples.ar_dit.recipe:BrightnessAndLowTokens"),
    )


def tiny_config(seed: int = 0) -> ARDiTTrainConfig:
    """The tiny recipe's trainer settings (for tests and benchmarks that build an `ARDiTTrainer` directly)."""
    cfg = tiny()
    cfg.seed = seed
    return ARDiTTrainConfig.from_job(cfg)
