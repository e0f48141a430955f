"""What a multi-process vLLM-Omni engine reports when it fails: a worker process that died (`EngineWorkerDied`, naming
its rank, pid, exit code or signal, what the engine was doing and the training step) and an engine that did not start
(`EngineStartError`, one line naming the cause).

vLLM-Omni's `mp` executor watches its worker processes (a monitor thread on their sentinels): when one dies it
marks itself failed and shuts down, and every request or `collective_rpc` in flight or after fails within about a
second, but with a message that names neither the worker nor what it was doing ("Executor shut down", or an empty
reply list). After an eviction the engine no longer holds the executor, so the worker processes are taken once, when
the engine starts (`worker_processes`), and read here when a call fails. Where several ranks share one engine, its
owner's result or failure reaches them all (`shared_by_owner`).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


class EngineWorkerDied(RuntimeError):
    """A vLLM-Omni worker process died while the engine served the trainer (the job cannot go on: exit 1)."""


class EngineStartError(RuntimeError):
    """The vLLM-Omni engine did not start; the message is one line naming the folder and the cause."""


def shared_by_owner(compute: Callable[[], Any], owner: int, group: Any,
                    failure: Callable[[bool, str, str], Exception], send: bool = True) -> Any:
    """`compute()` on the global rank `owner` of `group` (the ranks sharing its engine), collective over the group:
    the others get its result (None where not `send`: they learn only that it succeeded), or its failure, so none
    waits for an answer that never comes. The owner re-raises its own exception; the others raise
    `failure(died, kind, message)`: whether it was an `EngineWorkerDied`, its type's name and its first line."""
    box: list[Any] = [None]
    if dist.get_rank() == owner:
        try:
            result = compute()
        except Exception as exc:
            first = str(exc).splitlines()[0] if str(exc) else ""
            box = [("failed", isinstance(exc, EngineWorkerDied), type(exc).__name__, first)]
            dist.broadcast_object_list(box, src=owner, group=group)
            raise
        box = [("ok", result if send else None)]
        dist.broadcast_object_list(box, src=owner, group=group)
        return result
    dist.broadcast_object_list(box, src=owner, group=group)
    if box[0][0] == "failed":
        raise failure(*box[0][1:])
    return box[0][1]


def worker_processes(omni: Any) -> list[Any]:
    """The worker processes (`multiprocessing.Process`, in worker-rank order) of a started `Omni` whose executor
    starts them (vLLM-Omni's `mp` executor spawns them, ours forks them from a fork server); [] where the workers
    run in this process (`uni`, inline)."""
    procs: list[Any] = []
    for client in getattr(getattr(omni, "engine", None), "stage_clients", None) or []:
        executor = getattr(getattr(client, "_engine", None), "executor", None)
        procs.extend(getattr(executor, "_processes", None) or [])
    return procs


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}, exit code {code}"
        except ValueError:
            return f"killed by signal {-code}, exit code {code}"
    return f"exit code {code}"


def dead_workers(procs: list[Any], wait_s: float = 2.0, settle_s: float = 0.0) -> list[str]:
    """'rank R (pid P, killed by SIGKILL, exit code -9)' for each of `procs` that is no longer alive (joined up to
    `wait_s` so its exit code is known). `settle_s`: while none is found dead, look again for up to this long (a
    call can fail on a surviving worker, its peer's connection reset, a moment before the killed worker has exited)."""
    deadline = time.monotonic() + settle_s
    while True:
        gone = [(rank, p) for rank, p in enumerate(procs) if not p.is_alive()]
        if gone or not procs or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for _, p in gone:
        p.join(wait_s)
    # the executor stops the others after a death: those that exited cleanly are not the cause
    failed = [(rank, p) for rank, p in gone if p.exitcode != 0] or gone
    return [f"rank {rank} (pid {p.pid}, {_exit_text(p.exitcode)})" for rank, p in failed]


def worker_died_message(dead: list[str], what: str, step: int | None) -> str:
    """One line: which workers died, during what, at which training step."""
    when = "before the first training step" if step is None else f"at training step {step}"
    return (f"vLLM-Omni worker {', '.join(dead)} died during {what} {when}; the engine shut down "
            "(its log above has the worker's last lines)")


def root_cause(exc: BaseException) -> str:
    """The innermost non-empty message of `exc`'s chain (vLLM-Omni wraps a start-up failure in exceptions with empty
    messages), as 'Type: first line'."""
    found, inner, seen = exc, exc, set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        inner = cur
        if str(cur).strip():
            found = cur
        cur = cur.__cause__ or cur.__context__
    text = str(found).strip().splitlines()
    line = f"{type(found).__name__}: {text[0] if text else '(no message)'}"
    if inner is not found:  # the innermost has no message: its type is the cause (EOFError: a worker ended)
        hint = " (a worker process ended during start-up: its last lines are in the log above)" \
            if isinstance(inner, EOFError) else ""
        line = f"{line} {type(inner).__name__}{hint}"
    return line
