"""(b) One FlowGRPO step of the `small` preset in bf16 on one CUDA device, through the entry point a user runs
(Megatron model in bf16 with fp32 main weights, the embedded diffusers engine in bf16, NCCL with one rank):
the step finishes, its metrics are finite, and its seconds per phase are recorded for the GPU check's table.
Skipped with the reason printed without CUDA (the CPU runs the same path in tests/e2e)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from model_providers.qwen_image.tiny_pipeline import SMALL_TRANSFORMER, TinyPipelineConfig, make_tiny_pipeline
from tests.gpu.cuda import require_cuda

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_small_preset_flowgrpo_step_in_bf16(tmp_path: Path, record) -> None:
    require_cuda("one FlowGRPO step in bf16")
    pipe = make_tiny_pipeline(tmp_path / "small", seed=0, config=TinyPipelineConfig(transformer=SMALL_TRANSFORMER))
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "megatron_omni.train", "--recipe", "examples.tiny.recipe:jpeg_demo",
            "--set", f"model.pipeline={pipe}", "--set", f"run_dir={run_dir}", "--set", "steps=2",
            "--set", "model.params_dtype=bf16", "--set", "rollout.dtype=bf16",
            "--set", "rollout.height=256", "--set", "rollout.width=256", "--set", "rollout.num_steps=10",
            "--set", "rollout.prompts_per_step=4", "--set", "rollout.group_size=8"]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 2
    last = steps[-1]  # the first step also pays for kernel selection and allocator growth
    phases = {k[len("time_"):]: v for k, v in last.items() if k.startswith("time_")}
    record("b_small_flowgrpo_step_bf16", **phases, images_per_s=last["images_per_s_per_rank"],
           train_rollout_dlogp=last["train_rollout_dlogp"])
    for key in ("reward_mean", "grad_norm", "train_rollout_dlogp"):
        assert math.isfinite(last[key]), (key, last[key])
