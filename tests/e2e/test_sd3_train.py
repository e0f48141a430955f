"""FlowGRPO on SD3.5 end to end, as users run it: the tiny recipe (`examples.sd3.recipe:tiny`, the offline tiny
SD3.5 pipeline built into the run folder, true CFG 4.5 with the pooled CLIP embeddings carried in the trajectory,
JPEG compressibility) through `python -m megatron_omni.train`, sampled by vLLM-Omni's own engine as users run
`rollout.engine=vllm_omni` by default (`rollout.vllm_omni_process=engine`: our `FlowGRPOSD3Pipeline` over vLLM-Omni's
SD3 pipeline in the engine's worker process, on our CPU platform plugin; every step's weights over `collective_rpc`,
probed). The reward rises over 8 steps, the trainer's recompute (Megatron SD3 with the trajectory's conditioning,
carried back from the worker) agrees with the rollout, and a SIGKILLed run (its worker going with it) resumes
bit-identically. One uninterrupted run serves the module; the killed run and its resume run beside it. (The
diffusers engine samples the same trajectories to ~5e-6: tests/distributed/test_image_vllm_omni.py; the served
engine, the diffusers engine's: tests/distributed/test_family_engines_served.py.)

Margin: the mean reward of the last two of 8 steps minus that of the first two, measured at seeds 0 / 1 / 2 with the
pipeline in the trainer's rank (`inline`): +0.049 / -0.154 / +0.056 (the recipe's docstring: the tiny random model
learns at two of three seeds); served, seed 0: +0.047. The test runs seed 0 and asserts > 0.02."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import _assert_resumed_bit_identically, _killed_and_resumed_beside, _rewards
from tests.e2e.test_flowgrpo_vllm_omni import assert_served

SD3 = ["--recipe", "examples.sd3.recipe:tiny", "--set", "seed=0", "--set", "checkpoint.every=4",
       "--set", "checkpoint.keep=5", "--set", "rollout.engine=vllm_omni"]
MARGIN = 0.02


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """An uninterrupted run of 8 steps, checkpoints after steps 4 and 8 (the resume test's reference), and beside
    it the same run SIGKILLed after its step-4 checkpoint and resumed: (run, killed, the resume)."""
    root = tmp_path_factory.mktemp("sd3")
    proc, resumed = _killed_and_resumed_beside(root / "tp1", root / "killed", 4, *SD3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_served(proc, root / "tp1")
    return root / "tp1", root / "killed", resumed


@pytest.fixture(scope="module")
def run(runs: tuple) -> Path:
    return runs[0]


def test_sd3_reward_rises_and_train_agrees_with_rollout(run: Path) -> None:
    r = _rewards(run)
    rise = sum(r[-2:]) / 2 - sum(r[:2]) / 2
    print("sd3 reward per step:", [f"{x:.4f}" for x in r], f"rise {rise:+.4f}")
    assert len(r) == 8 and rise > MARGIN, r
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the trainer's old log-probs (Megatron SD3 with the trajectory's pooled embeddings) equal the rollout's
    assert max(m["train_rollout_dlogp_max"] for m in metrics) < 1e-5
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["family"] == "sd3" and config["rollout"]["guidance_scale"] == 4.5
    assert config["rollout"]["engine"] == "vllm_omni"


def test_sd3_run_resumes_bit_identically(runs: tuple) -> None:
    run, killed, resumed = runs
    _assert_resumed_bit_identically(run, killed, 8, resumed)
    assert _rewards(run) == _rewards(killed)
