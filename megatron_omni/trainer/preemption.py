"""Stopping a run cleanly on SIGTERM/SIGINT: finish the step, write a checkpoint, exit 5 (resume with
`--resume auto`). A scheduler (Slurm's `--signal`, Kubernetes) sends SIGTERM before it kills; Ctrl-C sends
SIGINT. A second signal aborts at once (SystemExit 130 for SIGINT, 143 for SIGTERM; cleanups still run, so a
checkpoint being written is removed rather than left half-written). A repeat within `REPEAT_WINDOW_S` of the
first is the same request (Ctrl-C under torchrun arrives both from the terminal and forwarded by torchrun).
Python reports an exception raised inside a finalizer or an at-fork callback as "Exception ignored" and goes on;
when the abort lands there (a checkpoint writer's fork runs logging's at-fork callbacks), it is delivered again
once that callback has returned, so the abort cannot be lost.

Every rank must stop after the same step (a checkpoint is collective): the ranks all-reduce their flag at the
step boundary through the process group they are given, so a signal seen by one rank stops them all.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from types import FrameType

import torch
import torch.distributed as dist

from megatron_omni.parallel import platform

STOPPED_EXIT = 5
# Ctrl-C under torchrun reaches a worker twice within milliseconds: from the terminal (the whole foreground
# process group) and forwarded by torchrun. A repeat inside this window is the same request, not a second one.
REPEAT_WINDOW_S = 2.0


class TrainingStopped(Exception):
    """The run stopped on a signal after writing the checkpoint `folder` (after `step` steps)."""

    def __init__(self, signame: str, step: int, folder: str) -> None:
        super().__init__(f"stopped by {signame} after step {step}; checkpoint {folder} written "
                         f"(continue with --resume auto)")
        self.signame, self.step, self.folder = signame, step, folder


class StopRequests:
    """A context manager that catches SIGTERM and SIGINT while the run trains (main thread only).

    `requested(group)` is collective over `group`: True on every rank when any rank has seen a signal."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._first_at = 0.0
        self._previous: dict[int, object] = {}
        self._aborting: int | None = None  # the second signal, once seen
        self._previous_unraisable = sys.unraisablehook

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
            self._previous_unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if self._previous:
            sys.unraisablehook = self._previous_unraisable
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            if self._aborting is None and time.monotonic() - self._first_at < REPEAT_WINDOW_S:
                return
            self._aborting = signum
            raise SystemExit(128 + signum)
        self.signum, self._first_at = signum, time.monotonic()
        print(f"\n{signal.Signals(signum).name}: finishing this step and writing a checkpoint "
              f"(a second signal aborts at once)", file=sys.stderr, flush=True)

    def _unraisable(self, info: object) -> None:
        self._previous_unraisable(info)
        swallowed = getattr(info, "exc_value", None)
        if self._aborting is not None and isinstance(swallowed, SystemExit) and self._previous:
            # Re-sent from another thread: a signal sent from inside this callback would be handled inside it
            # (and swallowed again) before the callback returns.
            signum, main = self._aborting, threading.main_thread().ident
            timer = threading.Timer(0.05, signal.pthread_kill, (main, signum))
            timer.daemon = True  # never holds up the exit it asks for
            timer.start()

    def requested(self, group: dist.ProcessGroup | None = None) -> bool:
        """Collective: whether any rank of `group` has seen a signal (the same answer on every rank)."""
        flag = torch.tensor([0 if self.signum is None else self.signum], dtype=torch.int64, device=platform.device())
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if int(flag.item()) and self.signum is None:
            self.signum = int(flag.item())  # another rank's signal: this rank stops with it
        return bool(int(flag.item()))

    @property
    def signame(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "signal"
