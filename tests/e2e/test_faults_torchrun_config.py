"""Under torchrun a config error prints once (rank 0) and every rank exits 2 before the process group exists.

torchrun itself (torch 2.13's elastic agent) exits 1 whenever a child fails and prints its ChildFailedError
report, in which the first rank to stop shows `exitcode: 2` (torchrun SIGTERMs the others: 2 or -15): that is
what docs/faults.md documents. A plain process
(`WORLD_SIZE=N python -m megatron_omni.train ... --dry-run`) returns the 2 itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from tests.e2e.in_process import call_main

ROOT = Path(__file__).resolve().parents[2]


def test_torchrun_config_error_prints_once_and_every_rank_exits_2(tmp_path: Path) -> None:
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "megatron_omni.train",
         "--set", "checkpoint.keep=0", "--set", f"run_dir={tmp_path / 'run'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=180, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    took = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert out.count("config error:") == 1, out[-4000:]
    assert "config error: checkpoint.keep=0 must be >= 1" in out
    assert proc.returncode == 1, (proc.returncode, out[-4000:])  # torchrun's own status when a child fails
    codes = re.findall(r"exitcode\s*:\s*(-?\d+)", out)
    # The ranks' statuses: 2 for the first to finish validating; torchrun SIGTERMs the ranks still running then
    # (-15), so a slower rank shows either its own 2 or -15, never 1 or a traceback.
    assert "2" in codes and set(codes) <= {"2", "-15"}, out[-4000:]
    assert not (tmp_path / "run").exists()
    assert took < 120, took
    # The same config as one process with the job's world size: exit 2 itself (the entry point's `main` in this
    # process, with the job's environment; a plain command line's exit 2: test_flowgrpo_train.py).
    from megatron_omni.train import main

    single = call_main(main, ["--dry-run", "--set", "checkpoint.keep=0"],
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "WORLD_SIZE": "2"})
    assert single.returncode == 2 and "config error: checkpoint.keep=0" in single.stderr
