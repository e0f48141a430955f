"""The trainer with `--set rollout.engine=vllm_omni`, as users run it (`python -m megatron_omni.train`, torchrun
for two ranks): vLLM-Omni's real `Omni` engine serves the rollout (`rollout.vllm_omni_process=engine`, the
default: our CPU platform plugin, worker processes, bucketed RPC weight updates).
The reward rises over 8 steps at rollout tp 1 and 2; a run whose engine worker is SIGKILLed after its step-4
checkpoint exits 1 naming the worker and the step, and `--resume auto` ends bit-identical to an uninterrupted run;
an engine that cannot start is one line before any training. (First-step trajectory equality with the diffusers
engine and the probe's failures: tests/distributed/test_trainer_vllm_omni.py.)

The one-rank runs that do not depend on each other overlap (`_Background`, one core each): the uninterrupted
reference and the engine that cannot start run while the other run is killed and resumed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.test_flowgrpo_train import (
    FP32_VAE,
    ROOT,
    _assert_same_state,
    _Background,
    _command,
    _env,
    _final_state,
    _rewards,
    _train,
    reward_gain,
)

VLLM = ["--set", "rollout.engine=vllm_omni"]
# The engine samples in bf16 (`rollout.dtype=bf16`, the 20B recipes' setting; the trainer fp32), its VAE in fp32
# (`rollout.vae_dtype`, flow_grpo's: test_flowgrpo_train.FP32_VAE says why); checkpoints after steps 2, 4, 6 and 8,
# all kept.
BF16_STEPS = [*VLLM, "--set", "rollout.dtype=bf16", *FP32_VAE, "--set", "steps=8", "--set", "checkpoint.every=2",
              "--set", "checkpoint.keep=5"]


def _probe_diffs(run_dir: Path) -> list[float]:
    return [json.loads(line)["sync_probe_max_diff"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_served(proc: Any, run_dir: Path) -> None:
    """An fp32 run `run_dir` (its process `proc`) sampled on vLLM-Omni's served engine: its config says so, the
    engine's worker process (not the rank) was named at start-up, and every sync's probe is within fp32 rounding."""
    assert "worker processes (rank: pid) {0: " in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert json.loads((run_dir / "config.json").read_text())["rollout"]["vllm_omni_process"] == "engine"
    assert max(_probe_diffs(run_dir)) < 1e-5, _probe_diffs(run_dir)


@pytest.fixture(scope="module")
def background(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The module's independent one-rank runs, started together when the first test needs one: the uninterrupted
    bf16 8-step run (the reward curve, the resume's reference) and a run over a pipeline folder whose transformer
    weights are gone (the trainer's own checks accept it: model_index.json names a Qwen-Image pipeline, whose
    exit a thread times). name -> (run folder, its `_Background`); "bad_folder", "bad_ended": [(result, seconds
    from its start to its exit)] once the thread has it."""
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    root = tmp_path_factory.mktemp("vllm_one_rank")
    folder = make_tiny_pipeline(root / "pipe", seed=0)
    for f in (folder / "transformer").glob("*.safetensors"):
        f.unlink()
    runs = {"uninterrupted": (root / "uninterrupted", _Background(root / "uninterrupted", *BF16_STEPS)),
            "bad": (root / "bad", _Background(root / "bad", *VLLM, "--set", f"model.pipeline={folder}",
                                              "--set", "steps=2", timeout=300))}
    started, ended = time.monotonic(), []
    timer = threading.Thread(target=lambda: ended.append((runs["bad"][1].result(), time.monotonic() - started)),
                             daemon=True)
    timer.start()
    yield {**runs, "bad_folder": folder, "bad_timer": timer, "bad_ended": ended}
    for _, run in runs.values():
        run.__exit__()


