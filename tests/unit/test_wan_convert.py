"""Wan checkpoints go through the one converter (`tools/checkpoint/convert.py`), the family detected from the
folder: diffusers -> Megatron distributed checkpoint -> diffusers is byte-exact, the checkpoint records the
family, and a Wan variant this family does not build (image-to-video) is refused by name with exit status 2,
nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from model_providers.wan import provider
from tests.unit.test_checkpoint_convert import assert_round_trip_byte_exact, random_model
from tools.checkpoint.convert import main


def write_wan_folder(folder: Path, config: dict, seed: int = 0, dtype: torch.dtype = torch.float32) -> Path:
    """A diffusers Wan transformer folder with random non-zero weights, sharded (written by diffusers)."""
    random_model(WanTransformer3DModel, config, seed, dtype).save_pretrained(folder, max_shard_size="100KB")
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_round_trip_is_byte_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    src = write_wan_folder(tmp_path / "hf", provider.hf_config("tiny"), dtype=dtype)
    assert_round_trip_byte_exact(src, tmp_path, "wan", "WanTransformer3DModel", provider.hf_config)


def test_an_image_to_video_wan_is_refused_by_name(tmp_path: Path, capsys) -> None:
    src = write_wan_folder(tmp_path / "i2v", dict(provider.hf_config("tiny"), image_dim=8, added_kv_proj_dim=64))
    assert main(["hf-to-mcore", str(src), str(tmp_path / "mcore"), "--no-progress"]) == 2
    assert "image_dim" in capsys.readouterr().err
    assert not (tmp_path / "mcore").exists()
