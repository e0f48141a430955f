"""What a failed call into a multi-process vLLM-Omni engine reports: `faults.dead_workers` names a worker that died,
also one that exits a moment after the call failed (a surviving worker can report its peer's reset connection
first), and nothing when every worker lives."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from megatron_omni.rollout.vllm_omni.faults import dead_workers


def _exit_after(delay_s: float, code: int) -> None:
    time.sleep(delay_s)
    os._exit(code)


def test_a_worker_exiting_just_after_the_failure_is_named() -> None:
    ctx = mp.get_context("fork")
    late = ctx.Process(target=_exit_after, args=(0.5, 3))
    alive = ctx.Process(target=_exit_after, args=(30.0, 0))
    late.start()
    alive.start()
    try:
        assert dead_workers([alive, late]) == []  # at once: neither has exited yet
        t0 = time.monotonic()
        assert dead_workers([alive, late], settle_s=5.0) == [f"rank 1 (pid {late.pid}, exit code 3)"]
        assert time.monotonic() - t0 < 4.0
        t0 = time.monotonic()
        assert dead_workers([alive], settle_s=0.3) == [] and time.monotonic() - t0 >= 0.3
    finally:
        alive.kill()
        alive.join()
        late.join()
