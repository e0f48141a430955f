"""Run folders and preemption (docs/faults.md, "Run folders, resume and preemption"), as users meet them with
`python -m megatron_omni.train` on the tiny recipe: a second start into a run's folder is refused and changes
nothing, `--resume auto` on nothing is refused, `--overwrite` starts a new run, SIGTERM checkpoints and exits 5
and the resumed run equals an uninterrupted one bit for bit, a second signal aborts at once."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from megatron_omni.trainer.preemption import REPEAT_WINDOW_S
from tests.e2e.conftest import FAULT_STEPS as STEPS
from tests.e2e.in_process import call_main
from tests.e2e.test_flowgrpo_train import (
    ROOT,
    SHORT,
    _assert_same_state,
    _Background,
    _command,
    _env,
    _final_state,
    _rewards,
    _train,
)

# A refusal happens before any work: seconds, however slow the machine (imports dominate).
REFUSAL_S = 60


def _snapshot(run: Path) -> dict[str, str]:
    """Every file of a run folder -> its SHA-256 (to show that nothing changed)."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _timed(run: Path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    proc = _train(run, *args, timeout=300)
    return proc, time.monotonic() - start


def test_a_second_start_into_a_run_folder_is_refused(first_run: Path, tmp_path: Path) -> None:
    before = _snapshot(first_run)
    proc, seconds = _timed(first_run, "--set", "steps=3")
    assert proc.returncode == 2, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert str(first_run) in line and "--resume auto" in line and "new run_dir" in line and "--overwrite" in line
    assert seconds < REFUSAL_S
    assert _snapshot(first_run) == before, "a refused start changed the run folder"
    # --resume auto where there is no checkpoint: refused too, unless auto-or-new (the entry point's `main` in this
    # process: the command line's exit 2 and its time are the refusal's above).
    from megatron_omni import train

    empty = tmp_path / "empty"
    start = time.monotonic()
    proc = call_main(train.main, ["--set", f"run_dir={empty}", *SHORT, "--resume", "auto", "--set", "steps=1"],
                     env=_env())
    seconds = time.monotonic() - start
    assert proc.returncode == 2 and seconds < REFUSAL_S
    assert "holds no complete checkpoint" in proc.stderr and "--resume auto-or-new" in proc.stderr
    assert not empty.exists()


@pytest.mark.slow
def test_overwrite_and_auto_or_new_start_one_new_run(first_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "again"
    shutil.copytree(first_run, run)
    (run / "notes.txt").write_text("mine")
    old_id = json.loads((run / "config.json").read_text())["run_id"]
    # auto-or-new on a folder without a checkpoint (a run lost before its first one), checked below: its run goes
    # on meanwhile (one rank each, independent folders).
    lost = tmp_path / "lost"
    lost.mkdir()
    (lost / "metrics.jsonl").write_text(json.dumps({"step": 0, "reward_mean": 0.0}) + "\n")
    with _Background(lost, "--resume", "auto-or-new", "--set", "steps=1") as auto_or_new:
        proc = _train(run, "--overwrite", "--set", "steps=1")
        lost_proc = auto_or_new.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--overwrite: removed" in proc.stdout
    assert (run / "notes.txt").read_text() == "mine", "--overwrite removed a file that is not the run's"
    assert _steps(run) == [0]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"]
    new_id = json.loads((run / "config.json").read_text())["run_id"]
    assert new_id != old_id and (run / "checkpoints" / "step_000001" / "RUN_ID").read_text().strip() == new_id
    # auto-or-new on a folder without a checkpoint: a new run, old records gone.
    assert lost_proc.returncode == 0, lost_proc.stderr[-3000:]
    assert _steps(lost) == [0] and _rewards(lost)[0] == _rewards(first_run)[0]


def _start(run: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(_command(run, *args), cwd=ROOT, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    if not path.exists():
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{path} never appeared: {proc.stderr.read()[-3000:] if proc.stderr else ''}")


@pytest.mark.slow
def test_sigterm_checkpoints_exits_5_and_resumes_bit_identically(first_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "preempted"
    proc = _start(run, *STEPS)
    _wait_for(run / "metrics.jsonl", proc)  # the first step is done, the second under way
    os.kill(proc.pid, signal.SIGTERM)
    sent = time.monotonic()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 5, err[-3000:]
    assert time.monotonic() - sent < 120  # one step and one tiny checkpoint
    line = err.strip().splitlines()[-1]
    assert "stopped by SIGTERM" in line and "--resume auto" in line
    done = [p.name for p in (run / "checkpoints").iterdir()]
    assert len(done) == 1 and done[0] in {"step_000001", "step_000002"}, done
    k = int(done[0].removeprefix("step_"))
    assert _steps(run) == list(range(k))
    resumed = _train(run, *STEPS, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / done[0]} at step {k}" in resumed.stdout
    _assert_same_state(_final_state(first_run, 4), _final_state(run, 4))
    assert _rewards(run) == _rewards(first_run)
    assert _steps(run) == [0, 1, 2, 3], "metrics.jsonl is one run, in order, without duplicates"
    assert json.loads((run / "config.json").read_text())["run_id"] == (run / "checkpoints" / "step_000004" /
                                                                         "RUN_ID").read_text().strip()


@pytest.mark.slow
def test_a_second_signal_aborts_at_once_and_leaves_no_partial_checkpoint(tmp_path: Path) -> None:
    """The signals land while the step-1 checkpoint is being written (a slow disk: each file open sleeps)."""
    run = tmp_path / "aborted"
    env = {**_env(), "PYTHONPATH": f"{Path(__file__).parent / 'fault_injection'}{os.pathsep}{ROOT}",
           "FAULT": "slow", "FAULT_MATCH": "step_000001.tmp", "FAULT_SLOW_S": "5"}
    proc = _start(run, "--set", "steps=3", "--set", "checkpoint.every=1", env=env)
    _wait_for(run / "checkpoints" / "step_000001.tmp", proc)
    time.sleep(0.5)
    os.kill(proc.pid, signal.SIGINT)  # the first: finish and checkpoint ...
    time.sleep(REPEAT_WINDOW_S + 0.5)  # a repeat inside the window would be the same request
    os.kill(proc.pid, signal.SIGINT)  # ... the second: abort now
    sent = time.monotonic()
    _, err = proc.communicate(timeout=120)
    with contextlib.suppress(ProcessLookupError):  # a writer process of the aborted save, if still there
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert time.monotonic() - sent < 30
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == [], f"an aborted save left {left}"


@pytest.mark.slow
def test_sigterm_to_one_torchrun_rank_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    """The stop flag is all-reduced at the step boundary: a signal to rank 1 alone stops rank 0 too, after the
    same step, with one complete checkpoint of it (torchrun itself then reports the workers' exit 5 as a
    failure, rc 1)."""
    import psutil

    from megatron_omni.checkpoint import manifest

    run = tmp_path / "tp2"
    cmd = _command(run, "--set", "steps=16", "--set", "parallel.tp=2", "--set", "checkpoint.every=0", nproc=2)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _wait_for(run / "metrics.jsonl", proc)
    workers = sorted(psutil.Process(proc.pid).children(), key=lambda p: p.pid)
    assert len(workers) == 2
    rank1 = next(w for w in workers if w.environ().get("RANK") == "1")
    rank1.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    done = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(done) == 1, done
    k = int(done[0].removeprefix("step_"))
    assert 1 <= k < 16 and _steps(run) == list(range(k))
    assert f"stopped by SIGTERM after step {k}" in err and "exitcode  : 5" in err, err[-3000:]
    manifest.verify(run / "checkpoints" / done[0])
