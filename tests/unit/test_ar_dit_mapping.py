"""AR decoder name/layout mapping (Qwen2 <-> Megatron GQA/SwiGLU layouts, TP shards), configs and presets."""

from __future__ import annotations

import pytest
import torch

from model_providers.ar_dit import decoder_mapping as dm
from model_providers.ar_dit import decoder_provider, provider


def _qkv(n: int, g: int, d: int, h: int):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(n * d, h, generator=gen), torch.randn(g * d, h, generator=gen),
            torch.randn(g * d, h, generator=gen))


def test_gqa_fuse_layout_and_round_trip() -> None:
    n, g, d, h = 4, 2, 3, 5
    q, k, v = _qkv(n, g, d, h)
    fused = dm.fuse_gqa_qkv(q, k, v, n, g)
    assert fused.shape == ((n + 2 * g) * d, h)
    # Megatron's order: per query group, its n/g query heads, then its k head, then its v head.
    block = (n // g + 2) * d
    assert torch.equal(fused[:2 * d], q[:2 * d]) and torch.equal(fused[2 * d:3 * d], k[:d])
    assert torch.equal(fused[3 * d:block], v[:d]) and torch.equal(fused[block:block + 2 * d], q[2 * d:])
    assert all(torch.equal(a, b) for a, b in zip(dm.split_gqa_qkv(fused, n, g), (q, k, v)))


@pytest.mark.parametrize("tp", [1, 2])
def test_shards_round_trip_for_every_kind(tp: int) -> None:
    n, g, d, h, ffn = 4, 2, 3, 6, 8
    gen = torch.Generator().manual_seed(1)
    for m in dm.layer_mappings(0) + dm.all_decoder_mappings(0):
        if m.kind == "fuse_qkv":
            hf = list(_qkv(n, g, d, h)) if m.megatron.endswith("weight") else [t[:, 0] for t in _qkv(n, g, d, h)]
        elif m.kind == "fuse_gate_up":
            hf = [torch.randn(ffn, h, generator=gen), torch.randn(ffn, h, generator=gen)]
        else:
            hf = [torch.randn(h, h, generator=gen)]
        shards = [dm.hf_to_megatron_shard(m, hf, n, g, r, tp) for r in range(tp)]
        if m.tp_dim is None:
            assert all(torch.equal(s, hf[0]) for s in shards)
        back = dm.megatron_shards_to_hf(m, shards, n, g)
        assert len(back) == len(hf) and all(torch.equal(a, b) for a, b in zip(back, hf)), m.megatron


def test_swiglu_shard_is_gate_and_up_of_the_rank() -> None:
    gate, up = torch.arange(8.0).view(8, 1), torch.arange(100.0, 108.0).view(8, 1)
    m = next(x for x in dm.layer_mappings(0) if x.kind == "fuse_gate_up")
    shard1 = dm.hf_to_megatron_shard(m, [gate, up], 4, 2, 1, 2)
    assert shard1.flatten().tolist() == [4, 5, 6, 7, 104, 105, 106, 107]


def test_qkv_shard_holds_whole_query_groups() -> None:
    n, g, d, h = 4, 2, 3, 5
    q, k, v = _qkv(n, g, d, h)
    m = next(x for x in dm.layer_mappings(0) if x.megatron.endswith("linear_qkv.weight"))
    shard = dm.hf_to_megatron_shard(m, [q, k, v], n, g, 1, 2)
    assert torch.equal(shard, dm.fuse_gqa_qkv(q[2 * d:], k[d:], v[d:], 2, 1))
    with pytest.raises(ValueError, match="query groups"):
        dm.hf_to_megatron_shard(m, [q, k, v], n, g, 0, 4)


def test_mapping_covers_qwen2_names_exactly() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = decoder_provider.qwen2_config("tiny")
    with torch.device("meta"):
        names = set(Qwen2ForCausalLM(Qwen2Config(**c)).state_dict())
    mapped = [n for m in dm.all_decoder_mappings(c["num_hidden_layers"]) for n in m.hf]
    assert len(mapped) == len(set(mapped)) and set(mapped) == names


def test_presets_parameter_counts_match_the_reference_modules() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    counts = provider.megatron_shapes("7b+20b")
    with torch.device("meta"):
        hf = Qwen2ForCausalLM(Qwen2Config(**decoder_provider.qwen2_config("7b")))
    assert counts["decoder"] == sum(p.numel() for p in hf.parameters()) == 7_615_616_512
    assert counts["dit"] == 20_430_401_088
    assert counts["connector"] == 3584 + 3584 * 3584 + 3584
    tiny = provider.torch_hybrid("tiny")
    assert provider.megatron_shapes("tiny")["total"] == sum(
        p.numel() for m in (tiny.decoder, tiny.connector, tiny.dit) for p in m.parameters())


def test_bad_configs_name_the_problem() -> None:
    with pytest.raises(ValueError, match="sliding-window"):
        decoder_provider.qwen2_config({**decoder_provider.qwen2_config("tiny"), "use_sliding_window": True})
    with pytest.raises(ValueError, match="lacks"):
        decoder_provider.qwen2_config({"hidden_size": 8})
    with pytest.raises(KeyError, match="unknown AR-DiT preset"):
        provider.hybrid_config("3b+20b")
    with pytest.raises(ValueError, match="eos_token_id"):
        provider.hybrid_config({"decoder": "tiny", "dit": "tiny", "eos_token_id": 999, "pad_token_id": 0})
    with pytest.raises(ValueError, match="query groups"):
        decoder_provider.transformer_config("tiny", tp=4)


@pytest.mark.parametrize("tp", [1, 2])
def test_vllm_layout_is_a_local_permutation_of_the_megatron_shard(tp: int) -> None:
    from model_providers.ar_dit import vllm_mapping as vm

    n, g, d, h, ffn = 4, 2, 3, 6, 8
    gen = torch.Generator().manual_seed(2)
    q, k, v = _qkv(n, g, d, h)
    gate, up = torch.randn(ffn, h, generator=gen), torch.randn(ffn, h, generator=gen)
    for m in dm.layer_mappings(3):
        if m.kind == "copy":
            continue
        hf = [q, k, v] if m.kind == "fuse_qkv" else [gate, up]
        if m.megatron.endswith("bias"):
            hf = [t[:, 0] for t in hf]
        for r in range(tp):
            got = vm.megatron_shard_to_vllm(m, dm.hf_to_megatron_shard(m, hf, n, g, r, tp), n, g, tp)
            # vLLM's fused parallel linears: rank r holds the r-th row block of each part, parts stacked.
            want = torch.cat([t.chunk(tp, 0)[r] for t in hf], 0)
            assert torch.equal(got, want), (m.megatron, r)
    names = vm.vllm_names(2)
    assert "model.layers.1.self_attn.qkv_proj.weight" in names and "model.layers.1.mlp.gate_up_proj.weight" in names
    assert len(names) == len(set(names))
