"""Rewards for the trainer: each image goes to the scorer as soon as the rollout finishes it.

With `reward.url` set, images stream to the reward server over HTTP (scoring overlaps generation);
otherwise the scorer runs in this process. A failed scorer or an unreachable server raises: a reward is
never replaced by a default.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist

from megatron_omni.reward.client import RewardClient
from megatron_omni.reward.registry import build_scorer
from megatron_omni.rollout.base import FinishedSample


def to_uint8_hwc(image: torch.Tensor) -> np.ndarray:
    """[3, H, W] float in [0, 1] -> [H, W, 3] uint8."""
    return (image.clamp(0, 1).permute(1, 2, 0).mul(255).round().to(torch.uint8)).cpu().numpy()


def gather_rewards(dp: dist.ProcessGroup, rewards: torch.Tensor,
                   group_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """This rank's rewards [n] and group ids [n] -> all data-parallel ranks' (concatenated in rank order,
    [N]) and the offset of this rank's samples in them (group advantages need whole groups)."""
    if dp.size() == 1:
        return rewards, group_ids, 0
    parts: list = [None] * dp.size()
    dist.all_gather_object(parts, (rewards, group_ids), group=dp)
    offset = sum(len(p[0]) for p in parts[: dp.rank()])
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), offset


class RewardFunction:
    """`begin(n)`, then `on_sample(sample)` per finished sample, then `collect() -> rewards [n]`."""

    def __init__(self, scorer: str, url: str | None = None, timeout_s: float = 120.0) -> None:
        self.name = scorer
        # The server's bearer token (required when it binds beyond loopback) comes from the environment, as
        # the server's own --token default does, so it never lands in a saved config.
        token = os.environ.get("REWARD_SERVER_TOKEN")
        self.client = RewardClient(url, timeout_s=timeout_s, token=token) if url else None
        self.scorer = None if url else build_scorer(scorer)
        self._pending: list[tuple[int, np.ndarray, str]] = []
        self._n = 0

    def begin(self, n: int) -> None:
        self._pending, self._n = [], n

    def on_sample(self, sample: FinishedSample) -> None:
        image = to_uint8_hwc(sample.image)
        if self.client is not None:
            self.client.submit(sample.index, image, sample.prompt)
        else:
            self._pending.append((sample.index, image, sample.prompt))

    def collect(self) -> torch.Tensor:
        if self.client is not None:
            rewards = self.client.gather()
        else:
            items = sorted(self._pending, key=lambda it: it[0])
            if [i for i, _, _ in items] != list(range(self._n)):
                raise RuntimeError(f"rollout finished {len(items)} of {self._n} samples")
            rewards = self.scorer([im for _, im, _ in items], [p for _, _, p in items])
        if len(rewards) != self._n:
            raise RuntimeError(f"reward for {len(rewards)} of {self._n} samples")
        return torch.tensor(rewards, dtype=torch.float32)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.scorer is not None:
            self.scorer.close()
