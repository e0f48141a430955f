"""Qwen-Image provider: exact parameter counts, the name mapping's round trip, and TP=1 parity."""

from __future__ import annotations

import torch
from diffusers import QwenImageTransformer2DModel

from model_providers.qwen_image import provider
from model_providers.qwen_image.mapping import all_mappings, fuse_qkv, split_qkv
from model_providers.qwen_image.presets import PARAMS_20B


def test_20b_parameter_count_is_exact() -> None:
    assert provider.parameter_count("20b") == PARAMS_20B == 20_430_401_088


def test_counts_match_diffusers_modules() -> None:
    for name in ("tiny", "small"):
        ref = QwenImageTransformer2DModel(**provider.hf_config(name))
        assert provider.parameter_count(name) == sum(p.numel() for p in ref.parameters()), name
    with torch.device("meta"):
        ref = QwenImageTransformer2DModel(**provider.hf_config("20b"))
    assert sum(p.numel() for p in ref.parameters()) == PARAMS_20B


def test_per_rank_counts_20b() -> None:
    counts = {tp: provider.per_rank_parameter_counts("20b", tp) for tp in (1, 2, 4, 8)}
    assert counts[1] == [PARAMS_20B]
    # per rank = split / tp + replicated (non-block layers, QK norms, row-parallel biases: about 1.4%).
    split = 2 * (counts[1][0] - counts[2][0])
    replicated = counts[1][0] - split
    assert 0 < replicated < 0.015 * PARAMS_20B
    for tp in (2, 4, 8):
        assert counts[tp][0] == split // tp + replicated, (tp, counts[tp])
    # Pipeline stages: blocks split evenly; the timestep embedder is on every stage.
    stages = provider.per_rank_parameter_counts("20b", 8, pp=4)
    assert len(stages) == 4 and abs(sum(stages) - counts[8][0]) < 4 * 20_000_000
    print({tp: f"{c[0] / 1e9:.3f}B" for tp, c in counts.items()})


def test_mapping_covers_every_diffusers_tensor_once() -> None:
    ref = QwenImageTransformer2DModel(**provider.hf_config("tiny"))
    hf_names = [n for m in all_mappings(2) for n in m.hf]
    assert sorted(hf_names) == sorted(ref.state_dict())


def test_qkv_fusion_round_trip() -> None:
    q, k, v = (torch.randn(4 * 16, 64) for _ in range(3))
    fused = fuse_qkv(q, k, v, num_heads=4)
    # Head 1's rows in the fused layout are [q_1; k_1; v_1].
    assert torch.equal(fused[48:64], q[16:32]) and torch.equal(fused[64:80], k[16:32])
    for a, b in zip(split_qkv(fused, 4), (q, k, v)):
        assert torch.equal(a, b)
