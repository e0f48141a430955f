"""BAGEL-7B-MoT's launch: `python -m megatron_omni.train --dry-run` plans it through the MoT planner (planner/mot.py,
reached from the one dry-run path): the H200 recipe fits at tp 1, the H800 recipe at tp 4 (its 80 GB hold neither
tp 1 nor tp 2 with the rollout's bf16 copy beside the trainer), a tp that does not fit exits 3 naming the one that
does; the non-dry launch (`LAUNCH_ECHO=1`) starts the reward server
and torchrun on the 7B recipe with the published folder.

The dry runs run in this process on the recipes `train_bagel.sh` names; tests/e2e/test_launch_scripts.py runs the
script end to end (DRY_RUN=1, a real interpreter per GPU kind: exit 0, the world size reaching the planner), so
that start is not paid twice."""

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


def _dry(gpu: str, *sets: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    from megatron_omni.train import main

    monkeypatch.setenv("WORLD_SIZE", "8")
    args = ["--recipe", f"examples.bagel.recipe:bagel_7b_{gpu.lower()}", "--dry-run", "--gpu", gpu]
    for s in sets:
        args += ["--set", s]
    rc = main(args)
    return rc, capsys.readouterr().out


def test_dry_run_plans_7b_mot_on_h200_and_h800(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
                                                ) -> None:
    for gpu, tp, rejected in (("H200", 1, []), ("H800", 4, [1, 2])):
        rc, out = _dry(gpu, monkeypatch=monkeypatch, capsys=capsys)
        assert rc == 0, out
        lines = out.splitlines()
        assert "dry run: world size 8 trainer ranks" in out and "dry run OK" in out, out
        assert f"layout: tp={tp} dp={8 // tp} (parallel.tp)" in lines, out
        assert "model from preset '7b-mot'" in out  # the published folder is not here
        for t in rejected:
            i = next(i for i, s in enumerate(lines) if s.startswith(f"{gpu} tp={t} "))
            assert "does not fit" in lines[i + 1], out
        h200_tp1 = next(s for s in lines if s.startswith("  + activations"))
        if gpu == "H200":
            assert "118.3 GiB of 140.4 GiB: fits" in h200_tp1, out  # docs/families-bagel.md's figure
    # tp 1 on H800: exit 3, naming the tp that fits
    rc, out = _dry("H800", "parallel.tp=1", monkeypatch=monkeypatch, capsys=capsys)
    assert rc == 3 and "the smallest tp that fits: --set parallel.tp=4" in out, out
    # LoRA rank 64 on the generation expert (the base frozen and counted once, the KL reference the base: no copy):
    # tp 2 fits an H800 where full training of the generation expert needs tp 4
    rc, out = _dry("H800", "parallel.tp=2", "model.lora.rank=64", "model.lora.alpha=64", "algorithm.beta=0.01",
                   monkeypatch=monkeypatch, capsys=capsys)
    assert rc == 0 and "LoRA rank 64" in out and "layout: tp=2 dp=4 (parallel.tp)" in out, out
    assert "59.3 GiB of 79.6 GiB: fits" in out and "KL reference" not in out, out  # docs/families-bagel.md's figure


def test_no_layout_fits_exits_3(capsys: pytest.CaptureFixture) -> None:
    from megatron_omni.planner.mot import main

    assert main(["--gpu", "H800", "--gpus", "1"]) == 3  # tp 1 only: 118 GiB on an 80 GB GPU
    assert "no layout fits on H800" in capsys.readouterr().out
    assert main(["--gpu", "A100"]) == 2


def test_real_launch_starts_reward_and_torchrun(tmp_path: Path) -> None:
    proc = _run(GPU_KIND="H200", LAUNCH_ECHO="1", PIPELINE_DIR=str(tmp_path / "BAGEL-7B-MoT"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    run = proc.stdout.splitlines()[-1]
    assert "torch.distributed.run --nnodes 1 --nproc-per-node 8" in run, proc.stdout
    assert "--recipe examples.bagel.recipe:bagel_7b_h200" in run and f"model.pipeline={tmp_path}" in run, run
    assert "megatron_omni.reward.server" in proc.stdout and "--scorer ocr" in proc.stdout, proc.stdout
    proc = _run(GPU_KIND="H200 H800")
    assert proc.returncode == 2 and "a run takes one GPU_KIND" in proc.stderr, proc.stderr
