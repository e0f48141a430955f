"""The trainer with `--set rollout.engine=vllm_omni`, as users run it (`python -m megatron_omni.train`, torchrun
for two ranks): vLLM-Omni's real `Omni` engine serves the rollout (`rollout.vllm_omni_process=engine`, the
default: our CPU platform plugin, worker processes, bucketed RPC weight updates).
The reward rises over 8 steps at rollout tp 1 and 2, and a SIGKILLed run resumed with `--resume auto` ends
bit-identical to an uninterrupted one. (First-step trajectory equality with the diffusers engine and the
probe's failures: tests/distributed/test_trainer_vllm_omni.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import _assert_same_state, _final_state, _kill_after_checkpoint, _rewards, _train

VLLM = ["--set", "rollout.engine=vllm_omni"]


def _probe_diffs(run_dir: Path) -> list[float]:
    return [json.loads(line)["sync_probe_max_diff"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_reward_rises_and_sigkill_resume_is_bit_identical(tmp_path: Path) -> None:
    """One uninterrupted 8-step run (the reward curve) and one killed after its step-4 checkpoint, resumed; the
    engine samples in bf16 (`rollout.dtype=bf16`, the 20B recipes' setting; the trainer fp32), each sync proven by
    the probe within the bf16 tolerance the trainer enforces (fp32 engines: tests/distributed/
    test_trainer_vllm_omni.py and the rollout-tp-2 run below)."""
    steps = [*VLLM, "--set", "rollout.dtype=bf16", "--set", "steps=8", "--set", "checkpoint.every=2",
             "--set", "checkpoint.keep=5"]
    ref = tmp_path / "uninterrupted"
    proc = _train(ref, *steps)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = _rewards(ref)
    print("vllm_omni bf16 rollout tp=1 reward per step:", [f"{x:.3f}" for x in r])
    print("probe max |diff| per sync:", [f"{x:.2e}" for x in _probe_diffs(ref)])
    assert len(r) == 8 and sum(r[-2:]) / 2 > sum(r[:2]) / 2 + 0.05, r
    import torch

    from megatron_omni.rollout.probe import probe_tolerance

    # bf16 rounding (measured 8e-3..1.2e-2 over 8 syncs), not an fp32-exact copy, within the trainer's bound
    assert 1e-5 < max(_probe_diffs(ref)) <= probe_tolerance(torch.float32, torch.bfloat16)

    run = tmp_path / "killed"
    _kill_after_checkpoint(run, 4, *steps)
    assert not (run / "checkpoints" / "step_000008").exists(), "the run finished before it was killed"
    resumed = _train(run, *steps, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
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
    assert len(r) == 8 and sum(r[-2:]) / 2 > sum(r[:2]) / 2 + 0.05, r
    assert max(_probe_diffs(run)) < 1e-5
    assert [e["step"] for e in map(json.loads, (run / "eval.jsonl").read_text().splitlines())] == [0, 8]


def test_an_engine_that_cannot_start_is_one_line_before_any_training(tmp_path: Path) -> None:
    """A pipeline folder the trainer's own checks accept (model_index.json names a Qwen-Image pipeline) whose
    transformer weights are gone: the engine's owner names the cause in one line, exit 1, no step run."""
    import time

    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    folder = make_tiny_pipeline(tmp_path / "pipe", seed=0)
    for f in (folder / "transformer").glob("*.safetensors"):
        f.unlink()
    run = tmp_path / "bad"
    t0 = time.monotonic()
    proc = _train(run, *VLLM, "--set", f"model.pipeline={folder}", "--set", "steps=2", timeout=300)
    seconds = time.monotonic() - t0
    line = proc.stderr.strip().splitlines()[-1]
    print(f"{seconds:.0f} s: {line}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert line.startswith("rollout engine error: vLLM-Omni engine for") and "failed to start" in line, line
    assert f"no transformer weights (*.safetensors) in {folder / 'transformer'}" in line, line
    assert not (run / "metrics.jsonl").exists()
    assert seconds < 120


def test_a_worker_killed_mid_run_exits_1_naming_it(tmp_path: Path) -> None:
    """The trainer prints its engine's worker pids at start; one SIGKILLed after the first step's metrics are
    written (the second step is sampling, training or syncing then) ends the run within seconds: exit 1, the last
    line naming the worker, its pid and the training step."""
    import os
    import re
    import signal
    import subprocess
    import sys
    import time

    from tests.e2e.test_flowgrpo_train import ROOT, SHORT, _env

    run = tmp_path / "killed_worker"
    cmd = [sys.executable, "-m", "megatron_omni.train", "--set", f"run_dir={run}", *SHORT, *VLLM, "--set", "steps=50"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pid = None
        for line in proc.stdout:
            found = re.search(r"worker processes \(rank: pid\) \{0: (\d+)\}", line)
            if found:
                pid = int(found.group(1))
                break
        assert pid is not None, "the trainer printed no worker pid"
        metrics = run / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = proc.communicate(timeout=120)
        seconds = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    # the one line of ours (vLLM's log and the interpreter's resource tracker may print around it)
    lines = [x for x in stderr.splitlines() if x.startswith("rollout engine error:")]
    assert len(lines) == 1, stderr[-3000:]
    line = lines[0]
    print(f"exit {proc.returncode} {seconds:.1f} s after the kill: {line}")
    assert proc.returncode == 1, stderr[-2000:]
    assert line.startswith("rollout engine error: vLLM-Omni worker rank 0 (pid "
                           f"{pid}, killed by SIGKILL, exit code -9) died during"), line
    assert re.search(r"at training step [1-9]", line), line
    assert seconds < 60
