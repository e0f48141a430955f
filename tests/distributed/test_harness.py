"""The rank harness itself: results come back in rank order, a failing rank fails the test with its
traceback, and a hung rank fails the test within the timeout instead of stalling the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from megatron_omni.parallel.rank_pool import RankFailed, RanksTimedOut, run_ranks


def _all_reduce_rank(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t)


def _rank_then_sum(rank: int, world_size: int) -> tuple[int, float]:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    if rank == 0:
        time.sleep(0.5)  # rank 0 answers last: arrival order is the reverse of rank order
    return rank, float(t)


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("deliberate failure on rank one")


def _hang_on_rank_zero(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_results_in_rank_order() -> None:
    # Each rank returns its own rank (the reduced sum is the same everywhere and cannot show the order), and
    # rank 0 answers last, so a harness that returned results as they arrive gives [(1, ..), (0, ..)].
    assert run_ranks(_rank_then_sum, 2) == [(0, 1.0), (1, 1.0)]


def test_failing_rank_shows_traceback() -> None:
    with pytest.raises(RankFailed, match="deliberate failure on rank one"):
        run_ranks(_fail_on_rank_one, 2)
    # The broken pool was replaced: the next job runs on fresh ranks.
    assert run_ranks(_all_reduce_rank, 2) == [1.0, 1.0]


def test_hung_rank_times_out() -> None:
    run_ranks(_all_reduce_rank, 2)  # make sure the pool is up, so the timeout below is the task's own
    start = time.monotonic()
    with pytest.raises(RanksTimedOut, match=r"ranks \[0\]"):
        run_ranks(_hang_on_rank_zero, 2, timeout_s=3)
    assert time.monotonic() - start < 30


def test_a_pool_whose_port_was_taken_starts_again_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """`free_port` closes its socket before rank 0 listens: another process can take the port in between (two
    test workers). The first port handed out here is held by a listening socket; the pool starts again."""
    import socket

    from megatron_omni.parallel import rank_pool

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = rank_pool.free_port
        monkeypatch.setattr(rank_pool, "free_port", lambda: ports.pop() if ports else real())
        assert run_ranks(_all_reduce_rank, 1, fresh=True, timeout_s=60) == [0.0]
        assert ports == [], "the taken port was handed to the first pool"


def test_a_script_that_used_a_pool_exits() -> None:
    """multiprocessing's exit handler joins every live child; the pool's own handler must kill the ranks first
    (registered after it), or a script (a benchmark) that ran ranks hangs after its last line."""
    code = "from operator import add\nfrom megatron_omni.parallel.rank_pool import run_ranks\nprint(run_ranks(add, 1))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MASTER_")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "[1]", proc.stderr[-2000:]
