"""PixelShuffleVAE: an exact grayscale space-to-depth map that a diffusers QwenImagePipeline saves, loads and
decodes with, as it does AutoencoderKLQwenImage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model_providers.ocr_miniature.pixel_vae import PixelShuffleVAE


def _gray_images(n: int, size: int = 64) -> torch.Tensor:
    """[n, 3, 1, size, size] in [-1, 1], equal RGB channels, values exact in binary (k / 8)."""
    g = torch.Generator().manual_seed(0)
    gray = torch.randint(-8, 9, (n, 1, 1, size, size), generator=g).float() / 8
    return gray.expand(-1, 3, -1, -1, -1).contiguous()


def test_encode_is_space_to_depth_and_decode_inverts_it_exactly() -> None:
    vae = PixelShuffleVAE(scale=4, z_dim=16)
    x = _gray_images(2)
    z = vae.encode(x).latent_dist.mode()
    assert z.shape == (2, 16, 1, 16, 16)
    # channel c of latent position (i, j) is pixel (4 i + c // 4, 4 j + c % 4)
    assert torch.equal(z[:, 5, 0, 3, 7], x[:, 0, 0, 4 * 3 + 1, 4 * 7 + 1])
    assert torch.equal(vae.decode(z).sample, x)
    assert torch.equal(vae.decode(z, return_dict=False)[0], x)


def test_colour_becomes_its_gray_mean() -> None:
    vae = PixelShuffleVAE()
    x = torch.zeros(1, 3, 1, 8, 8)
    x[:, 0], x[:, 1], x[:, 2] = 0.75, -0.25, 0.0
    out = vae.decode(vae.encode(x).latent_dist.sample()).sample
    assert torch.allclose(out, torch.full_like(out, 0.5 / 3), atol=1e-7)
    assert vae.decode(torch.full((1, 16, 1, 2, 2), 3.0)).sample.max() == 1.0  # clamped like Qwen-Image's decoder


@pytest.mark.parametrize("kwargs, message", [
    ({"scale": 3, "z_dim": 9}, "power of 2"),
    ({"scale": 4, "z_dim": 12}, r"z_dim must be scale \*\* 2 = 16, got 12"),
    ({"latents_mean": [0.0] * 4}, "latents_mean has 4 values"),
])
def test_bad_configs_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PixelShuffleVAE(**kwargs)


def test_bad_shapes_are_refused() -> None:
    vae = PixelShuffleVAE()
    with pytest.raises(ValueError, match="not a multiple of the scale"):
        vae.encode(torch.zeros(1, 3, 1, 30, 32))
    with pytest.raises(ValueError, match=r"expected images \[N, 3, 1, H, W\]"):
        vae.encode(torch.zeros(1, 3, 32, 32))
    with pytest.raises(ValueError, match=r"expected latents \[N, 16"):
        vae.decode(torch.zeros(1, 8, 1, 4, 4))


def test_a_pipeline_folder_with_it_loads_and_decodes_through_the_vae(tmp_path: Path) -> None:
    from diffusers import QwenImagePipeline

    from model_providers.ocr_miniature.text_miniature import MINIATURE
    from model_providers.qwen_image.tiny_pipeline import build_components, save_pipeline_atomically

    components = build_components(MINIATURE, seed=0)
    components["vae"] = PixelShuffleVAE(latents_mean=[0.25] * 16, latents_std=[0.5] * 16)
    save_pipeline_atomically(QwenImagePipeline(**components), tmp_path / "p")
    index = json.loads((tmp_path / "p" / "model_index.json").read_text())
    assert index["vae"] == ["model_providers.ocr_miniature.pixel_vae", "PixelShuffleVAE"]

    pipe = QwenImagePipeline.from_pretrained(tmp_path / "p", local_files_only=True)
    assert isinstance(pipe.vae, PixelShuffleVAE) and pipe.vae_scale_factor == 4
    assert pipe.vae.config.latents_mean == [0.25] * 16 and pipe.vae.config.latents_std == [0.5] * 16
    # The pipeline's own decode path (unpack, de-normalise, decode) maps packed latents to pixels exactly.
    x = _gray_images(1)
    z = (pipe.vae.encode(x).latent_dist.mode() - 0.25) / 0.5
    packed = QwenImagePipeline._pack_latents(z[:, :, 0], 1, 16, 16, 16)
    unpacked = pipe._unpack_latents(packed, 64, 64, pipe.vae_scale_factor)
    image = pipe.vae.decode(unpacked * 0.5 + 0.25).sample
    assert torch.equal(image, x)
    assert torch.equal(F.pixel_unshuffle(x[:, :1, 0], 4), pipe.vae.encode(x).latent_dist.mode()[:, :, 0])


def test_the_vllm_omni_pipeline_refuses_a_folder_whose_vae_it_cannot_load(tmp_path: Path) -> None:
    from megatron_omni.rollout.vllm_omni.pipeline import require_qwen_image_vae

    index = {"_class_name": "QwenImagePipeline", "vae": ["diffusers", "AutoencoderKLQwenImage"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    require_qwen_image_vae(str(tmp_path))
    index["vae"] = ["model_providers.ocr_miniature.pixel_vae", "PixelShuffleVAE"]
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="PixelShuffleVAE, but vLLM-Omni's Qwen-Image pipeline loads only"):
        require_qwen_image_vae(str(tmp_path))
