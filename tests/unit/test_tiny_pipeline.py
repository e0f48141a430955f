"""tools/make_tiny_pipeline.py writes a loadable, deterministic, small Qwen-Image pipeline folder."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline

from model_providers.qwen_image.tiny_pipeline import SPECIAL_TOKENS, make_tiny_pipeline


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*.safetensors"))
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "pipe", seed=0)


def test_loads_offline_and_generates(tiny: Path) -> None:
    pipe = QwenImagePipeline.from_pretrained(tiny, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        "a red cat",
        negative_prompt=" ",
        true_cfg_scale=4.0,
        height=64,
        width=64,
        num_inference_steps=3,
        generator=torch.Generator().manual_seed(0),
        output_type="pt",
    ).images
    assert out.shape == (1, 3, 64, 64) and torch.isfinite(out).all()
    assert float(out.std()) > 0
    cfg = pipe.transformer.config
    heads = cfg.num_attention_heads
    assert heads % 2 == 0 and heads % 4 == 0
    assert cfg.attention_head_dim == sum(cfg.axes_dims_rope)
    size = sum(f.stat().st_size for f in tiny.rglob("*") if f.is_file())
    assert size < 5e6, size


def test_byte_level_tokenizer(tiny: Path) -> None:
    pipe = QwenImagePipeline.from_pretrained(tiny, local_files_only=True)
    tok = pipe.tokenizer
    text = "<|im_start|>user\nzwölf 12 ✓<|im_end|>"
    ids = tok(text).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")
    assert all(i < 256 for i in ids[1:-1])  # bytes only, no merges
    assert len(ids) - 2 == len("user\nzwölf 12 ✓".encode())
    assert tok.decode(ids) == text
    assert len(tok) == 256 + len(SPECIAL_TOKENS)


def test_deterministic_from_seed(tmp_path: Path, tiny: Path) -> None:
    again = make_tiny_pipeline(tmp_path / "again", seed=0)
    other = make_tiny_pipeline(tmp_path / "other", seed=1)
    assert _digest(again) == _digest(tiny)
    assert (
        _digest(other)["transformer/diffusion_pytorch_model.safetensors"]
        != _digest(tiny)["transformer/diffusion_pytorch_model.safetensors"]
    )
    with pytest.raises(FileExistsError):
        make_tiny_pipeline(tmp_path / "again", seed=0)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left behind
