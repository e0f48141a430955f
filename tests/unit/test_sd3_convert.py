"""SD3.5 checkpoints go through the one converter (`tools/checkpoint/convert.py`), the family detected from the
folder: diffusers -> Megatron distributed checkpoint -> diffusers is byte-exact for dual-attention blocks wherever
they sit (the registry's `config_mappings`), the offline tiny pipeline converts back into a pipeline that samples
the same image, and SD3.0 (no QK norm) is refused by name with exit status 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

from model_providers import get_family
from model_providers.sd3 import provider
from model_providers.sd3.tiny_pipeline import make_tiny_pipeline
from tests.unit.test_checkpoint_convert import assert_round_trip_byte_exact, random_model, tensor_hashes
from tools.checkpoint.convert import main


def write_sd3_folder(folder: Path, config: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A diffusers SD3 transformer folder with random non-zero weights, sharded (written by diffusers)."""
    random_model(SD3Transformer2DModel, config, seed, dtype).save_pretrained(folder, max_shard_size="100KB")
    return folder


@pytest.mark.parametrize("dtype,dual", [(torch.float32, (0,)), (torch.bfloat16, (0, 1))], ids=["fp32", "bf16-dual01"])
def test_round_trip_is_byte_exact(tmp_path: Path, dtype: torch.dtype, dual: tuple[int, ...]) -> None:
    config = dict(provider.hf_config("tiny"), dual_attention_layers=dual)
    src = write_sd3_folder(tmp_path / "hf", config, dtype=dtype)
    assert_round_trip_byte_exact(src, tmp_path, "sd3", "SD3Transformer2DModel", provider.hf_config)


def test_mappings_follow_the_dual_attention_blocks() -> None:
    fam = get_family("sd3")
    assert fam.convertible and fam.mappings is None
    medium = fam.mappings_for(provider.hf_config("sd35-medium"))
    attn2 = sorted({m.layer for m in medium if ".img_attn2." in m.megatron})
    assert attn2 == list(range(13))  # SD3.5-M: dual attention in its first 13 blocks
    assert {m.megatron for m in medium} == set(provider.megatron_shapes("sd35-medium"))
    # the Megatron config of a built model gives the same mappings as its diffusers config
    mcfg = fam.megatron_config("sd35-medium")
    assert [m.megatron for m in fam.mappings_for(mcfg)] == [m.megatron for m in medium]
    assert not any(".img_attn2." in m.megatron for m in fam.mappings_for(provider.hf_config("sd35-large")))
    # a family declaring only `mappings` (block count) is served the same way
    qwen = get_family("qwen_image")
    assert qwen.mappings_for({"_class_name": "QwenImageTransformer2DModel", **qwen.config("tiny")}) == qwen.mappings(2)


def test_sd30_without_qk_norm_is_refused_by_name(tmp_path: Path, capsys) -> None:
    src = write_sd3_folder(tmp_path / "sd30", dict(provider.hf_config("tiny"), qk_norm=None, dual_attention_layers=()))
    assert main(["hf-to-mcore", str(src), str(tmp_path / "mcore"), "--no-progress"]) == 2
    assert "qk_norm" in capsys.readouterr().err
    assert not (tmp_path / "mcore").exists()


def _image(folder: Path) -> torch.Tensor:
    pipe = StableDiffusion3Pipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    # Fresh allocations: CPU GEMM kernels round differently for differently aligned (memory-mapped) operands.
    with torch.no_grad():
        for name in ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3", "vae"):
            for p in getattr(pipe, name).parameters():
                p.data = p.data.clone()
    return pipe("a red cat", negative_prompt=" ", guidance_scale=4.5, height=64, width=64, num_inference_steps=2,
                max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="pt").images


def test_tiny_pipeline_round_trip_samples_the_same_image(tmp_path: Path) -> None:
    pipe = make_tiny_pipeline(tmp_path / "pipe", seed=0)
    index = json.loads((pipe / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert index["text_encoder"] == ["transformers", "CLIPTextModelWithProjection"]
    assert index["text_encoder_3"] == ["transformers", "T5EncoderModel"]
    assert index["tokenizer_3"][1].startswith("T5Tokenizer") and index["vae"][1] == "AutoencoderKL"
    assert main(["hf-to-mcore", str(pipe), str(tmp_path / "mcore"), "--no-progress"]) == 0
    assert main(["mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "out"), "--pipeline-source", str(pipe),
                 "--no-progress"]) == 0
    assert tensor_hashes(tmp_path / "out" / "transformer") == tensor_hashes(pipe / "transformer")
    original, converted = _image(pipe), _image(tmp_path / "out")
    assert original.shape == (1, 3, 64, 64) and float(original.std()) > 0
    assert torch.equal(original, converted)
    # the same seed gives the same pipeline, another seed other weights
    again = make_tiny_pipeline(tmp_path / "again", seed=0)
    other = make_tiny_pipeline(tmp_path / "other", seed=1)
    assert tensor_hashes(again / "transformer") == tensor_hashes(pipe / "transformer")
    assert tensor_hashes(other / "transformer") != tensor_hashes(pipe / "transformer")
