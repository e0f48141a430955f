"""A synchronous Megatron checkpoint save starts no helper process: its write results travel through the in-process
queue `synchronous_write_results` installs (megatron-core's own is a spawned `multiprocessing.Manager`, which
re-imports the caller's `__main__`: the trainer's imports again before each process's first save), and what it
wrote reads back equal."""

from __future__ import annotations

import multiprocessing
import queue
from pathlib import Path

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_omni.checkpoint.sharded_state import synchronous_write_results
from megatron_omni.checkpoint.streaming import single_process_group
from megatron_omni.parallel.megatron_cpu_shims import apply_cpu_shims


def test_save_starts_no_manager_and_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    apply_cpu_shims()  # what the trainer applies before any Megatron work on CPU
    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh process
    before = set(multiprocessing.active_children())
    weight = torch.arange(12.0).reshape(3, 4)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    with single_process_group():
        synchronous_write_results()
        dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weight.clone(), replica_id=0)}, str(folder))
        loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(3, 4), replica_id=0)},
                                         str(folder))
    assert type(filesystem_async._results_queue) is queue.Queue
    assert set(multiprocessing.active_children()) == before, multiprocessing.active_children()  # no SyncManager
    assert torch.equal(loaded["w"], weight)
