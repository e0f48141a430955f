"""The planner's SD3.5 cost model (`planner.arch.sd3_arch`): per-rank parameters equal the provider's exact count,
the FLOPs of one forward equal a hand count from the published shapes (dual attention, pooled embedder, the
patch convolution), and the text encoders' and VAE's parameter counts equal their classes built on the meta
device from the published configs. The allocated-bytes and saved-activation checks are in
tests/distributed/test_planner_memory_allocated.py."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.planner.arch import (
    SD3_CLIP_G_PARAMS,
    SD3_CLIP_L_PARAMS,
    SD3_T5_XXL_PARAMS,
    SD3_VAE_PARAMS,
    arch_of,
    edit_tokens,
)
from megatron_omni.planner.flops import forward_flops
from megatron_omni.planner.memory import rank_buffer_counts, rank_parameter_counts
from model_providers.sd3 import provider


@pytest.mark.parametrize("name", ["sd35-medium", "sd35-large"])
def test_parameters_equal_the_provider(name: str) -> None:
    assert arch_of(name).family == "sd3"
    assert rank_parameter_counts(name, 1) == [provider.parameter_count(name)]
    cfg = provider.hf_config(name)
    assert rank_buffer_counts(name) == [cfg["pos_embed_max_size"] ** 2 * cfg["num_attention_heads"] * 64]
    # at tp=2 the split linears halve; the rest (norms, biases of row-parallel layers, embedders) stays
    assert rank_parameter_counts(name, 2)[0] < provider.parameter_count(name) * 0.51 + 60e6


def test_sd35_medium_forward_flops_equal_a_hand_count() -> None:
    h, s_i, s_t, layers, dual = 1536, 1024, 205, 24, 13
    f = forward_flops("sd35-medium", s_i, s_t)
    block = 2 * (3 * h * h + h * h + 8 * h * h)  # qkv, out, fc1 + fc2 per token
    image = layers * block * s_i + dual * 2 * 4 * h * h * s_i + 2 * h * 64 * s_i + 2 * 64 * h * s_i  # attn2, conv, out
    text = (layers - 1) * block * s_t + 2 * 3 * h * h * s_t + 2 * h * 4096 * s_t  # the last block: qkv only
    linear = image + text
    assert f.image_linear + f.text_linear == pytest.approx(linear, rel=1e-12)
    s = s_i + s_t
    assert f.attention == 4.0 * s * s * h * layers + 4.0 * s_i * s_i * h * dual
    per_sample = 2 * (256 * h + h * h + 2048 * h + h * h + 2 * h * h) + 2 * h * h * (
        6 * (layers - 1) + 2 + 9 * dual + 6 * (layers - dual))  # embedders, norm_out; adaLN of img and txt
    assert f.per_sample == per_sample


@pytest.mark.slow  # builds T5-XXL on the meta device (tens of seconds on a loaded machine)
def test_text_encoder_and_vae_counts_equal_their_classes() -> None:
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    def n(m: torch.nn.Module) -> int:
        return sum(p.numel() for p in m.parameters())

    with torch.device("meta"):
        clip_l = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=768, intermediate_size=3072,
                                                           num_hidden_layers=12, num_attention_heads=12,
                                                           projection_dim=768))
        clip_g = CLIPTextModelWithProjection(CLIPTextConfig(hidden_size=1280, intermediate_size=5120,
                                                           num_hidden_layers=32, num_attention_heads=20,
                                                           projection_dim=1280, hidden_act="gelu"))
        t5 = T5EncoderModel(T5Config(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24,
                                     vocab_size=32128, feed_forward_proj="gated-gelu"))
        vae = AutoencoderKL(down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                            block_out_channels=[128, 256, 512, 512], layers_per_block=2, latent_channels=16,
                            use_quant_conv=False, use_post_quant_conv=False)
    assert (n(clip_l), n(clip_g), n(t5), n(vae)) == (SD3_CLIP_L_PARAMS, SD3_CLIP_G_PARAMS, SD3_T5_XXL_PARAMS,
                                                     SD3_VAE_PARAMS)


def test_edit_source_tokens() -> None:
    """diffusers' areas on a 512 x 512 edit: the source's latents at 1024 x 1024 (64 x 64 tokens), its VL view at
    384 -> 392 x 392 (28 x 28 patches, 196 merged tokens)."""
    t = edit_tokens(512, 512, 384 * 384, 1024 * 1024)
    assert (t.condition, t.patches, t.vision) == (4096, 784, 196)


def test_only_qwen_image_plans_print_a_ratio_to_the_qwen_image_reference() -> None:
    """VeRL-Omni's 0.510 images/s/GPU is Qwen-Image 20B's: an SD3.5 or FLUX plan names it without a ratio."""
    from megatron_omni.parallel.layout import ParallelLayout
    from megatron_omni.planner import plan

    qwen = plan("20b", ParallelLayout(tp=2), 8, "H200").table().splitlines()[-1]
    assert qwen.startswith("reference (VeRL-Omni") and "predicted/reference = " in qwen
    for family, preset in (("sd3", "sd35-medium"), ("flux", "flux1-dev")):
        report = plan(arch_of(preset), ParallelLayout(tp=4), 8, "H200")
        line = report.table().splitlines()[-1]
        assert report.family == family
        assert line.startswith("reference (VeRL-Omni") and "predicted/reference" not in line, line
        assert f"no published per-GPU throughput for {family}" in line
