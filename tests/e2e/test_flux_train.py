"""FlowGRPO on FLUX.1 end to end, as users run it: the tiny recipe (`examples.flux.recipe:tiny`, the offline tiny
guidance-distilled FLUX.1 pipeline built into the run folder, the distilled guidance 3.5 as a model input carried in
the trajectory with the pooled CLIP embeddings, JPEG compressibility) through `python -m megatron_omni.train`, sampled
by vLLM-Omni's own engine as users run `rollout.engine=vllm_omni` by default (`rollout.vllm_omni_process=engine`: our
`FlowGRPOFluxPipeline` over vLLM-Omni's FLUX pipeline in the engine's worker process; every step's weights over
`collective_rpc`, probed; the diffusers engine samples the same trajectories to ~2e-6,
tests/distributed/test_image_vllm_omni.py). The reward rises over 6 steps, the trainer's recompute (Megatron FLUX)
equals the rollout's log-probs, and a run SIGKILLed after its step-3 checkpoint resumes bit-identically. The
uninterrupted run goes on while the other is killed and resumed (one core each).

Margin: the mean reward of the last two of 6 steps minus that of the first two, measured at seed 0: +0.089 with the
pipeline in the trainer's rank (`inline`, docs/families-flux.md), +0.091 served; the test asserts > 0.02."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import _assert_resumed_bit_identically, _killed_and_resumed_beside, _rewards
from tests.e2e.test_flowgrpo_vllm_omni import assert_served

FLUX = ["--recipe", "examples.flux.recipe:tiny", "--set", "seed=0", "--set", "steps=6", "--set", "checkpoint.every=3",
        "--set", "checkpoint.keep=5", "--set", "rollout.engine=vllm_omni"]
MARGIN = 0.02


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the uninterrupted 6-step run, the run killed after step 3 and resumed); the bit-identity is checked here,
    where the killed run resumes. The resume starts while the uninterrupted run is still going (one core each)."""
    root = tmp_path_factory.mktemp("flux")
    ref, killed = root / "uninterrupted", root / "killed"
    proc, resumed = _killed_and_resumed_beside(ref, killed, 3, *FLUX)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_served(proc, ref)
    _assert_resumed_bit_identically(ref, killed, 6, resumed)
    return ref, killed


def test_flux_reward_rises_and_train_agrees_with_rollout(runs: tuple[Path, Path]) -> None:
    ref, _ = runs
    r = _rewards(ref)
    rise = sum(r[-2:]) / 2 - sum(r[:2]) / 2
    print("flux reward per step:", [f"{x:.4f}" for x in r], f"rise {rise:+.4f}")
    assert len(r) == 6 and rise > MARGIN, r
    metrics = [json.loads(line) for line in (ref / "metrics.jsonl").read_text().splitlines()]
    # the trainer's old log-probs (Megatron FLUX with the trajectory's pooled embeddings and guidance) equal the
    # rollout's
    assert max(m["train_rollout_dlogp_max"] for m in metrics) < 1e-5
    config = json.loads((ref / "config.json").read_text())
    assert config["model"]["family"] == "flux" and config["rollout"]["distilled_guidance"] == 3.5
    assert config["rollout"]["engine"] == "vllm_omni"


def test_flux_run_resumes_bit_identically(runs: tuple[Path, Path]) -> None:
    ref, killed = runs  # the model and optimizer state compared in the fixture; the rewards after resume too
    assert _rewards(ref) == _rewards(killed)
