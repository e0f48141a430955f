"""`DRY_RUN=1 bash examples/bagel/train_bagel.sh` plans BAGEL-7B-MoT RL on one node of H200 and of H800 through the MoT
planner (planner/mot.py): the H200 fits at tp 1, the H800 needs tp 4 (its 80 GB hold neither tp 1 nor tp 2 with
the rollout's bf16 copy beside the trainer); a run without DRY_RUN=1 is refused with exit 2 and the reason.

The script runs with `PYTHON=echo`: it prints the planner command it would exec (no interpreter start), and the
planner runs in this process on exactly that argv. tests/e2e/test_launch_scripts.py runs the script end to end
(DRY_RUN=1, a real interpreter: exit 0, the world size reaching the planner), so that start is not paid twice."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "bagel" / "train_bagel.sh"


def _run(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MASTER_", "REWARD_", "JUDGE_"))}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env={**base, "PYTHON": sys.executable, **env},
                          capture_output=True, text=True, timeout=300)


def test_dry_run_plans_7b_mot_on_h200_and_h800(capsys: pytest.CaptureFixture) -> None:
    from megatron_omni.planner.mot import main

    proc = _run(DRY_RUN="1", PYTHON="echo")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    *said, argv = proc.stdout.splitlines()  # the script's own line, then the command it execs
    assert said == ["train_bagel: 1 node x 8 GPUs (H200 H800) = world size 8"], proc.stdout
    module, *args = argv.split()
    assert module == "-m" and args[0] == "megatron_omni.planner.mot", argv
    assert main(args[1:]) == 0
    out = capsys.readouterr().out
    assert "dry run: world size 8 trainer ranks" in out and "dry run OK" in out, out
    lines = out.splitlines()
    for gpu, chosen, rejected in (("H200", "tp=1 dp=8", []), ("H800", "tp=4 dp=2", ["tp=1", "tp=2"])):
        head = lines.index(next(t for t in lines if t.startswith(f"BAGEL 7b-mot RL on 8 x {gpu}")))
        block = lines[head:head + 14]
        assert f"chosen: {chosen} (the smallest tp that fits)" in block, out
        for tp in rejected:
            i = next(i for i, t in enumerate(block) if t.startswith(f"{gpu} {tp} "))
            assert "does not fit" in block[i + 1], out


def test_no_layout_fits_exits_3(capsys: pytest.CaptureFixture) -> None:
    from megatron_omni.planner.mot import main

    assert main(["--gpu", "H800", "--gpus", "1"]) == 3  # tp 1 only: 118 GiB on an 80 GB GPU
    assert "no layout fits on H800" in capsys.readouterr().out
    assert main(["--gpu", "A100"]) == 2


def test_real_run_refused_with_reason() -> None:
    proc = _run()
    assert proc.returncode == 2 and "only DRY_RUN=1" in proc.stderr, proc.stderr
