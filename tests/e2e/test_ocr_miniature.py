"""The OCR miniature as users run it: the shipped text pipeline is partly legible, and a shortened FlowGRPO
run of `examples.tiny.recipe:ocr_miniature`, OCR served by the reward server in its own process, raises the
held-out OCR similarity (ODE sampling, words seen and unseen in RL) by a fixed margin."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_omni.reward.launcher import RewardServerProcess

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "tiny" / "text_pipeline"
STEPS = 12
MARGIN = 0.10  # held-out OCR similarity after - before, absolute


def test_shipped_pipeline_is_partly_legible() -> None:
    """The folder carries how it was built, and its recorded OCR similarity leaves RL room (0 < s < 1)."""
    from model_providers.qwen_image.text_miniature import MINIATURE

    record = json.loads((PIPELINE / "pretrain.json").read_text())
    assert record["command"].startswith("python tools/pretrain_tiny_text.py") and record["seed"] == 0
    assert 0.1 <= record["ocr_similarity"] <= 0.6, record["ocr_similarity"]
    config = json.loads((PIPELINE / "transformer" / "config.json").read_text())
    assert config["num_layers"] == MINIATURE.transformer.num_layers
    assert config["attention_head_dim"] == MINIATURE.transformer.attention_head_dim
    size = sum(f.stat().st_size for f in PIPELINE.rglob("*") if f.is_file())
    assert size < 40 * 2**20, f"the shipped folder is {size / 2**20:.1f} MiB"


@pytest.mark.slow
def test_rl_raises_held_out_ocr(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    with RewardServerProcess("ocr", workers=1, max_queue=256, timeout_s=120) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_omni.train", "--recipe", "examples.tiny.recipe:ocr_miniature",
             "--set", f"run_dir={run_dir}", "--set", f"steps={STEPS}", "--set", f"reward.url={srv.url}",
             "--set", "logging.tensorboard=false"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, STEPS]
    before, after = evals
    assert all(math.isfinite(e[k]) for e in evals for k in ("seen_reward_mean", "unseen_reward_mean"))
    assert after["reward_mean"] >= before["reward_mean"] + MARGIN, (before, after)
    assert (run_dir / "eval_before_after.png").stat().st_size > 0
    assert "held-out eval (ODE)" in proc.stdout
