"""The rollout rank's side of asynchronous RL: a service that serves the trainer's requests one after the other with
its engine, receives new weights while it samples, and tells the trainer it is alive.

Three threads, each owning one channel (a gloo pair is never shared between threads):
- control (receives on `requests[rank]`): requests and stops go to the main loop's inbox; weights are received into
  the back buffer here (`WeightReceiver.receive`), so a push never waits for a rollout to finish; cancels mark
  their step.
- sender (sends on `results[rank]`): results, failures and progress as they come, and a heartbeat whenever
  nothing was sent for `heartbeat_s`. Its own error (a result that does not pickle) goes to the trainer as this
  rank's failure, with its traceback, and to the main loop, which raises it.
- main (`serve`): pops a request, swaps its policy version in (`WeightReceiver.ensure`, between two requests only),
  generates, stamps the version on the trajectory and hands it to the sender; a `Checkpoint` (sent when nothing is
  in flight) joins the job's collective save (`on_checkpoint`). An engine error is sent to the
  trainer with its traceback and re-raised here, never swallowed (verl-omni #433).

A cancelled step is abandoned after the sample in progress; the trainer regenerates it later from the same seeds
and version, bit for bit (samples depend only on their seeds and the weights).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from megatron_omni.parallel.placement import PlacementGroups
from megatron_omni.rollout.async_service.channel import (
    Bye,
    Cancel,
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
from megatron_omni.rollout.async_service.versions import AsyncSettings, stamp_version
from megatron_omni.rollout.async_service.weights import WeightReceiver
from megatron_omni.rollout.base import FinishedSample

# The control thread waits this long for the trainer's next message: the trainer may train for a long time between
# two requests; a dead trainer closes the connection, which ends the wait at once.
IDLE_WAIT_S = 7 * 24 * 3600.0


class _Cancelled(Exception):
    pass


class RolloutService:
    """Serve RL steps on one rollout rank of a disaggregated placement until the trainer stops it."""

    def __init__(self, engine: Any, groups: PlacementGroups, receiver: WeightReceiver, settings: AsyncSettings,
                 on_checkpoint: Callable[[int], Any] | None = None) -> None:
        """`on_checkpoint(step)`: this rank's part of the job's checkpoint after `step` RL steps (collective with the
        trainer's save); None: a `Checkpoint` message is an error."""
        placement = groups.placement
        if placement.role(groups.rank) != "rollout":
            raise ValueError(f"rank {groups.rank} is not a rollout rank of {placement}")
        self.engine = engine
        self.rank = groups.rank
        self.root = placement.trainer_root
        self.requests_group = groups.requests[self.rank]
        self.results_group = groups.results[self.rank]
        self.receiver = receiver
        self.settings = settings
        self.on_checkpoint = on_checkpoint
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self._step: int | None = None
        self._done = 0
        self.stats: dict[str, Any] = {"requests": 0, "interrupted": 0, "generate_s": 0.0, "swap_s": 0.0,
                                      "idle_s": 0.0, "weights_received": 0}

    # ------------------------------------------------------------------------------------------ threads
    def _control(self) -> None:
        try:
            while True:
                msg = recv_object(self.root, self.requests_group, IDLE_WAIT_S)
                if isinstance(msg, Weights):
                    try:
                        self.receiver.receive(msg)  # the broadcast runs to its end even when the engine fails
                    except Exception as e:  # noqa: BLE001 - the main loop raises it; this thread keeps the channel
                        self._inbox.put(e)
                        continue
                    self.stats["weights_received"] += 1
                elif isinstance(msg, Request):
                    self.receiver.want(msg.version)
                    self._inbox.put(msg)
                elif isinstance(msg, Cancel):
                    with self._lock:
                        self._cancelled.add(msg.key)
                elif isinstance(msg, Checkpoint):
                    self._inbox.put(msg)
                elif isinstance(msg, Stop):
                    self._inbox.put(msg)
                    return
                else:
                    raise TypeError(f"unexpected message {type(msg).__name__} from the trainer")
        except BaseException as e:  # noqa: BLE001 - handed to the main loop, which raises it
            self._inbox.put(e)

    def _sender(self) -> None:
        msg: Any = None
        try:
            while True:
                try:
                    msg = self._outbox.get(timeout=self.settings.heartbeat_s)
                except queue.Empty:
                    with self._lock:
                        msg = Heartbeat(self.rank, self._step, self._done)
                send_object(msg, self.root, self.results_group)
                if isinstance(msg, Bye):
                    return
        except BaseException as e:  # noqa: BLE001 - told to the trainer (if it can still hear) and to the main loop
            # A message that cannot be sent (a result that does not pickle, say) leaves the channel intact: the
            # trainer gets this rank's failure with the cause instead of a silence it would report as a lost rank.
            # A broken channel (the trainer gone) cannot carry it; the control thread reports that side too.
            error = (f"the sender thread of rollout rank {self.rank} failed sending {type(msg).__name__}:\n"
                     f"{traceback.format_exc()}")
            self._inbox.put(e)  # first: the trainer's answer to the failure (a Stop) must queue behind it
            try:
                send_object(Failed(self.rank, getattr(msg, "step", None), error), self.root, self.results_group)
            except BaseException:  # noqa: BLE001 - the channel itself is broken: the main loop still raises `e`
                pass

    def _progress(self, req: Request) -> Any:
        def on_sample(_: FinishedSample) -> None:
            with self._lock:
                self._done += 1
                cancelled = req.key in self._cancelled
                beat = Heartbeat(self.rank, req.step, self._done)
            if cancelled:
                raise _Cancelled()
            self._outbox.put(beat)
        return on_sample

    # ------------------------------------------------------------------------------------------ main loop
    def serve(self) -> dict[str, Any]:
        """Serve until the trainer sends `Stop`; returns the counters. Raises what failed (after telling the
        trainer), or the control channel's error when the trainer is gone."""
        control = threading.Thread(target=self._control, name=f"rollout{self.rank}-control", daemon=True)
        sender = threading.Thread(target=self._sender, name=f"rollout{self.rank}-sender", daemon=True)
        control.start()
        sender.start()
        step = None  # the step being served, for the failure report
        failed = False
        try:
            while True:
                t0 = time.perf_counter()
                item = self._inbox.get()
                self.stats["idle_s"] += time.perf_counter() - t0
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item, Stop):
                    break
                if isinstance(item, Checkpoint):
                    if self.on_checkpoint is None:
                        raise RuntimeError(f"rollout rank {self.rank} was asked to join the checkpoint after step "
                                           f"{item.step} but serves without checkpoints")
                    self.on_checkpoint(item.step)
                    self.stats["checkpoints"] = self.stats.get("checkpoints", 0) + 1
                    continue
                step = item.step
                self._serve_one(item)
                step = None
        except BaseException:
            self._outbox.put(Failed(self.rank, step, traceback.format_exc()))
            failed = True
            raise
        finally:
            self.stats["swaps"] = self.receiver.swaps
            self.stats["swap_probe_diffs"] = list(self.receiver.probe_diffs)
            self._outbox.put(Bye(self.rank, dict(self.stats)))
            sender.join(timeout=self.settings.liveness_timeout_s)
            if failed:  # stay until the trainer, told, stops this rank (bounded): its sends meanwhile still land
                control.join(timeout=self.settings.liveness_timeout_s)
        control.join(timeout=self.settings.liveness_timeout_s)
        return self.stats

    def _serve_one(self, req: Request) -> None:
        with self._lock:
            self._step, self._done = req.step, 0
            cancelled = req.key in self._cancelled
        try:
            if cancelled:
                self._outbox.put(Interrupted(self.rank, req.step, req.attempt, 0))
                self.stats["interrupted"] += 1
                return
            t0 = time.perf_counter()
            swap = self.receiver.ensure(req.version)  # between two requests: no sample sees a half-written policy
            self.stats["swap_s"] += swap
            self.stats["idle_s"] += time.perf_counter() - t0 - swap  # waiting for the version to arrive
            t1 = time.perf_counter()
            try:
                traj = self.engine.generate(req.prompts, req.params, group_size=1, seeds=req.seeds,
                                            on_sample=self._progress(req))
            except _Cancelled:
                self._outbox.put(Interrupted(self.rank, req.step, req.attempt, self._done))
                self.stats["interrupted"] += 1
                return
            seconds = time.perf_counter() - t1
            self.stats["generate_s"] += seconds
            self.stats["requests"] += 1
            stamp_version(traj, req.version)
            self._outbox.put(Result(self.rank, req.step, req.attempt, req.version, traj, seconds, swap))
        finally:
            self.receiver.release(req.version)
            with self._lock:
                self._cancelled.discard(req.key)
                self._step = None
