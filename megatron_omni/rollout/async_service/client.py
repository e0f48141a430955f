"""The trainer root's side of asynchronous RL: requests to the rollout ranks, their results, their liveness.

`request(step, ...)` splits a step's samples into contiguous shares, one per rollout rank, and returns at once, so
the trainer asks for step k+1 before it trains on step k; `collect(step)` waits for every share and returns the
concatenated trajectory with each sample's policy version. One receiver thread per rollout rank reads its results
channel with the liveness bound (`async.liveness_timeout_s`): the rollout ranks send a heartbeat every
`async.heartbeat_s`, so a rank that dies is reported at once (its connection closes) and one that stops answering
within the bound, as `RolloutRankLost` naming the rank and the step in flight; an engine error on a rollout rank
comes back with its traceback as `RolloutRankFailed`. A rank that still answers but whose engine is stuck (it owes
samples and its heartbeats report none finished for `async.stall_timeout_s`) is reported lost too: heartbeats come
from their own thread, so liveness alone would let a hung engine keep the trainer waiting forever. Nothing here
waits without a bound.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from megatron_omni.parallel.placement import PlacementGroups
from megatron_omni.rollout.async_service.channel import (
    Bye,
    Cancel,
    ChannelLost,
    Checkpoint,
    Failed,
    Heartbeat,
    Interrupted,
    Request,
    Result,
    Stop,
    Weights,
    recv_object,
    send_object,
)
from megatron_omni.rollout.async_service.versions import AsyncSettings
from megatron_omni.rollout.base import SamplingParams, Trajectory


class RolloutRankLost(RuntimeError):
    """A rollout rank died or stopped answering; `rank`, `step` (the step it was serving or owed, None if none)."""

    def __init__(self, rank: int, step: int | None, reason: str, waited_s: float) -> None:
        at = f"while step {step} was in flight" if step is not None else "with no step in flight"
        super().__init__(f"rollout rank {rank} lost {at}: {reason} (after {waited_s:.1f} s; async.liveness_timeout_s "
                         "bounds the wait)")
        self.rank, self.step, self.reason, self.waited_s = rank, step, reason, waited_s


class RolloutRankFailed(RuntimeError):
    """A rollout rank raised while serving a step; the message carries its traceback."""

    def __init__(self, rank: int, step: int | None, error: str) -> None:
        at = f"serving step {step}" if step is not None else "before serving any step"
        super().__init__(f"rollout rank {rank} failed {at}:\n{error}")
        self.rank, self.step, self.error = rank, step, error


@dataclass
class _InFlight:
    version: int
    attempt: int
    shares: dict[int, int]  # rollout rank -> samples asked of it
    results: dict[int, Result] = field(default_factory=dict)


class RolloutClient:
    """Talk to the rollout ranks of a disaggregated placement; built on the trainer root only."""

    def __init__(self, groups: PlacementGroups, settings: AsyncSettings) -> None:
        placement = groups.placement
        if not placement.disaggregated or groups.rank != placement.trainer_root:
            raise ValueError(f"the rollout client runs on the trainer root (rank {placement.trainer_root}) of a "
                             f"disaggregated placement, not on rank {groups.rank} ({placement.mode})")
        self.groups = groups
        self.settings = settings
        self.ranks = list(placement.rollout_owners)  # the ranks that serve (rollout tp > 1: each group's owner)
        self._events: queue.Queue = queue.Queue()
        self._in_flight: dict[int, _InFlight] = {}
        self._attempts: dict[int, int] = {}
        self.last_heartbeat: dict[int, Heartbeat] = {}
        self.wait_s = 0.0  # time spent blocked in collect (the trainer's idle time)
        # per rank: seconds generating / swapping for the last collected step (Result.seconds / .swap_seconds)
        self.last_seconds: dict[int, float] = {}
        self.last_swap_seconds: dict[int, float] = {}
        self.rollout_stats: dict[int, dict[str, Any]] = {}
        self._closed: set[int] = set()
        # Progress, by rank: when it last finished a sample, started a request or was given work while it owed none
        # (monotonic receive times), and the (step, finished samples) its last heartbeat reported.
        self._progress_at: dict[int, float] = {}
        self._last_work: dict[int, tuple[int | None, int]] = {}
        self._threads = [threading.Thread(target=self._receive, args=(r,), name=f"client-from-{r}", daemon=True)
                         for r in self.ranks]
        for t in self._threads:
            t.start()

    def _receive(self, rank: int) -> None:
        while True:
            try:
                msg = recv_object(rank, self.groups.results[rank], self.settings.liveness_timeout_s)
            except ChannelLost as e:
                self._events.put((rank, e, time.monotonic()))
                return
            self._events.put((rank, msg, time.monotonic()))
            if isinstance(msg, Bye):
                return

    def _send(self, rank: int, msg: Any) -> None:
        try:
            send_object(msg, rank, self.groups.requests[rank])
        except RuntimeError as e:
            raise RolloutRankLost(rank, self._owed_step(rank), f"send failed: {e}", 0.0) from e

    def _owed_step(self, rank: int) -> int | None:
        owed = [s for s, f in self._in_flight.items() if f.shares.get(rank) and rank not in f.results]
        return min(owed) if owed else None

    # ------------------------------------------------------------------------------------------ requests
    def request(self, step: int, version: int, prompts: list[str], seeds: list[int], params: SamplingParams) -> None:
        """Ask for RL step `step` (prompts[i] with seeds[i], groups already expanded) sampled with policy `version`;
        returns at once. A step may be asked again only after it was cancelled."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts for {len(seeds)} seeds")
        if step in self._in_flight:
            raise ValueError(f"step {step} is already in flight")
        attempt = self._attempts.get(step, -1) + 1
        self._attempts[step] = attempt
        n, k = len(prompts), len(self.ranks)
        shares = {}
        for i, r in enumerate(self.ranks):
            lo, hi = i * n // k, (i + 1) * n // k
            if hi > lo:  # a rank without a share is not asked
                if self._owed_step(r) is None:  # idle until now: its stall clock starts with this request
                    self._progress_at[r] = time.monotonic()
                shares[r] = hi - lo
                self._send(r, Request(step, version, prompts[lo:hi], seeds[lo:hi], params, attempt))
        self._in_flight[step] = _InFlight(version, attempt, shares)

    def announce_weights(self, msg: Weights) -> None:
        """Tell every rollout rank that policy version `msg.version` follows on the weights group
        (`weights.push_weights` then runs the bridge)."""
        for r in self.ranks:
            self._send(r, msg)

    def checkpoint(self, step: int) -> None:
        """Tell every rollout rank to join the job's checkpoint after `step` RL steps (their collective save); only
        with nothing in flight (collect every step first: a rollout rank serves one message at a time)."""
        if self._in_flight:
            raise RuntimeError(f"checkpoint after step {step} with steps {sorted(self._in_flight)} in flight: collect "
                               "them first")
        for r in self.ranks:
            self._send(r, Checkpoint(step))

    def in_flight(self) -> dict[int, int]:
        """Steps requested and not yet collected, with the policy version each was asked with."""
        return {s: f.version for s, f in self._in_flight.items()}

    # ------------------------------------------------------------------------------------------ waiting
    def _check_stalls(self) -> None:
        """Raise `RolloutRankLost` for a rank that owes samples and has shown no progress for
        `async.stall_timeout_s` (called with every received event filed, so the progress times are current)."""
        now = time.monotonic()
        for rank in self.ranks:
            owed = self._owed_step(rank)
            idle = now - self._progress_at.get(rank, now)
            if owed is not None and rank not in self._closed and idle > self.settings.stall_timeout_s:
                raise RolloutRankLost(rank, owed, f"it answers but finished no sample for {idle:.1f} s "
                                      "(async.stall_timeout_s): its engine is stuck", idle)

    def _note_progress(self, rank: int, msg: Any, at: float) -> None:
        if isinstance(msg, Heartbeat):
            work = (msg.step, msg.done)
            if msg.step is not None and work != self._last_work.get(rank):  # started a request or finished samples
                self._progress_at[rank] = at
            self._last_work[rank] = work
        elif isinstance(msg, (Result, Interrupted)):
            self._progress_at[rank] = at

    def _next_event(self, step: int | None) -> tuple[int, Any]:
        # The receiver threads bound each rank's silence; this bound only catches a receiver that died itself.
        bound = 2 * self.settings.liveness_timeout_s + 5.0
        t0 = time.perf_counter()
        deadline = time.monotonic() + bound
        try:
            while True:
                try:
                    rank, msg, at = self._events.get_nowait()
                    break
                except queue.Empty:
                    self._check_stalls()  # every event so far is filed: no stale verdict after a long update
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RolloutRankLost(-1, step, "no rollout rank's receiver reported", bound)
                try:  # heartbeats arrive every heartbeat_s; waking as often keeps the stall check on time
                    rank, msg, at = self._events.get(timeout=min(remaining, self.settings.heartbeat_s))
                    break
                except queue.Empty:
                    continue
        finally:
            self.wait_s += time.perf_counter() - t0
        self._note_progress(rank, msg, at)
        if isinstance(msg, ChannelLost):
            self._closed.add(rank)
            raise RolloutRankLost(rank, self._owed_step(rank), msg.reason, msg.waited_s)
        if isinstance(msg, Failed):
            raise RolloutRankFailed(rank, msg.step, msg.error)
        if isinstance(msg, Heartbeat):
            self.last_heartbeat[rank] = msg
        if isinstance(msg, Bye):
            self._closed.add(rank)
            self.rollout_stats[rank] = msg.stats
        return rank, msg

    def _file(self, rank: int, msg: Any) -> None:
        """Keep a result for the step it belongs to (results of another step may arrive while waiting)."""
        if isinstance(msg, Result):
            f = self._in_flight.get(msg.step)
            if f is not None and f.attempt == msg.attempt:
                f.results[rank] = msg

    def collect(self, step: int) -> Trajectory:
        """Wait for every share of `step` and return them concatenated in rank order (each sample's
        `policy_version` set). Raises `RolloutRankLost` / `RolloutRankFailed` naming the rank and the step."""
        f = self._in_flight.get(step)
        if f is None:
            raise ValueError(f"step {step} was not requested (in flight: {sorted(self._in_flight)})")
        while set(f.results) != set(f.shares):
            rank, msg = self._next_event(step)
            if isinstance(msg, Bye):
                raise RolloutRankLost(rank, step, "it stopped", 0.0)
            self._file(rank, msg)
        del self._in_flight[step]
        self.last_seconds = {r: res.seconds for r, res in f.results.items()}
        self.last_swap_seconds = {r: res.swap_seconds for r, res in f.results.items()}
        parts = [f.results[r].trajectory for r in sorted(f.results)]
        return parts[0] if len(parts) == 1 else Trajectory.concat(parts)

    def result_seconds(self, step: int) -> dict[int, float]:
        """Seconds each rank spent generating its share of `step` (while it is still in flight)."""
        return {r: res.seconds for r, res in self._in_flight[step].results.items()}

    def wait_progress(self, step: int, samples: int) -> None:
        """Block until some rollout rank reports at least `samples` finished samples of `step` (bounded like
        `collect`); results that arrive meanwhile are kept."""
        while True:
            rank, msg = self._next_event(step)
            self._file(rank, msg)
            if isinstance(msg, Heartbeat) and msg.step == step and msg.done >= samples:
                return
            if isinstance(msg, Result) and msg.step == step:
                raise RuntimeError(f"step {step} finished on rank {rank} before {samples} samples were reported")

    def cancel(self, step: int) -> dict[int, int]:
        """Abandon `step` on every rank it was asked of and wait until each has dropped it (or finished it: the
        result is dropped too); returns the samples each rank had finished. The step can then be requested again
        and is regenerated from its seeds."""
        f = self._in_flight.get(step)
        if f is None:
            raise ValueError(f"step {step} is not in flight")
        for r in f.shares:
            self._send(r, Cancel(step, f.attempt))
        done: dict[int, int] = {}
        pending = set(f.shares)
        while pending:
            rank, msg = self._next_event(step)
            if isinstance(msg, (Interrupted, Result)) and msg.step == step and msg.attempt == f.attempt:
                done[rank] = msg.done if isinstance(msg, Interrupted) else len(msg.trajectory)
                pending.discard(rank)
            else:
                self._file(rank, msg)
        del self._in_flight[step]
        return done

    def reported_failure(self, wait_s: float) -> RuntimeError | None:
        """After a collective with the rollout ranks failed (a push's broadcast): the failure a rollout rank reported
        or the rank lost (`RolloutRankFailed` / `RolloutRankLost`, naming its cause), waiting up to `wait_s` for it;
        None if none came. A rank that fails sends its `Failed` before it leaves, so it is read before its closed
        connection."""
        deadline = time.monotonic() + wait_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                rank, msg, at = self._events.get(timeout=remaining)
            except queue.Empty:
                return None
            if isinstance(msg, Failed):
                return RolloutRankFailed(rank, msg.step, msg.error)
            if isinstance(msg, ChannelLost):
                self._closed.add(rank)
                return RolloutRankLost(rank, self._owed_step(rank), msg.reason, msg.waited_s)
            self._note_progress(rank, msg, at)
            self._file(rank, msg)
        return None

    def abandon(self) -> None:
        """After a lost or failed rank: ask every rollout rank still reachable to stop, without waiting for anyone
        (the trainer is about to raise)."""
        for r in self.ranks:
            try:
                send_object(Stop(), r, self.groups.requests[r])
            except RuntimeError:
                pass  # that rank is gone: nothing to stop

    def close(self) -> dict[int, dict[str, Any]]:
        """Stop every rollout rank and wait (bounded) for their goodbyes; returns their counters by rank."""
        if self._in_flight:
            raise RuntimeError(f"closing with steps {sorted(self._in_flight)} in flight: cancel or collect them first")
        for r in self.ranks:
            if r not in self._closed:
                self._send(r, Stop())
        while len(self._closed) < len(self.ranks):
            rank, msg = self._next_event(None)
        for t in self._threads:
            t.join(timeout=self.settings.liveness_timeout_s)
        return self.rollout_stats
