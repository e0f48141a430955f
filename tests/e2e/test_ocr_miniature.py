"""The OCR miniature's user path: the shipped text pipeline records how it was built, loads offline with the
miniature's architecture, and `examples.tiny.recipe:ocr_miniature` runs from it with the OCR reward served by
the reward server in its own process, evaluating the held-out prompts (words seen and unseen in RL) with the
ODE before and after training.

Not asserted yet (issue 11 stays open): that RL raises the held-out OCR similarity by a margin. The shipped
checkpoint is barely legible (its `pretrain.json` records OCR similarity 0.185 at the last evaluation); the
test will assert the rise once a pretraining run reaches partial legibility."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from megatron_omni.reward.launcher import RewardServerProcess

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "tiny" / "text_pipeline"


def _chain(record: dict) -> list[dict]:
    """This run's record and the runs it continued (`--init-from`), newest first."""
    out = [record]
    while out[-1].get("previous"):
        out.append(out[-1]["previous"])
    return out


def test_shipped_pipeline_records_how_it_was_built() -> None:
    from megatron_omni.rollout.diffusers_engine import DiffusersRolloutEngine
    from model_providers.qwen_image.text_miniature import MINIATURE

    runs = _chain(json.loads((PIPELINE / "pretrain.json").read_text()))
    for run in runs:
        assert run["command"].startswith("python tools/pretrain_tiny_text.py"), run["command"]
        assert run["transformer_steps"] > 0 and 0.0 <= run["ocr_similarity"] <= 1.0
        assert run["history"] and run["history"][-1]["step"] == run["transformer_steps"]
    assert runs[-1].get("init_from") is None and "--seed 0" in runs[-1]["command"]  # the first run started anew
    engine = DiffusersRolloutEngine(PIPELINE)
    assert engine.pipe.vae_scale_factor == 4
    assert engine.transformer.config.num_layers == MINIATURE.transformer.num_layers
    assert engine.transformer.config.attention_head_dim == MINIATURE.transformer.attention_head_dim
    size = sum(f.stat().st_size for f in PIPELINE.rglob("*") if f.is_file())
    assert size < 40 * 2**20, f"the shipped folder is {size / 2**20:.1f} MiB"


def test_recipe_runs_from_the_shipped_pipeline_with_the_reward_server(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    prompts = json.dumps(['text "CAT"', 'text "OK"'])  # one RL word, one held out
    with RewardServerProcess("ocr", workers=1, max_queue=256, timeout_s=120) as srv:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_omni.train", "--recipe", "examples.tiny.recipe:ocr_miniature",
             "--set", f"run_dir={run_dir}", "--set", "steps=2", "--set", f"reward.url={srv.url}",
             "--set", "rollout.prompts_per_step=1", "--set", "rollout.group_size=4",
             "--set", f"eval.prompts={prompts}", "--set", "eval.seeds_per_prompt=1", "--set", "eval.num_steps=8",
             "--set", "logging.tensorboard=false"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    for e in evals:
        assert all(math.isfinite(e[k]) and 0.0 <= e[k] <= 1.0
                   for k in ("reward_mean", "seen_reward_mean", "unseen_reward_mean")), e
    assert (run_dir / "eval_before_after.png").stat().st_size > 0
    assert sorted(p.name for p in (run_dir / "eval").glob("*.npz")) == ["step_0000.npz", "step_0002.npz"]
    config = json.loads((run_dir / "config.json").read_text())
    assert config["reward"]["url"] == srv.url and config["model"]["pipeline"].endswith("text_pipeline")
    assert "held-out eval (ODE)" in proc.stdout
