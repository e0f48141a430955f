"""The planner's FLUX.1 cost model (`planner.arch.flux_arch`): per-rank parameters equal the provider's exact count
(and, at tp 2, a hand count of what each rank holds: every single-block linear column-parallel), the FLOPs of one
forward equal a hand count from the published shapes (19 double blocks whose last keeps its text stream, 38 single
blocks over [text; image], the guidance embedder), and pipeline stages split all blocks in model order."""

from __future__ import annotations

import math

import pytest

from megatron_omni.parallel.layout import LayoutError
from megatron_omni.planner.arch import arch_of, dit_arch
from megatron_omni.planner.flops import forward_flops
from megatron_omni.planner.memory import rank_buffer_counts, rank_parameter_counts
from model_providers.flux import provider


@pytest.mark.parametrize("name", ["tiny", "flux1-dev"])
def test_parameters_equal_the_provider(name: str) -> None:
    a = dit_arch("flux", name)
    assert (a.family, a.blocks) == ("flux", provider.hf_config(name)["num_layers"]
                                    + provider.hf_config(name)["num_single_layers"])
    assert rank_parameter_counts(a, 1) == [provider.parameter_count(name)]
    assert rank_buffer_counts(a) == [0]


def test_flux1_dev_counts_and_flops_by_hand() -> None:
    assert arch_of("flux1-dev").family == "flux"
    assert provider.parameter_count("flux1-dev") == 11_901_408_320  # diffusers' FLUX.1-dev transformer
    h, d, double, single = 3072, 128, 19, 38
    # tp 2: double blocks split adaLN, QKV, fc1 (rows, bias too), proj and fc2 (weight columns); single blocks
    # split every linear by rows; QK norms, row-parallel biases and the embedders stay whole.
    stream_split = 6 * h * (h + 1) + 3 * h * (h + 1) + 4 * h * (h + 1) + h * h + 4 * h * h
    stream_whole = 2 * d + 2 * h
    single_split = 3 * h * (h + 1) + 3 * h * (h + 1) + 4 * h * (h + 1) + h * (5 * h + 1)
    outer = provider.parameter_count("flux1-dev") - double * 2 * (stream_split + stream_whole) - single * (
        single_split + 2 * d)
    want = double * 2 * (stream_split // 2 + stream_whole) + single * (single_split // 2 + 2 * d) + outer
    assert rank_parameter_counts("flux1-dev", 2) == [want]

    s_i, s_t = 1024, 512
    s = s_i + s_t
    f = forward_flops("flux1-dev", s_i, s_t)
    block = 2 * (3 * h * h + h * h + 8 * h * h)  # qkv, out, fc1 + fc2 per token and stream
    single_block = 2 * (3 * h * h + 4 * h * h + 5 * h * h)  # qkv, MLP in, out over [attn | mlp]
    linear = double * block * (s_i + s_t) + single * single_block * s + 2 * 64 * h * s_i * 2 + 2 * 4096 * h * s_t
    assert f.image_linear + f.text_linear == pytest.approx(linear, rel=1e-12)
    assert f.attention == 4.0 * s * s * h * (double + single)
    assert f.qkv_linear == 2 * 3 * h * h * (double * s + single * s)
    per_sample = 2 * (3 * (256 * h + h * h) - 256 * h + 768 * h + 2 * h * h) + 2 * h * h * (
        12 * double + 3 * single)  # time, guidance, pooled embedders, norm_out; adaLN
    assert f.per_sample == per_sample


def test_cp_and_pp_plan_blocks_in_model_order() -> None:
    """CP and PP are planned (the model has both); stages split all 57 blocks of FLUX.1-dev in model order: at pp 3
    the first holds the 19 double blocks (and the input embedders), the others 19 single blocks each (and the last
    the output layers), every stage the time, guidance and pooled embedders; pp 2 does not divide 57."""
    a = arch_of("flux1-dev")
    a.check_layout(2, 2, 3, "full")
    with pytest.raises(LayoutError, match="no 'selective' recompute"):
        a.check_layout(1, 1, 1, "selective")
    shapes = provider.megatron_shapes("flux1-dev")

    def total(prefixes: tuple[str, ...]) -> int:
        return sum(math.prod(v) for k, v in shapes.items() if k.startswith(prefixes))

    embedders = total(("time_embedder.", "guidance_embedder.", "pooled_embedder."))
    singles = [total(tuple(f"single_layers.{i}." for i in range(k, k + 19))) for k in (0, 19)]
    assert rank_parameter_counts(a, 1, 3) == [
        embedders + total(("x_embedder.", "context_embedder.", "layers.")), embedders + singles[0],
        embedders + singles[1] + total(("norm_out.", "proj_out."))]
    with pytest.raises(ValueError, match="57 blocks are not divisible by pp=2"):
        rank_parameter_counts(a, 1, 2)


def test_image_tokens_count_packed_latents() -> None:
    """FLUX packs 2 x 2 latents (8x VAE) into one token: a 720 x 720 image is 45 x 45 tokens, 1024 x 1024 4096."""
    from megatron_omni.planner.flops import image_tokens

    assert (image_tokens("flux1-dev", 720, 720), image_tokens("flux1-dev", 1024, 1024)) == (2025, 4096)
