"""Run a function on N spawned ranks of one local job (gloo on CPU), with a timeout so a hung rank fails the
caller (a test, a benchmark) instead of stalling it.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` on `world_size` ranks that form one
job on a free loopback port, and returns the per-rank results in rank order. If any rank raises, `RankFailed`
carries that rank's traceback; if the ranks do not all finish within `timeout_s`, `RanksTimedOut` names the
ranks that did not.

Ranks are spawned (never forked) interpreters. Importing torch + Megatron-Core costs ~10 s of CPU per
process, so the ranks of one world size are kept as a pool for the whole process (a pytest session) and
reused by later calls; a pool whose task failed or timed out is killed and replaced by fresh processes, so one
broken test cannot leave gloo state behind for the next. Tests must therefore create their own process
groups (`build_parallel_groups`) and not rely on process-global state between calls.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.util  # noqa: F401  (before close_pools is registered: see there)
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

import psutil

from megatron_omni.parallel.ports import free_port


class RankFailed(AssertionError):
    """A spawned rank raised; the message carries its traceback."""


class RanksTimedOut(AssertionError):
    """Some ranks did not finish within the timeout (a hang or deadlock)."""


class PortTaken(RankFailed):
    """Rank 0 could not listen on the pool's rendezvous port: another process took it after `free_port`."""


PORT_ATTEMPTS = 3


def _rank_main(rank: int, world_size: int, port: int, tasks: Any, results: Any, parent_pid: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        from megatron_omni.parallel import platform

        platform.init_distributed(
            rank=rank, world_size=world_size, init_method=f"tcp://127.0.0.1:{port}", timeout_s=300
        )
    except BaseException:  # noqa: BLE001 - the traceback goes back to the test
        results.put(("error", rank, -1, traceback.format_exc()))
        return
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the test process is gone
                return
            continue
        if task is None:
            break
        task_id, fn, args, kwargs = task
        try:
            out = fn(rank, world_size, *args, **kwargs)
            results.put(("ok", rank, task_id, out))
        except BaseException:  # noqa: BLE001
            results.put(("error", rank, task_id, traceback.format_exc()))
            continue  # the test fails and replaces this pool
        _release_task_groups()
    platform.destroy_distributed()


def _release_task_groups() -> None:
    """Destroy the process groups a task created (every test builds its own), once every rank is done with
    them: each gloo group keeps its own polling threads, and hundreds of them left over from earlier tests
    in a pooled rank slow every later test."""
    import sys

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    keep = {c10d.GroupMember.WORLD}
    # A task that built vLLM-Omni's model-parallel groups and did not tear them down (an engine built in the rank,
    # not under `vllm_omni_parallel`) would leave its globals naming groups destroyed below, and the next task's
    # `initialize_model_parallel` in this pooled rank refuses to start ("must be empty").
    ps = sys.modules.get("vllm_omni.diffusion.distributed.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    # vLLM / vLLM-Omni create their world group once per process and reuse it in later tasks.
    for name in ("vllm.distributed.parallel_state", "vllm_omni.diffusion.distributed.parallel_state"):
        world = getattr(sys.modules.get(name), "_WORLD", None)
        if world is not None:
            keep.update(g for g in (getattr(world, "cpu_group", None), getattr(world, "device_group", None)) if g)
    dist.barrier()
    for pg in list(c10d._world.pg_map):
        if pg not in keep:
            dist.destroy_process_group(pg)


class _RankPool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        # Not daemonic: a rank may start helper processes of its own (distributed checkpoint save does).
        self.procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, port, self.tasks[r], self.results, os.getpid()))
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.next_id = 0

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout_s: float) -> list[Any]:
        task_id = self.next_id
        self.next_id += 1
        for q in self.tasks:
            q.put((task_id, fn, args, kwargs))
        outputs: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(outputs) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(self.world_size)) - set(outputs))
                raise RanksTimedOut(
                    f"ranks {missing} of {self.world_size} did not finish within {timeout_s:.0f} s "
                    f"(running {fn.__module__}.{fn.__name__})"
                )
            try:
                status, rank, got_id, payload = self.results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if r not in outputs and not p.is_alive()]
                if dead and self.results.empty():
                    time.sleep(0.5)
                    if self.results.empty():
                        raise RankFailed(
                            f"rank {dead[0]} exited with code {self.procs[dead[0]].exitcode} without a result"
                        ) from None
                continue
            if status == "error":
                if got_id == -1 and ("EADDRINUSE" in payload or "Address already in use" in payload):
                    raise PortTaken(f"rank {rank} of {self.world_size} could not listen:\n{payload}")
                raise RankFailed(f"rank {rank} of {self.world_size} failed:\n{payload}")
            if got_id == task_id:
                outputs[rank] = payload
        return [outputs[r] for r in range(self.world_size)]

    def close(self, graceful: bool) -> None:
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                # A rank's own children (the helper process a distributed-checkpoint save starts) would
                # outlive it, reparented, holding the test's output open: kill them with it.
                try:
                    children = psutil.Process(p.pid).children(recursive=True)
                except psutil.NoSuchProcess:
                    children = []
                p.kill()
                for child in children:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        child.kill()
                p.join(timeout=5)


