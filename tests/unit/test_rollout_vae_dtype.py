"""`rollout.vae_dtype`: the rollout engine's VAE in a dtype of its own (flow_grpo decodes in fp32 under a bf16
transformer). On the tiny Qwen-Image and Qwen-Image-Edit folders: a bf16 engine with an fp32 VAE samples the bf16
engine's trajectory bit for bit (the VAE is not in the denoising loop) and decodes it as the fp32 VAE does; the edit
engine also encodes its source images with it. The setting reaches vLLM-Omni's pipeline classes through
`custom_pipeline_args` (the served engine's worker: tests/distributed/test_family_engines_served.py); the trainer
refuses a dtype it does not know and the families that take none (test_config_validation.py, test_bagel_config.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.registry import EngineSettings, build_engine

PARAMS = SamplingParams(height=64, width=64, num_steps=4, noise_level=1.0, window_size=2, window_range=(0, 3))
SEEDS = [3, 4, 5, 6]
SAME = ("latents", "next_latents", "log_probs", "final_latents", "prompt_embeds")


def _engines(folder: Path) -> dict:
    """bf16 (VAE bf16 too), bf16 with an fp32 VAE, all fp32: the registry's builder, as the trainer builds them."""
    def build(dtype: torch.dtype, vae: torch.dtype | None):
        return build_engine("diffusers", folder, EngineSettings(dtype=dtype, max_batch_size=4, vae_dtype=vae))

    return {"bf16": build(torch.bfloat16, None), "mixed": build(torch.bfloat16, torch.float32),
            "fp32": build(torch.float32, None)}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    return make_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "pipe", seed=0)


def test_an_fp32_vae_under_a_bf16_transformer_changes_the_decode_only(folder: Path) -> None:
    engines = _engines(folder)
    mixed = engines["mixed"]
    assert {p.dtype for p in mixed.pipe.vae.parameters()} == {torch.float32}
    assert {p.dtype for p in mixed.transformer.parameters()} == {torch.bfloat16}
    prompts = ["a red cat", "OPEN 24 HOURS"]
    bf16, got = (engines[k].generate(prompts, PARAMS, group_size=2, seeds=SEEDS) for k in ("bf16", "mixed"))
    for f in SAME:
        assert torch.equal(getattr(bf16, f), getattr(got, f)), f
    moved = float((got.images - bf16.images).abs().max())
    print(f"bf16 vs fp32 VAE decode of the same latents: images max |diff| {moved:.2e}")
    assert moved > 1e-3
    want = engines["fp32"].decode(bf16.final_latents, PARAMS.height, PARAMS.width)
    assert torch.equal(got.images, want)  # the fp32 VAE's decode of those latents


def test_the_edit_engine_encodes_its_sources_with_the_vae_dtype(tmp_path: Path) -> None:
    from model_providers.qwen_image_edit.data import EditRecord
    from model_providers.qwen_image_edit.tiny_pipeline import make_tiny_edit_pipeline

    engines = _engines(make_tiny_edit_pipeline(tmp_path / "edit", seed=0))
    path = tmp_path / "source.png"
    Image.fromarray((np.random.RandomState(1).rand(64, 64, 3) * 255).astype("uint8")).save(path)
    prompts = [EditRecord(str(path), "write CAT").prompt]
    traj = {k: e.generate(prompts, PARAMS, group_size=2, seeds=SEEDS[:2]) for k, e in engines.items()}
    assert torch.equal(traj["mixed"].cond_latents, traj["fp32"].cond_latents)  # encoded by the fp32 VAE
    assert float((traj["mixed"].cond_latents - traj["bf16"].cond_latents).abs().max()) > 1e-3


def test_vllm_omni_pipeline_args_carry_the_vae_dtype(folder: Path) -> None:
    """What our vLLM-Omni pipeline classes do with `custom_pipeline_args`: the VAE vLLM-Omni loaded in the model's
    dtype is loaded again from the folder in the one named (its weights as stored, not bf16-rounded ones)."""
    from diffusers import AutoencoderKLQwenImage

    from megatron_omni.rollout.vllm_omni.pipeline import cast_vae, pipeline_args

    assert pipeline_args("x.P") == {"pipeline_class": "x.P"}
    args = pipeline_args("x.P", torch.float32)
    assert args == {"pipeline_class": "x.P", "vae_dtype": "float32"}
    want = AutoencoderKLQwenImage.from_pretrained(folder / "vae", torch_dtype=torch.float32)
    pipeline = SimpleNamespace(vae=AutoencoderKLQwenImage.from_pretrained(folder / "vae", torch_dtype=torch.bfloat16))
    cast_vae(pipeline, SimpleNamespace(custom_pipeline_args={"pipeline_class": "x.P"}, model=str(folder)))
    assert next(pipeline.vae.parameters()).dtype == torch.bfloat16  # none named: unchanged
    cast_vae(pipeline, SimpleNamespace(custom_pipeline_args=args, model=str(folder)))
    got = pipeline.vae.state_dict()
    assert all(torch.equal(got[k], v) for k, v in want.state_dict().items()), "not the folder's fp32 weights"