def _kill_worker_after_checkpoint(run: Path, step: int, *args: str) -> tuple[int, int, str, float]:
    """Start a one-rank run, read its engine worker's pid from the trainer's start-up line and SIGKILL that worker
    once the step-`step` checkpoint is complete; returns (worker pid, exit code, stderr, seconds from the kill to
    the exit)."""
    proc = subprocess.Popen(_command(run, *args), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        pid = None
        for line in proc.stdout:
            found = re.search(r"worker processes \(rank: pid\) \{0: (\d+)\}", line)
            if found:
                pid = int(found.group(1))
                break
        assert pid is not None, "the trainer printed no worker pid"
        marker = run / "checkpoints" / f"step_{step:06d}" / "COMPLETE"
        deadline = time.monotonic() + 600
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), f"the run never reached its step-{step} checkpoint"
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        return pid, proc.returncode, stderr, time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.slow
def test_reward_rises_a_killed_worker_is_named_and_resume_is_bit_identical(background: dict, tmp_path: Path) -> None:
    """One uninterrupted 8-step run (the reward curve), each sync proven by the probe within the bf16 tolerance the
    trainer enforces (fp32 engines: tests/distributed/test_trainer_vllm_omni.py and the rollout-tp-2 run below).
    Another run has its engine's worker process SIGKILLed once its step-4 checkpoint is complete (the fifth step is
    sampling, training or syncing then): it ends within seconds, exit 1, its one line of ours naming the worker,
    its pid and the training step; resumed with `--resume auto` it ends bit-identical to the uninterrupted run."""
    run = tmp_path / "killed"
    pid, code, stderr, seconds = _kill_worker_after_checkpoint(run, 4, *BF16_STEPS)
    # the one line of ours (vLLM's log and the interpreter's resource tracker may print around it)
    lines = [x for x in stderr.splitlines() if x.startswith("rollout engine error:")]
    assert len(lines) == 1, stderr[-3000:]
    line = lines[0]
    print(f"exit {code} {seconds:.1f} s after the kill: {line}")
    assert code == 1, stderr[-2000:]
    assert line.startswith("rollout engine error: vLLM-Omni worker rank 0 (pid "
                           f"{pid}, killed by SIGKILL, exit code -9) died during"), line
    assert re.search(r"at training step [4-7]", line), line
    assert seconds < 60
    assert not (run / "checkpoints" / "step_000008").exists(), "the run finished before it was killed"
    resumed = _train(run, *BF16_STEPS, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr

    ref, uninterrupted = background["uninterrupted"]
    proc = uninterrupted.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(ref)
    print("vllm_omni bf16 rollout tp=1 reward per step:", [f"{x:.3f}" for x in r])
    print("probe max |diff| per sync:", [f"{x:.2e}" for x in _probe_diffs(ref)])
    assert len(r) == 8 and reward_gain(r) > 0.05, r
    import torch

    from megatron_omni.rollout.probe import probe_tolerance

    # bf16 rounding (measured 8e-3..1.2e-2 over 8 syncs), not an fp32-exact copy, within the trainer's bound
    assert 1e-5 < max(_probe_diffs(ref)) <= probe_tolerance(torch.float32, torch.bfloat16)
    _assert_same_state(_final_state(ref, 8), _final_state(run, 8))
    assert _rewards(ref) == _rewards(run)


@pytest.mark.slow
def test_reward_rises_rollout_tp2(tmp_path: Path) -> None:
    """Two ranks under torchrun, trainer tp 1 (data parallel 2), vLLM-Omni's engine with two worker processes
    (rollout tp 2: rank 0 owns it and serves rank 1's requests); the held-out evaluation before and after (rank 0's
    samples, its engine peer joining the calls) runs too. (This stalled once: torchrun's
    TORCHELASTIC_USE_AGENT_STORE, inherited by the engine's workers, made their rendezvous wait for a store no one
    hosted; the engine now starts its workers without it.)"""
    run = tmp_path / "rollout_tp2"
    proc = _train(run, *VLLM, "--set", "rollout.tp=2",
                  "--set", "steps=8", "--set", 'eval.prompts=["a red cube"]',
                  "--set", "eval.num_steps=4", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(run)
    print("vllm_omni rollout tp=2 reward per step:", [f"{x:.3f}" for x in r])
    assert len(r) == 8 and reward_gain(r) > 0.05, r
    assert max(_probe_diffs(run)) < 1e-5
    assert [e["step"] for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines())] == [0, 8]


def test_an_engine_that_cannot_start_is_one_line_before_any_training(background: dict) -> None:
    """The folder without transformer weights (started with the module's other one-rank run): the engine's owner
    names the cause in one line, exit 1, no step run, well within the bound (measured from the run's start)."""
    run, folder = background["bad"][0], background["bad_folder"]
    background["bad_timer"].join(timeout=300)
    assert background["bad_ended"], "the run over the broken folder did not end within 300 s"
    proc, seconds = background["bad_ended"][0]
    line = proc.stderr.strip().splitlines()[-1]
    print(f"{seconds:.0f} s: {line}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert line.startswith("rollout engine error: vLLM-Omni engine for") and "failed to start" in line, line
    assert f"no transformer weights (*.safetensors) in {folder / 'transformer'}" in line, line
    assert not (run / "metrics.jsonl").exists()
    assert seconds < 120


@pytest.mark.slow
def test_a_worker_killed_while_a_data_parallel_rank_waits_ends_every_rank(tmp_path: Path) -> None:
    """Rollout tp 1 with two trainer ranks (data parallel 2): each rank owns its own engine. Rank 0's worker is
    SIGKILLed once the first step's metrics are written; rank 1, whose engine is alive, waits for rank 0 in the
    step's collectives. Started as torchrun starts them (env://, but no agent to kill the survivors): rank 0 exits 1
    within seconds naming its worker, pid and the step, and rank 1 does not hang: rank 0 publishes its line in the
    job's TCPStore before leaving (`parallel.failure_notice`), and rank 1 prints the same line, naming the rank that
    raised it, and exits 1 at once (before, it left 14-20 s later on gloo's "Connection closed by peer")."""
    from tests.e2e.test_async_train import _kill_all, _start_ranks

    run = tmp_path / "dp2"
    procs = _start_ranks(run, *VLLM, "--set", "steps=50")
    try:
        pid = None
        for line in procs[0].stdout:
            found = re.search(r"trainer ranks \[0\]: worker processes \(rank: pid\) \{0: (\d+)\}", line)
            if found:
                pid = int(found.group(1))
                break
        assert pid is not None, "rank 0 printed no worker pid"
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):
            assert all(q.poll() is None for q in procs) and time.monotonic() < deadline, "no step finished"
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        exits: dict[int, float] = {}  # rank -> seconds from the kill to its exit
        ended = [threading.Thread(target=lambda i=i, q=q: (q.wait(timeout=120),
                                                           exits.__setitem__(i, time.monotonic() - killed)))
                 for i, q in enumerate(procs)]
        for t in ended:
            t.start()
        errs = [q.communicate(timeout=120)[1] for q in procs]
        for t in ended:
            t.join()
        seconds = time.monotonic() - killed
    finally:
        _kill_all(procs)
    lines = [x for x in errs[0].splitlines() if x.startswith("rollout engine error:")]
    theirs = [x for x in errs[1].splitlines() if x.startswith("rollout engine error:")]
    print(f"exits {[q.returncode for q in procs]}, {exits[0]:.1f} s and {exits[1]:.1f} s after the kill: {lines}; "
          f"rank 1: {theirs}")
    assert procs[0].returncode == 1 and len(lines) == 1, errs[0][-3000:]
    assert lines[0].startswith(f"rollout engine error: vLLM-Omni worker rank 0 (pid {pid}, killed by SIGKILL, "
                               "exit code -9) died during"), lines[0]
    assert re.search(r"at training step [1-9]", lines[0]), lines[0]
    assert procs[1].returncode == 1, errs[1][-3000:]
    assert theirs == [f"{lines[0]} (raised on rank 0; rank 1 stops with it)"], errs[1][-3000:]
    assert "Connection closed" not in errs[1], errs[1][-3000:]
    # rank 1 leaves as soon as it reads the notice, before rank 0 (which waits until every rank has read it)
    assert seconds < 60 and exits[1] <= exits[0] + 1.0, exits
