"""Rewards for the trainer: each image goes to the scorer as soon as the rollout finishes it. A video (a sample's
frames [F, 3, H, W]) goes as one strip of `video_frames` evenly sampled frames with metadata `{"frames": K}`
(`reward.video.video_strip`), which the video scorers split back into frames.

With `reward.url` set, images stream to the reward server over HTTP (scoring overlaps generation);
otherwise the scorer runs in this process. A failed scorer or an unreachable server raises: a reward is
never replaced by a default.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import urllib.error
import urllib.request
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_omni.reward.client import RewardClient
from megatron_omni.reward.registry import build_scorer
from megatron_omni.reward.video import video_strip
from megatron_omni.rollout.base import FinishedSample

TOKEN_ENV = "REWARD_SERVER_TOKEN"


class RewardPreflightError(RuntimeError):
    """The reward server cannot be used at start: the message names the URL and what failed."""


def _why(exc: BaseException) -> str:
    """What a failed connection was, in words: refused, DNS, timeout, or the error itself."""
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, socket.gaierror):
        return f"DNS lookup failed ({reason.strerror or reason})"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(reason, ConnectionRefusedError) or getattr(reason, "errno", None) == errno.ECONNREFUSED:
        return "connection refused (is the server running on that port?)"
    return f"{type(reason).__name__}: {reason}"


def preflight(url: str | None, timeout_s: float = 5.0, token: str | None = None) -> dict[str, Any] | None:
    """GET `url`/health within `timeout_s` seconds, with the bearer token of REWARD_SERVER_TOKEN (or `token`):
    the server's health body, or RewardPreflightError naming the URL and what failed (refused, DNS, timeout,
    a bad status, a missing or wrong token). None when `url` is None (scoring in process)."""
    if url is None:
        return None
    token = token if token is not None else os.environ.get(TOKEN_ENV)
    health = url.rstrip("/") + "/health"
    request = urllib.request.Request(health, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            body = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise RewardPreflightError(f"reward.url={url!r}: the server refused the bearer token in {TOKEN_ENV} "
                                       "(wrong token)") from None
        raise RewardPreflightError(f"reward.url={url!r}: {health} answered {exc.code} {exc.reason} "
                                   "(not a ready reward server)") from None
    except (urllib.error.URLError, OSError) as exc:
        raise RewardPreflightError(f"reward.url={url!r}: {health} unreachable: {_why(exc)}") from None
    except ValueError:
        raise RewardPreflightError(f"reward.url={url!r}: {health} did not answer JSON (not a reward "
                                   "server)") from None
    if not isinstance(body, dict) or body.get("status") != "ok":
        raise RewardPreflightError(f"reward.url={url!r}: {health} answered {body!r}, not a ready reward server")
    if body.get("token_required") and not token:
        raise RewardPreflightError(f"reward.url={url!r}: the server requires a bearer token; set {TOKEN_ENV} "
                                   "to the server's token")
    return body


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

    def __init__(self, scorer: str, url: str | None = None, timeout_s: float = 120.0,
                 video_frames: int | None = None) -> None:
        self.name = scorer
        # Frames of a video sample the scorer sees (`reward.video_frames`); None: the trainer samples images.
        self.video_frames = video_frames
        # The server's bearer token (required when it binds beyond loopback) comes from the environment, as
        # the server's own --token default does, so it never lands in a saved config.
        token = os.environ.get(TOKEN_ENV)
        self.client = RewardClient(url, timeout_s=timeout_s, token=token) if url else None
        self.scorer = None if url else build_scorer(scorer)
        self._pending: list[tuple[int, np.ndarray, str, dict[str, Any]]] = []
        self._n = 0
        # The trainer's progress bar (a tqdm): while collect() waits on the server its postfix reads
        # "waiting for rewards: N outstanding". None: nothing shown.
        self.progress: Any = None

    def begin(self, n: int) -> None:
        self._pending, self._n = [], n

    def on_sample(self, sample: FinishedSample) -> None:
        image, metadata = self.scored_image(sample.image)
        if self.client is not None:
            self.client.submit(sample.index, image, sample.prompt, metadata)
        else:
            self._pending.append((sample.index, image, sample.prompt, metadata))

    def scored_image(self, sample: torch.Tensor) -> tuple[np.ndarray, dict[str, Any]]:
        """What the scorer gets for one sample: an image [3, H, W] as uint8 [H, W, 3] with no metadata, a video
        [F, 3, H, W] as the uint8 strip of `video_frames` of its frames with `{"frames": K}`. Raises ValueError for
        a video when no `video_frames` was given, or for another shape."""
        if sample.dim() == 3:
            return to_uint8_hwc(sample), {}
        if sample.dim() == 4 and self.video_frames is not None:
            strip, metadata = video_strip(sample, self.video_frames)
            return np.asarray(strip), metadata
        raise ValueError(f"a sample of shape {tuple(sample.shape)} is neither an image [3, H, W] nor a video "
                         f"[F, 3, H, W] with video_frames set (got {self.video_frames})")

    def collect(self) -> torch.Tensor:
        if self.client is not None:
            rewards = self.client.gather(on_wait=self._show_wait)
        else:
            items = sorted(self._pending, key=lambda it: it[0])
            if [it[0] for it in items] != list(range(self._n)):
                raise RuntimeError(f"rollout finished {len(items)} of {self._n} samples")
            rewards = self.scorer([it[1] for it in items], [it[2] for it in items], [it[3] for it in items])
        if len(rewards) != self._n:
            raise RuntimeError(f"reward for {len(rewards)} of {self._n} samples")
        return torch.tensor(rewards, dtype=torch.float32)

    def _show_wait(self, outstanding: int) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(f"waiting for rewards: {outstanding} outstanding" if outstanding else "")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.scorer is not None:
            self.scorer.close()
