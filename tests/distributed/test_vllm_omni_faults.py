"""Faults of vLLM-Omni's real `Omni` engine under the FlowGRPO trainer (`rollout.engine=vllm_omni`, the engine at
rollout tp 2 on two gloo ranks: rank 0 owns it, its two worker processes spawned by our `mp` executor, rank 1 sends
it its requests): a worker process SIGKILLed during a weight update, and one SIGKILLed during a rollout, is reported
on BOTH trainer ranks within seconds as `EngineWorkerDied`, naming the worker (rank, pid, SIGKILL) and the training
step; no rank waits on the dead engine. The pids are the executor's own processes (`engine._workers`). An engine
that cannot start (a pipeline class that does not import) fails in one line naming it, before a worker spawns.
(The trainer's exit code and its one line on a bad folder: tests/e2e/test_flowgrpo_vllm_omni.py.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

from megatron_omni.parallel.rank_pool import run_ranks
from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

pytestmark = pytest.mark.timeout(900)

# A death is seen by vLLM-Omni's worker monitor at once and raised by the call in flight within about a second;
# the bound leaves room for a loaded machine.
REPORTED_S = 30.0


def _trainer(folder: str, run_dir: str):
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.config import JobConfig
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    cfg = JobConfig(run_dir=run_dir, steps=2, seed=0)
    cfg.rollout.engine, cfg.rollout.tp, cfg.rollout.vllm_omni_process = "vllm_omni", 2, "engine"
    cfg.rollout.transformer = "engine"
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = 2, 2
    cfg.rollout.num_steps, cfg.rollout.height, cfg.rollout.width = 4, 32, 32
    cfg.optim.mini_batches, cfg.algorithm.clip_range = 1, 0.2
    cfg.validate(2)
    return FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout(tp=1)), folder,
                           RewardFunction("jpeg_compressibility"))


def _kill(engine, worker: int) -> dict:
    proc = engine._workers[worker]
    os.kill(proc.pid, signal.SIGKILL)
    return {"pid": proc.pid, "at": time.time()}


def _faults(rank: int, world_size: int, folder: str, root: str) -> dict:
    import torch.distributed as dist

    from megatron_omni.rollout.vllm_omni.faults import EngineWorkerDied

    out: dict = {}
    for case in ("weight_update", "rollout"):
        trainer = _trainer(folder, f"{root}/{case}")
        engine, killed = trainer.engine, {}
        try:
            if rank == 0:
                out[f"{case}_workers"] = [p.pid for p in engine._workers]
            step = 0
            if case == "weight_update":
                trainer.train_step(0)  # a whole step first: the sync path works before it is broken
                step = 1
                if rank == 0:
                    target, load = trainer.weight_sync.target, trainer.weight_sync.target.load_full

                    def dying_load(items, load=load, engine=engine, killed=killed):
                        killed.update(_kill(engine, 1))
                        return load(items)

                    target.load_full = dying_load
            elif rank == 0:
                generate = engine.omni.generate

                def dying_generate(*args, generate=generate, engine=engine, killed=killed, **kwargs):
                    for i, output in enumerate(generate(*args, **kwargs)):
                        if i == 0:  # one sample came back: the rollout is under way
                            killed.update(_kill(engine, 0))
                        yield output

                engine.omni.generate = dying_generate
            try:
                trainer.train_step(step)
                out[case] = {"error": None}
            except EngineWorkerDied as exc:
                out[case] = {"error": str(exc), "at": time.time()}
            out[case]["killed"] = killed
            box = [killed]
            dist.broadcast_object_list(box, src=0)  # the kill's time and pid, for rank 1's assertions
            out[case]["killed"] = box[0]
        finally:
            t0 = time.time()
            trainer.close()
            out[f"{case}_close_s"] = time.time() - t0
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("vllm_faults")
    folder = make_tiny_pipeline(root / "pipe", seed=0)
    return run_ranks(_faults, 2, str(folder), str(root), timeout_s=900, fresh=True)


@pytest.mark.parametrize("case,step,worker,what", [("weight_update", 1, 1, "a weight update"),
                                                   ("rollout", 0, 0, "a rollout")])
def test_a_killed_worker_is_reported_on_every_rank(results: list[dict], case: str, step: int, worker: int,
                                                   what: str) -> None:
    for rank, r in enumerate(results):
        got = r[case]
        assert got["error"] is not None, f"rank {rank}: no error after worker {worker} was killed"
        killed = got["killed"]
        assert killed["pid"] == results[0][f"{case}_workers"][worker]
        message = got["error"]
        print(f"rank {rank} {case}: {got['at'] - killed['at']:.1f} s after the kill: {message}")
        assert f"worker rank {worker} (pid {killed['pid']}, killed by SIGKILL" in message, message
        assert f"during {what}" in message and f"at training step {step}" in message, message
        assert got["at"] - killed["at"] < REPORTED_S
        assert r[f"{case}_close_s"] < REPORTED_S  # closing the dead engine does not wait on it either


def test_a_pipeline_class_that_does_not_import_is_named_before_a_worker_starts(tmp_path) -> None:
    from types import SimpleNamespace

    from megatron_omni.rollout.vllm_omni.engine import start_omni

    folder = make_tiny_pipeline(tmp_path / "pipe", seed=0)
    settings = SimpleNamespace(dtype="float32", quantization=None)
    t0 = time.monotonic()
    with pytest.raises(ImportError, match=r"pipeline class megatron_omni\.no_such\.Pipeline does not import"):
        start_omni(folder, 1, settings, pipeline_class="megatron_omni.no_such.Pipeline")
    assert time.monotonic() - t0 < REPORTED_S
    for f in (folder / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no transformer weights"):
        start_omni(folder, 1, settings)
