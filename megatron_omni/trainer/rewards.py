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
import math
import os
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_omni.reward.client import RewardClient
from megatron_omni.reward.images import to_pil_rgb
from megatron_omni.reward.registry import build_scorer
from megatron_omni.reward.scorers import WeightedSum
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


def preflight(url: str | None, timeout_s: float = 5.0, token: str | None = None,
              scorer: str | None = None) -> dict[str, Any] | None:
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
    if scorer is not None and isinstance(scorer, str) and body.get("terms"):
        check_terms(url, scorer, body["terms"])
    return body


def check_terms(url: str, scorer: str, served: dict[str, Any]) -> None:
    """RewardPreflightError when the server combines other terms or weights than `reward.scorer` names (the run
    would learn from a reward its config does not describe)."""
    from megatron_omni.reward.registry import parse_terms

    want = {name: (w, req) for name, w, req in parse_terms(scorer)}
    got = {name: (float(t["weight"]), bool(t["required"])) for name, t in served.items()}
    if want != got:
        show = lambda d: "+".join(f"{w:g}*{n}{'' if r else '?'}" for n, (w, r) in d.items())  # noqa: E731
        raise RewardPreflightError(f"reward.url={url!r} serves the reward {show(got)} but reward.scorer={scorer!r} "
                                   f"asks for {show(want)}")


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


@dataclass
class RewardTerms:
    """The terms of a weighted reward for n samples: values [n, K] float64 (nan where an optional term failed),
    the terms' names and weights [K], and {term: message} of the optional terms that failed on some sample."""

    names: list[str]
    weights: list[float]
    values: torch.Tensor
    failed: dict[str, str] = field(default_factory=dict)

    @staticmethod
    def from_details(details: list[dict[str, Any]]) -> RewardTerms | None:
        """From the server's per-sample {"terms", "failed", "weights"} (None when it served one plain scorer)."""
        weights: dict[str, float] = {}
        for d in details:
            weights.update(d.get("weights") or {})
        if not weights:
            return None
        names = list(weights)
        values = torch.tensor([[d["terms"].get(k, math.nan) for k in names] for d in details], dtype=torch.float64)
        failed = {k: m for d in details for k, m in (d.get("failed") or {}).items()}
        return RewardTerms(names, [weights[k] for k in names], values.reshape(len(details), len(names)), failed)

    @staticmethod
    def concat(parts: list[RewardTerms | None]) -> RewardTerms | None:
        """The terms of several shares in order (None if any share has none, or their terms differ)."""
        if not parts or any(p is None or p.names != parts[0].names for p in parts):
            return None
        return RewardTerms(parts[0].names, parts[0].weights, torch.cat([p.values for p in parts]),
                           {k: m for p in parts for k, m in p.failed.items()})

    def rows(self, lo: int, hi: int) -> RewardTerms:
        """The terms of samples lo..hi-1 (a data-parallel rank's share); `failed` names only the failures seen in
        them (the values are nan there)."""
        values = self.values[lo:hi]
        return RewardTerms(self.names, self.weights, values,
                           {k: m for k, m in self.failed.items() if bool(values[:, self.names.index(k)].isnan().any())}
                           if values.numel() else {})

    def excluded(self) -> list[str]:
        """Terms left out of this batch's reward: optional terms that failed on any of its samples."""
        return [k for j, k in enumerate(self.names) if k in self.failed or bool(self.values[:, j].isnan().any())]

    def combined(self, exclude: list[str] | None = None) -> torch.Tensor:
        """[n] float32: sum_k w_k * values[:, k] over the terms not in `exclude` (default: excluded())."""
        exclude = self.excluded() if exclude is None else exclude
        keep = [j for j, k in enumerate(self.names) if k not in exclude]
        w = torch.tensor([self.weights[j] for j in keep], dtype=torch.float64)
        return (self.values[:, keep] * w).sum(dim=1).to(torch.float32)

    def metrics(self, exclude: list[str]) -> dict[str, float]:
        """reward_term/<name>_mean and _std (population, over the samples where it scored), and _failed (1 when
        the term was left out of this step's reward, else 0) per term."""
        out: dict[str, float] = {}
        for j, k in enumerate(self.names):
            v = self.values[:, j]
            v = v[~v.isnan()]
            out[f"reward_term/{k}_mean"] = float(v.mean()) if v.numel() else math.nan
            out[f"reward_term/{k}_std"] = float(v.std(correction=0)) if v.numel() else math.nan
            out[f"reward_term/{k}_failed"] = float(k in exclude)
        return out


def gather_terms(dp: dist.ProcessGroup, terms: RewardTerms | None) -> RewardTerms | None:
    """All data-parallel ranks' terms in rank order (None when any rank has none)."""
    if dp.size() == 1:
        return terms
    parts: list = [None] * dp.size()
    dist.all_gather_object(parts, terms, group=dp)
    return RewardTerms.concat(parts)


class RewardFunction:
    """`begin(n)`, then `on_sample(sample)` per finished sample, then `collect() -> rewards [n]`; after collect,
    `terms` holds the weighted reward's terms (None for a single scorer). A failed optional term is left out of
    the whole batch's reward (every sample alike) and named in `terms.failed`."""

    def __init__(self, scorer: str, url: str | None = None, timeout_s: float = 120.0,
                 video_frames: int | None = None, options: dict[str, dict] | None = None) -> None:
        self.name = scorer
        # Frames of a video sample the scorer sees (`reward.video_frames`); None: the trainer samples images.
        self.video_frames = video_frames
        # The server's bearer token (required when it binds beyond loopback) comes from the environment, as
        # the server's own --token default does, so it never lands in a saved config.
        token = os.environ.get(TOKEN_ENV)
        self.client = RewardClient(url, timeout_s=timeout_s, token=token) if url else None
        self.scorer = None if url else build_scorer(scorer, options=options)
        self.terms: RewardTerms | None = None
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
        """Rewards [n] float32 of the samples since begin(), in index order; sets `terms`."""
        self.terms = None
        if self.client is not None:
            rewards = self.client.gather(on_wait=self._show_wait)
            self.terms = RewardTerms.from_details(self.client.last_details)
        else:
            items = sorted(self._pending, key=lambda it: it[0])
            if [it[0] for it in items] != list(range(self._n)):
                raise RuntimeError(f"rollout finished {len(items)} of {self._n} samples")
            images, prompts, metas = [it[1] for it in items], [it[2] for it in items], [it[3] for it in items]
            if isinstance(self.scorer, WeightedSum):
                values, failed = self.scorer.term_scores([to_pil_rgb(im) for im in images], prompts, metas)
                self.terms = RewardTerms.from_details(
                    [{"terms": {k: v[i] for k, v in values.items()}, "failed": failed, "weights": self.scorer.weights}
                     for i in range(len(images))])
                rewards = self.terms.combined().tolist() if self.terms is not None else []
            else:
                rewards = self.scorer(images, prompts, metas)
        if len(rewards) != self._n:
            raise RuntimeError(f"reward for {len(rewards)} of {self._n} samples")
        if self.terms is not None:
            return self.terms.combined()  # a term that failed on any sample is left out for all of them
        return torch.tensor(rewards, dtype=torch.float32)

    def _show_wait(self, outstanding: int) -> None:
        if self.progress is not None:
            self.progress.set_postfix_str(f"waiting for rewards: {outstanding} outstanding" if outstanding else "")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.scorer is not None:
            self.scorer.close()
