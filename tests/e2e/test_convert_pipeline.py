"""The command line end to end: a tiny Qwen-Image pipeline -> Megatron checkpoint -> a complete pipeline
that generates exactly the same image as the original (offline, fixed seed); bad input exits with 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch
from diffusers import QwenImagePipeline

from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline
from tests.e2e.in_process import call_main, script_module
from tests.unit.test_checkpoint_convert import tensor_hashes

ROOT = Path(__file__).resolve().parents[2]
CLI = ROOT / "tools" / "checkpoint" / "convert.py"


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(CLI), *args], capture_output=True, text=True, env=env, timeout=600)


def _image(folder: Path, fresh_memory: bool = False) -> torch.Tensor:
    pipe = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    if fresh_memory:
        # Weights load memory-mapped at their file offsets, and CPU GEMM kernels round differently for
        # differently aligned operands (measured: identical bytes at other offsets differ by ~4e-7).
        # Copying every parameter into a fresh allocation removes the alignment from the comparison.
        with torch.no_grad():
            for component in (pipe.transformer, pipe.text_encoder, pipe.vae):
                for p in component.parameters():
                    p.data = p.data.clone()
    return pipe("a red cat", negative_prompt=" ", true_cfg_scale=4.0, height=64, width=64, num_inference_steps=3,
                generator=torch.Generator().manual_seed(0), output_type="pt").images


def test_pipeline_round_trip_generates_the_same_image(tmp_path: Path) -> None:
    pipe = make_tiny_pipeline(tmp_path / "pipe", seed=0)
    r = _cli("hf-to-mcore", str(pipe), str(tmp_path / "mcore"), "--no-progress")
    assert r.returncode == 0, r.stderr
    r = _cli("mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "out"), "--pipeline-source", str(pipe),
             "--max-shard-size", "300KB")
    assert r.returncode == 0, r.stderr
    assert "mcore-to-hf" in r.stderr and "tensors" in r.stderr  # the progress bar
    transformer = tmp_path / "out" / "transformer"
    assert (transformer / "diffusion_pytorch_model.safetensors.index.json").is_file()
    assert tensor_hashes(transformer) == tensor_hashes(pipe / "transformer")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(p.name for p in pipe.iterdir())

    original, converted = _image(pipe, fresh_memory=True), _image(tmp_path / "out", fresh_memory=True)
    assert original.shape == (1, 3, 64, 64) and float(original.std()) > 0
    assert torch.equal(original, converted)
    mapped = _image(tmp_path / "out")  # as a user would load it: equal up to GEMM rounding
    assert float((mapped - original).abs().max()) < 1e-5

    r = _cli("mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "out"))
    assert r.returncode == 2 and "out is not empty" in r.stderr, (r.returncode, r.stderr)
    # The second bad input through the tool's main in this process (the exit status above is the command line's;
    # another interpreter start with megatron-core, diffusers and transformers would be the suite's budget).
    r = call_main(script_module(CLI, "convert_cli").main,
                  ["hf-to-mcore", str(tmp_path / "out" / "vae"), str(tmp_path / "vae-ckpt"), "--dry-run"])
    assert r.returncode == 2 and "unknown model family" in r.stderr and "AutoencoderKLQwenImage" in r.stderr, r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mcore", "out", "pipe"]
