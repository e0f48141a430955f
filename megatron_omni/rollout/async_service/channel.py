"""The messages between the trainer's root and a rollout rank, and how they travel: pickled, as a length and a
byte tensor over a two-rank gloo group (`parallel.placement.PlacementGroups.requests` / `.results`), with a bounded
wait on the receiving side.

A gloo receive that times out closes its pair, so a timeout is never a poll: it is the liveness verdict
(`ChannelLost`), and the side that sees it reports the peer lost. A peer process that dies closes its sockets and
the pending receive fails at once, so a dead rank is reported as soon as it dies, a silent one within the timeout.
"""

from __future__ import annotations

import datetime
import pickle
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.rollout.base import SamplingParams, Trajectory


# ------------------------------------------------------------------------------------------ trainer -> rollout
@dataclass(frozen=True)
class Request:
    """Generate this rank's share of RL step `step` with policy version `version`: prompts[i] with seeds[i]
    (group_size 1: the trainer already expanded the groups), sampled with `params`. `attempt` counts the requests
    of the step (a regeneration after a cancel is the next attempt)."""

    step: int
    version: int
    prompts: list[str]
    seeds: list[int]
    params: SamplingParams
    attempt: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.step, self.attempt)


@dataclass(frozen=True)
class Weights:
    """Policy version `version` follows on the weights group (the bridge's buckets); `probe_means` [1, 1, 4, C] are
    the trainer model's transition means of the fixed probe batch, which the rollout checks at the swap."""

    version: int
    probe_means: torch.Tensor


@dataclass(frozen=True)
class Cancel:
    """Abandon attempt `attempt` of step `step` (running or queued): it will be regenerated from its seeds."""

    step: int
    attempt: int = 0

    @property
    def key(self) -> tuple[int, int]:
        return (self.step, self.attempt)


@dataclass(frozen=True)
class Checkpoint:
    """Join the job's checkpoint after `step` RL steps (a collective save); sent when no step is in flight."""

    step: int


@dataclass(frozen=True)
class Stop:
    """Finish: no more requests."""


# ------------------------------------------------------------------------------------------ rollout -> trainer
@dataclass(frozen=True)
class Heartbeat:
    """Alive; working on `step` (None: idle) with `done` samples finished."""

    rank: int
    step: int | None
    done: int


@dataclass(frozen=True)
class Result:
    """This rank's share of step `step`, sampled with policy version `version` (stamped on the trajectory)."""

    rank: int
    step: int
    attempt: int
    version: int
    trajectory: Trajectory
    seconds: float  # generating it, waits for weights excluded
    swap_seconds: float  # swapping the weights in and checking the probe before it


@dataclass(frozen=True)
class Interrupted:
    """Attempt `attempt` of step `step` was cancelled after `done` samples; nothing of it is kept."""

    rank: int
    step: int
    attempt: int
    done: int


@dataclass(frozen=True)
class Failed:
    """The rollout rank raised while serving `step` (None: outside a request); `error` is its traceback."""

    rank: int
    step: int | None
    error: str


@dataclass(frozen=True)
class Bye:
    """The rollout rank stopped after a `Stop`; `stats` are its counters."""

    rank: int
    stats: dict[str, Any] = field(default_factory=dict)


class ChannelLost(RuntimeError):
    """The peer sent nothing within the bound, or its connection closed (the process died)."""

    def __init__(self, peer: int, waited_s: float, reason: str) -> None:
        super().__init__(f"rank {peer}: {reason} (after {waited_s:.1f} s)")
        self.peer = peer
        self.waited_s = waited_s
        self.reason = reason


def send_object(obj: Any, dst: int, group: dist.ProcessGroup) -> None:
    """Send a picklable object to global rank `dst` over `group` (a length [1] long, then the bytes [n] uint8)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    dist.send(torch.tensor([len(data)], dtype=torch.long), dst, group=group)
    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def recv_object(src: int, group: dist.ProcessGroup, timeout_s: float) -> Any:
    """Receive one object from global rank `src` over `group`, waiting at most `timeout_s` for it to start and as
    long again for its bytes; raises `ChannelLost` on a timeout or a closed connection (the pair is unusable
    afterwards either way)."""
    t0 = time.monotonic()
    size = torch.empty(1, dtype=torch.long)
    try:
        dist.irecv(size, src, group=group).wait(datetime.timedelta(seconds=timeout_s))
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.irecv(payload, src, group=group).wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        text = str(e)
        low = text.lower()
        if "timed out" in low or "application timeout" in low:
            reason = "no message within the liveness timeout"
        elif any(k in low for k in ("closed", "reset by peer", "broken pipe", "end of file")):
            reason = f"connection closed (the process died?): {text}"
        else:
            reason = f"receive failed: {text}"
        raise ChannelLost(src, time.monotonic() - t0, reason) from e
    return pickle.loads(payload.numpy().tobytes())
