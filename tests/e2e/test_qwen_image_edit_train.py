"""Image-editing RL end to end, as users run it: `--recipe examples.qwen_image_edit.recipe:tiny` (the tiny offline
edit pipeline built into the run folder, the shipped "write W on this image" records, the `edit_text` reward)
through `python -m megatron_omni.train`, sampled by the vLLM-Omni engine (`rollout.engine=vllm_omni`, our edit
pipeline class inside the trainer's rank: `rollout.vllm_omni_process=inline`; every step's weights through the
Qwen-Image bridge). One 8-step run is shared: the reward rises, the sample grid is written, and a run SIGKILLed after
its step-4 checkpoint resumes (`--resume auto`) to the same state, bit for bit. (The same class served from the
engine's worker process, `rollout.vllm_omni_process=engine`, the default, gives the same curve, measured by hand,
docs/families-qwen-image-edit.md; in the suite the served engine samples the edit records in
tests/distributed/test_family_engines_served.py. Served here it would add each of the three runs an engine's start,
about 38 s of the module's minute.)

A 2-step run on the embedded diffusers engine (the recipe's default) with true CFG (`rollout.guidance_scale=4`,
negative prompt " ", as QwenImageEditPlusPipeline's `true_cfg_scale`) and a guided held-out evaluation: the trainer's
recompute sees the guidance and sources the rollout sampled with (the Trajectory's per-record negative embeddings and
source tokens): its trainer/rollout log-prob gap stays at float rounding. (The two engines sample the same
trajectories, CFG and two-source records included: tests/distributed/test_qwen_image_edit_vllm_omni.py; the 8-step
curve is the same on both to 4 decimals, measured by hand; the suite's budget runs the learning run on one.)

Margin: mean reward of the last two steps minus the first two, measured +0.0017 at seed 0 on either engine with the
pipeline in the trainer's rank (`inline`), +0.0018 served (per-step sample std about 0.0004; a random tiny model
writes nothing legible, so the rise is the keep term's); asserted > 0.0008.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from examples.qwen_image_edit.recipe import TINY_DATA, edit_prompts
from tests.e2e.test_flowgrpo_train import _assert_resumed_bit_identically, _killed_and_resumed_beside, _rewards, _train

EDIT = ["--recipe", "examples.qwen_image_edit.recipe:tiny", "--set", "steps=8", "--set", "checkpoint.every=4",
        "--set", "checkpoint.keep=5", "--set", "rollout.engine=vllm_omni", "--set", "rollout.vllm_omni_process=inline"]
MARGIN = 0.0008


@pytest.fixture(scope="module")
def edit_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """The 8-step run and, beside it, the same run SIGKILLed after its step-4 checkpoint and resumed: (run, killed,
    the resume)."""
    root = tmp_path_factory.mktemp("edit")
    proc, resumed = _killed_and_resumed_beside(root / "tp1", root / "killed", 4, *EDIT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "tp1", root / "killed", resumed


@pytest.fixture(scope="module")
def edit_run(edit_runs: tuple) -> Path:
    return edit_runs[0]


def test_edit_reward_rises_and_the_grid_shows_source_and_output(edit_run: Path) -> None:
    r = _rewards(edit_run)
    rise = sum(r[-2:]) / 2 - sum(r[:2]) / 2
    print("edit tiny reward per step (vLLM-Omni):", [f"{x:.4f}" for x in r], f"rise {rise:+.4f}")
    assert len(r) == 8 and rise > MARGIN, r
    assert (edit_run / "samples" / "step_0007.png").is_file()


def test_edit_run_resumes_bit_identically(edit_runs: tuple) -> None:
    edit_run, run, resumed = edit_runs
    _assert_resumed_bit_identically(edit_run, run, 8, resumed)
    assert _rewards(edit_run) == _rewards(run)


def test_edit_trains_on_the_diffusers_engine_with_true_cfg_and_evaluates_guided(edit_run: Path, tmp_path: Path
                                                                                ) -> None:
    """Rollout (the embedded diffusers engine), recompute and evaluation with true CFG: every step's trainer/rollout
    log-prob gap is float rounding (the recompute runs the negative rows the rollout ran; without them it is about
    1e-5, see tests/distributed/test_qwen_image_edit_rollout.py), and the guided evaluation scores its samples. On
    the tiny folder the 8-step run built into its run folder (the recipe's, seed 0: the same folder; building it
    again is seconds of CPU)."""
    held_out = json.dumps(edit_prompts(TINY_DATA)[:1])
    proc = _train(tmp_path / "cfg", *EDIT[:2], "--set", f"model.pipeline={edit_run / 'pipeline'}",
                  "--set", "steps=2", "--set", "checkpoint.every=0",
                  "--set", "rollout.prompts_per_step=2", "--set", "rollout.group_size=2",
                  "--set", "rollout.num_steps=4",
                  "--set", "rollout.guidance_scale=4", "--set", "rollout.negative_prompt= ",
                  "--set", f"eval.prompts={held_out}", "--set", "eval.guidance_scale=4", "--set", "eval.num_steps=2",
                  "--set", "eval.seeds_per_prompt=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "cfg" / "metrics.jsonl").read_text().splitlines()]
    gaps = [m["train_rollout_dlogp_max"] for m in metrics]
    evals = [json.loads(line) for line in (tmp_path / "cfg" / "eval.jsonl").read_text().splitlines()]
    print("edit on the diffusers engine, true CFG 4: train/rollout dlogp max per step", [f"{g:.2e}" for g in gaps],
          "eval reward", [e["reward_mean"] for e in evals])
    assert len(gaps) == 2 and max(gaps) < 1e-6, gaps
    assert len(evals) == 2 and all(0 <= e["reward_mean"] <= 1 for e in evals), evals
