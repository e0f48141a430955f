"""Damaged checkpoints, a full disk and interrupted writes (docs/faults.md, "Damaged checkpoints, disk full and
interrupted conversion"), with real subprocesses: a truncated latest checkpoint is named by `--resume auto`,
`convert.py inspect` and `mcore-to-hf` and the run resumes from the newest intact one; ENOSPC during a save
(injected at `open`, tests/e2e/fault_injection) is one line and the previous checkpoint survives; SIGTERM
during a conversion leaves no `.partial` folder. The damaged checkpoint's `convert.py` calls run the tool's `main`
in this process (its exit status and output, no interpreter start with megatron-core, diffusers and transformers
per call: the suite's budget); its command line's own exit statuses: tests/e2e/test_convert_pipeline.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_omni.checkpoint import manifest
from tests.e2e.conftest import FAULT_STEPS as STEPS
from tests.e2e.in_process import call_main, script_module
from tests.e2e.test_faults_runs import _steps
from tests.e2e.test_flowgrpo_train import ROOT, SHORT, _assert_same_state, _env, _final_state, _rewards, _train

CONVERT = [sys.executable, str(ROOT / "tools" / "checkpoint" / "convert.py")]
INJECT = Path(__file__).parent / "fault_injection"


def _fault_env(kind: str, match: str, slow_s: float = 2.0) -> dict[str, str]:
    return {**_env(), "PYTHONPATH": f"{INJECT}{os.pathsep}{ROOT}", "FAULT": kind, "FAULT_MATCH": match,
            "FAULT_SLOW_S": str(slow_s)}


def _convert(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    """`convert.py ARGS` as its `main` in this process: (exit status and output, seconds)."""
    tool = script_module(CONVERT[1], "convert_cli")
    start = time.monotonic()
    return call_main(tool.main, args, args=[*CONVERT, *args]), time.monotonic() - start


@pytest.mark.slow
def test_a_damaged_latest_checkpoint_is_named_and_skipped(first_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "damaged"
    shutil.copytree(first_run, run)
    bad = run / "checkpoints" / "step_000004"
    data = bad / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size // 2)  # cut short, as by a full disk or a copy that stopped; COMPLETE is still there
    assert (bad / "COMPLETE").is_file()

    proc, seconds = _convert("inspect", str(bad))
    assert proc.returncode == 2 and seconds < 60, proc.stderr[-2000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert "damaged checkpoint" in line and "__0_0.distcp" in line and f"{size // 2} bytes, {size} written" in line
    out = tmp_path / "hf"
    proc, seconds = _convert("mcore-to-hf", str(bad), str(out), "--no-progress")
    assert proc.returncode == 2 and seconds < 60 and "__0_0.distcp" in proc.stderr.strip().splitlines()[-1]
    assert not out.exists() and not list(tmp_path.glob(".hf.partial-*"))
    assert _convert("inspect", str(run / "checkpoints" / "step_000002"))[0].returncode == 0

    # A checkpoint folder given by path is verified the same way before it is loaded: that refusal runs beside the
    # resume below (independent folders, one core each).
    again = tmp_path / "again"
    shutil.copytree(first_run / "checkpoints" / "step_000004", tmp_path / "given")
    with open(tmp_path / "given" / "common.pt", "r+b") as f:
        f.seek(0)
        f.write(b"XXXX")
    with ThreadPoolExecutor(1) as pool:
        given = pool.submit(_train, again, "--set", "steps=5", "--resume", str(tmp_path / "given"), timeout=300)
        resumed = _train(run, *STEPS, "--resume", "auto")
        proc = given.result()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"skipping damaged checkpoint {bad}: __0_0.distcp" in said
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 2" in said
    # Nothing lost: the redone steps give the uninterrupted run's weights, optimizer state and metrics.
    _assert_same_state(_final_state(first_run, 4), _final_state(run, 4))
    assert _rewards(run) == _rewards(first_run) and _steps(run) == [0, 1, 2, 3]
    assert proc.returncode != 0 and "common.pt does not match its checksum" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_disk_full_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    run = tmp_path / "full"
    args = ["--set", "steps=2", "--set", "checkpoint.every=1"]
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_omni.train", "--set", f"run_dir={run}", *SHORT, *args],
                          cwd=ROOT, env=_fault_env("enospc", "step_000002.tmp"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert time.monotonic() - start < 300
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: could not write checkpoint") and "No space left on device" in line
    assert f"the previous one {run / 'checkpoints' / 'step_000001'} is intact" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001"], "the partial one is left"
    manifest.verify(run / "checkpoints" / "step_000001")
    # Nothing lost: the run continues from it once there is room.
    resumed = _train(run, *args, "--resume", "auto")
    assert resumed.returncode == 0 and "at step 1" in resumed.stdout, resumed.stderr[-3000:]
    assert _steps(run) == [0, 1]


def _sigterm_mid_write(cmd: list[str], folder: Path, name: str) -> tuple[int, str]:
    """Run a conversion on a slow disk, SIGTERM it once its hidden `.NAME.partial-*` folder holds a file."""
    proc = subprocess.Popen([*CONVERT, *cmd], cwd=ROOT, env=_fault_env("slow", ".partial-"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            partial = list(folder.glob(f".{name}.partial-*"))
            if partial:
                break
            time.sleep(0.02)
        assert partial, "the conversion never started writing"
        time.sleep(0.5)  # inside the first (slow) file write
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return proc.returncode, err


@pytest.mark.slow
def test_sigterm_during_conversion_leaves_nothing(first_run: Path, tmp_path: Path) -> None:
    # The two conversions are independent (their own output folders): both run at once, one core each.
    with ThreadPoolExecutor(2) as pool:
        into_mcore = pool.submit(_sigterm_mid_write, ["hf-to-mcore", str(first_run / "pipeline"),
                                                      str(tmp_path / "mcore"), "--no-progress"], tmp_path, "mcore")
        into_hf = pool.submit(_sigterm_mid_write, ["mcore-to-hf", str(first_run / "checkpoints" / "step_000002"),
                                                   str(tmp_path / "hf"), "--no-progress"], tmp_path, "hf")
        (rc, err), (rc2, err2) = into_mcore.result(), into_hf.result()
    assert rc == 143, err[-2000:]
    assert rc2 == 143, err2[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "an interrupted conversion left files behind"
