"""`parallel.job_report.report_on_rank0`: under torchrun's agent store the other ranks leave only once rank 0 has
printed (a store of our own here stands in for the agent's: the same TCPStore server the agent hosts)."""

from __future__ import annotations

import datetime
import threading
import time

import pytest
import torch.distributed as dist

from megatron_omni.parallel.job_report import global_rank, report_on_rank0
from megatron_omni.parallel.ports import free_port


@pytest.fixture
def agent_env():
    """A TCPStore server as torchrun's agent hosts it, and the environment torchrun gives rank `r` of a job."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))

    def env(rank: int, restart: int = 0) -> dict[str, str]:
        return {"RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "job",
                "TORCHELASTIC_RESTART_COUNT": str(restart)}

    yield env
    del server


def _in_thread(fn) -> threading.Thread:
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    return t


def test_other_ranks_wait_until_rank0_printed(agent_env, capsys) -> None:
    rank1 = _in_thread(lambda: report_on_rank0("config error: x", wait_s=30, env=agent_env(1)))
    time.sleep(1.0)
    assert rank1.is_alive()  # rank 1 holds: leaving now could get rank 0 killed before its line
    report_on_rank0("config error: x", wait_s=30, env=agent_env(0))
    rank1.join(timeout=10)
    assert not rank1.is_alive()
    assert capsys.readouterr().err == "config error: x\n"  # once: rank 1 prints nothing


def test_a_restarted_job_does_not_read_an_earlier_attempts_report(agent_env) -> None:
    report_on_rank0("config error: x", wait_s=30, env=agent_env(0, restart=0))
    t0 = time.monotonic()
    report_on_rank0("config error: x", wait_s=1.5, env=agent_env(1, restart=1))  # rank 0 of attempt 1 never reports
    assert time.monotonic() - t0 >= 1.4  # waited out its bound, then left


def test_without_an_agent_store_no_rank_waits(capsys) -> None:
    t0 = time.monotonic()
    report_on_rank0("config error: y", env={"RANK": "1", "WORLD_SIZE": "2"})  # a launcher other than torchrun
    assert time.monotonic() - t0 < 1.0 and capsys.readouterr().err == ""
    report_on_rank0("config error: y", env={})  # a lone process is rank 0
    assert capsys.readouterr().err == "config error: y\n"
    assert global_rank({"LOCAL_RANK": "3"}) == 3 and global_rank({"RANK": "5", "LOCAL_RANK": "1"}) == 5
