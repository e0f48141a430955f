"""The OCR miniature's user path: the shipped text pipeline records how it was built, loads offline with the
miniature's architecture, and `examples.tiny.recipe:ocr_miniature` runs from it with the OCR reward served by
the reward server in its own process, evaluating the held-out prompts (words seen and unseen in RL) with the
ODE before and after training, and RL raises the held-out OCR similarity by a fixed margin."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from megatron_omni.reward.launcher import RewardServerProcess
from tests.e2e import zygote

ROOT = Path(__file__).resolve().parents[2]
PIPELINE = ROOT / "examples" / "tiny" / "text_pipeline"


def _chain(record: dict) -> list[dict]:
    """This run's record and the runs it continued (`--init-from`), newest first."""
    out = [record]
    while out[-1].get("previous"):
        out.append(out[-1]["previous"])
    return out


def test_shipped_pipeline_records_how_it_was_built() -> None:
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
    from model_providers.ocr_miniature.text_miniature import MINIATURE

    runs = _chain(json.loads((PIPELINE / "pretrain.json").read_text()))
    for run in runs:
        assert run["command"].startswith("python tools/pretrain_tiny_text.py"), run["command"]
        assert run["transformer_steps"] > 0 and 0.0 <= run["ocr_similarity"] <= 1.0
        assert run["history"] and run["history"][-1]["step"] == run["transformer_steps"]
    first = runs[-1]
    assert first.get("init_from") is None  # the first run started anew, or anew but for a VAE (--vae-from) ...
    origin = _chain(first["vae_source"])[-1] if first.get("vae_from") else first
    assert origin.get("init_from") is None and "--seed 0" in origin["command"]  # ... that a seed-0 run trained
    engine = DiffusersRolloutEngine(PIPELINE)
    assert engine.pipe.vae_scale_factor == 4
    assert engine.transformer.config.num_layers == MINIATURE.transformer.num_layers
    assert engine.transformer.config.attention_head_dim == MINIATURE.transformer.attention_head_dim
    size = sum(f.stat().st_size for f in PIPELINE.rglob("*") if f.is_file())
    assert size < 40 * 2**20, f"the shipped folder is {size / 2**20:.1f} MiB"


# The recipe the test runs: the comparison's best algorithm (docs/recipes.md, "The algorithms on the OCR
# miniature": FlowGRPO), shortened to STEPS steps and a held-out evaluation of 2 seeds per word. The held-out
# figure is the fair protocol's: (a) the RL words under seeds no RL step samples and (b) words never trained on,
# written with RL glyphs only. One run (seed 0, the recipe's) serves every assertion below (the suite's budget);
# the rise over several seeds is benchmarks/ocr_miniature.py's (`--seeds 0 1 2`).
RECIPE = "examples.tiny.recipe:ocr_miniature"
STEPS = 10
SEED = 0
# Measured on the 2-core CPU machine with this configuration: held-out OCR similarity seed 0: 0.229 -> 0.284
# (+0.055), seed 1: 0.362 -> 0.443 (+0.081), seed 2: 0.284 -> 0.372 (+0.088); the same figures as step 10 of
# 20-step runs. Each run is seeded end to end (rollout, noise levels, OCR reader, 2 threads), so the figures
# repeat and the margin sits below the smallest measured rise.
MARGIN = 0.04


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The recipe as a user runs it, once: the best algorithm from the shipped pipeline, OCR reward from the
    reward server in its own process, held-out evaluation (RL words at new seeds, unseen words of RL glyphs) with
    the ODE before and after. Returns the run folder, its config, eval records, stdout and the server's URL."""
    run_dir = tmp_path_factory.mktemp("ocr") / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    with RewardServerProcess("ocr", workers=1, max_queue=256, timeout_s=120) as srv:
        overrides = [f"run_dir={run_dir}", f"reward.url={srv.url}", "logging.tensorboard=false",
                     f"seed={SEED}", f"steps={STEPS}", "eval.seeds_per_prompt=2", "eval.transfer_prompts=[]",
                     "checkpoint.every=0"]
        argv = [*zygote.python_m("megatron_omni.train"), "--recipe", RECIPE]
        proc = subprocess.run(argv + [a for o in overrides for a in ("--set", o)], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=1500)
        url = srv.url
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return {"dir": run_dir, "config": json.loads((run_dir / "config.json").read_text()), "evals": evals,
            "stdout": proc.stdout, "url": url}


@pytest.mark.slow
def test_rl_from_the_shipped_pipeline_raises_held_out_ocr(run: dict) -> None:
    """RL raises the held-out figure by MARGIN; the records are finite similarities and the peak is the better
    of the two evaluations."""
    steps, evals = run["config"]["steps"], run["evals"]
    assert [e["step"] for e in evals] == [0, steps]
    for e in evals:
        assert all(math.isfinite(e[k]) and 0.0 <= e[k] <= 1.0 for k in
                   ("reward_mean", "seen_reward_mean", "unseen_reward_mean", "peak_reward_mean")), e
    before, after = evals[0]["reward_mean"], evals[-1]["reward_mean"]
    print(f"seed {SEED}: held-out OCR similarity {before:.3f} -> {after:.3f} after {steps} RL steps "
          f"((a) RL words {evals[0]['seen_reward_mean']:.3f} -> {evals[-1]['seen_reward_mean']:.3f}, (b) unseen "
          f"{evals[0]['unseen_reward_mean']:.3f} -> {evals[-1]['unseen_reward_mean']:.3f})")
    assert after >= before + MARGIN, (SEED, before, after)
    assert evals[-1]["peak_reward_mean"] == max(before, after)


@pytest.mark.slow
def test_run_folder_and_console_report_the_recorded_figures(run: dict) -> None:
    """The run folder holds the before/after picture and both evaluations; the config names the reward server,
    the shipped pipeline and the algorithm; the console's held-out line prints eval.jsonl's figures (one figure
    per run: the picture's title is the same reward_mean, test_trainer_evaluation.py)."""
    run_dir, config, evals, steps = run["dir"], run["config"], run["evals"], run["config"]["steps"]
    assert (run_dir / "eval_before_after.png").stat().st_size > 0
    assert sorted(p.name for p in (run_dir / "eval").glob("*.npz")) == ["step_0000.npz", f"step_{steps:04d}.npz"]
    assert config["reward"]["url"] == run["url"] and config["model"]["pipeline"].endswith("text_pipeline")
    assert config["algorithm"]["name"] == "flowgrpo"
    b, a = evals[0]["reward_mean"], evals[-1]["reward_mean"]
    assert f"held-out eval (ODE): reward {b:.4g} -> {a:.4g} " in run["stdout"], run["stdout"][-2000:]
