"""SD3.5 and FLUX.1 through the trainer on vLLM-Omni's served engine, as users run `rollout.engine=vllm_omni` by
default (`rollout.vllm_omni_process=engine`: the `Omni` engine owns a worker process, our CPU platform plugin on this
machine): the tiny recipes (`examples.sd3.recipe:tiny` with true CFG 4.5 and pooled CLIP embeddings,
`examples.flux.recipe:tiny` with the distilled guidance input) for 3 steps each, side by side (one core each). Every
step's weights reach the worker over `collective_rpc` and the probe proves the sync within fp32's tolerance; the
trainer's recompute (Megatron SD3 / FLUX with the trajectory's conditioning, carried back from the worker) equals
the served rollout's log-probs. (Their learning runs and the resume: test_sd3_train.py and test_flux_train.py, on the
same pipeline classes in the trainer's rank; the engines alone: tests/distributed/test_family_engines_served.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import _Background, _rewards

SERVED = ["--set", "seed=0", "--set", "steps=3", "--set", "checkpoint.every=0", "--set", "rollout.engine=vllm_omni"]


@pytest.mark.slow
def test_sd3_and_flux_train_on_the_served_engine(tmp_path: Path) -> None:
    runs = {name: tmp_path / name for name in ("sd3", "flux")}
    with (_Background(runs["sd3"], "--recipe", "examples.sd3.recipe:tiny", *SERVED) as sd3,
          _Background(runs["flux"], "--recipe", "examples.flux.recipe:tiny", *SERVED) as flux):
        results = {"sd3": sd3.result(), "flux": flux.result()}
    for name, proc in results.items():
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        # served: the engine's worker process, not the rank, samples
        assert "worker processes (rank: pid) {0: " in proc.stdout + proc.stderr, name
        metrics = [json.loads(line) for line in (runs[name] / "metrics.jsonl").read_text().splitlines()]
        probes = [m["sync_probe_max_diff"] for m in metrics]
        gaps = [m["train_rollout_dlogp_max"] for m in metrics]
        print(f"{name} on the served engine: reward per step {[f'{x:.4f}' for x in _rewards(runs[name])]}, "
              f"probe max |diff| {max(probes):.1e}, train/rollout |dlogp| {max(gaps):.1e}")
        assert len(metrics) == 3 and max(probes) < 1e-5 and max(gaps) < 1e-5, (name, probes, gaps)
        config = json.loads((runs[name] / "config.json").read_text())
        assert config["rollout"]["vllm_omni_process"] == "engine" and config["model"]["family"] == name