_POOLS: dict[int, _RankPool] = {}


@atexit.register
def close_pools() -> None:
    # The ranks hold nothing worth a clean shutdown, and a gloo teardown can wait on its peers: kill them.
    # Exit handlers run last-registered first, and multiprocessing's own joins every live non-daemonic child (ours
    # wait for tasks forever): it must be registered before this one (the import at the top), so that this one
    # runs first. Imported lazily, at the first start of a process, it hung a script's exit.
    for pool in _POOLS.values():
        pool.close(graceful=False)
    _POOLS.clear()


def shutdown_pools(timeout_s: float = 30.0) -> None:
    """Stop every pooled rank cleanly (a script's last act; the test suite's pools die with it at exit): each rank
    leaves its loop and runs its exit handlers, so what it created (tqdm's multiprocessing lock, a semaphore) is
    released and no resource-tracker warning follows the script's last line. A rank still running after
    `timeout_s` is killed."""
    for pool in _POOLS.values():
        for q in pool.tasks:
            q.put(None)
        deadline = time.monotonic() + timeout_s
        for p in pool.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        pool.close(graceful=False)
        for q in (*pool.tasks, pool.results):
            q.close()
            q.join_thread()
    _POOLS.clear()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout_s: float = 240.0, fresh: bool = False,
              **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return results by rank.

    `fn` must be importable (a module-level function) and its arguments and result picklable. `fresh`: in
    new rank processes, killed afterwards (for tasks that leave process-wide state behind, like an engine).
    """
    # `free_port` closes its socket before rank 0 listens on the port, so another process (a second test worker,
    # another job on the machine) can take it in between: a pool whose rendezvous port was taken starts again on
    # a new one, a few times; any other failure is the test's.
    for _ in range(PORT_ATTEMPTS - 1):
        with contextlib.suppress(PortTaken):
            return _run_once(fn, world_size, args, kwargs, timeout_s, fresh)
    return _run_once(fn, world_size, args, kwargs, timeout_s, fresh)


def _run_once(fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout_s: float, fresh: bool) -> list[Any]:
    if fresh:
        pool = _RankPool(world_size)
        try:
            return pool.run(fn, args, kwargs, timeout_s + 120.0)
        finally:
            pool.close(graceful=False)
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _RankPool(world_size)
        timeout_s += 120.0  # the first task also waits for the ranks to start and import torch
    try:
        return pool.run(fn, args, kwargs, timeout_s)
    except BaseException:
        _POOLS.pop(world_size, None)
        pool.close(graceful=False)
        raise
