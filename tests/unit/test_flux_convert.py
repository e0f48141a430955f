"""FLUX.1 checkpoints go through the one converter (`tools/checkpoint/convert.py`), the family detected from the
folder: diffusers -> Megatron distributed checkpoint -> diffusers is byte-exact (fp32 with the guidance embedding,
bf16 without it: FLUX.1-schnell's shape), the offline tiny pipeline converts back into a pipeline that samples the
same image, and the mappings cover FLUX.1-dev's published shape."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from model_providers import get_family
from model_providers.flux import provider
from model_providers.flux.tiny_pipeline import make_tiny_pipeline
from tests.unit.test_checkpoint_convert import assert_round_trip_byte_exact, random_model, tensor_hashes
from tools.checkpoint.convert import main


@pytest.mark.parametrize("dtype,guidance", [(torch.float32, True), (torch.bfloat16, False)],
                         ids=["fp32-guidance", "bf16-no-guidance"])
def test_round_trip_is_byte_exact(tmp_path: Path, dtype: torch.dtype, guidance: bool) -> None:
    config = dict(provider.hf_config("tiny"), guidance_embeds=guidance)
    random_model(FluxTransformer2DModel, config, 0, dtype).save_pretrained(tmp_path / "hf", max_shard_size="100KB")
    assert_round_trip_byte_exact(tmp_path / "hf", tmp_path, "flux", "FluxTransformer2DModel", provider.hf_config)


def test_mappings_cover_flux1_dev() -> None:
    fam = get_family("flux")
    assert fam.convertible and fam.mappings is None
    dev = fam.mappings_for(provider.hf_config("flux1-dev"))
    assert {m.megatron for m in dev} == set(provider.megatron_shapes("flux1-dev"))
    assert len({m.layer for m in dev if m.layer is not None}) == 19 + 38
    assert [m.megatron for m in fam.mappings_for(fam.megatron_config("flux1-dev"))] == [m.megatron for m in dev]
    assert not any("guidance" in m.megatron for m in fam.mappings_for(dict(provider.hf_config("tiny"),
                                                                           guidance_embeds=False)))


def _image(folder: Path) -> torch.Tensor:
    pipe = FluxPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    # Fresh allocations: CPU GEMM kernels round differently for differently aligned (memory-mapped) operands.
    with torch.no_grad():
        for name in ("transformer", "text_encoder", "text_encoder_2", "vae"):
            for p in getattr(pipe, name).parameters():
                p.data = p.data.clone()
    return pipe("a red cat", guidance_scale=3.5, height=64, width=64, num_inference_steps=2, max_sequence_length=16,
                generator=torch.Generator().manual_seed(0), output_type="pt").images


def test_tiny_pipeline_round_trip_samples_the_same_image(tmp_path: Path) -> None:
    pipe = make_tiny_pipeline(tmp_path / "pipe", seed=0)
    index = json.loads((pipe / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    vae = json.loads((pipe / "vae" / "config.json").read_text())
    assert vae["latent_channels"] == 16 and len(vae["block_out_channels"]) == 4
    assert main(["hf-to-mcore", str(pipe), str(tmp_path / "mcore"), "--no-progress"]) == 0
    assert main(["mcore-to-hf", str(tmp_path / "mcore"), str(tmp_path / "out"), "--pipeline-source", str(pipe),
                 "--no-progress"]) == 0
    assert tensor_hashes(tmp_path / "out" / "transformer") == tensor_hashes(pipe / "transformer")
    original, converted = _image(pipe), _image(tmp_path / "out")
    assert original.shape == (1, 3, 64, 64) and float(original.std()) > 0
    assert torch.equal(original, converted)
    again = make_tiny_pipeline(tmp_path / "again", seed=0)
    other = make_tiny_pipeline(tmp_path / "other", seed=1)
    assert tensor_hashes(again / "transformer") == tensor_hashes(pipe / "transformer")
    assert tensor_hashes(other / "transformer") != tensor_hashes(pipe / "transformer")
