"""The AR decoder's rollout layout in vLLM (`vllm.model_executor.models.qwen2`): names and per-rank layouts.

vLLM fuses q/k/v into `self_attn.qkv_proj` (QKVParallelLinear: tp rank r holds `[q_r; k_r; v_r]`, each the
r-th row block of q, k, v) and gate/up into `mlp.gate_up_proj` (MergedColumnParallelLinear: `[gate_r; up_r]`);
`o_proj`/`down_proj` are row-parallel, the embedding and `lm_head` vocab-parallel, norms replicated. With
equal tp on both sides a Megatron shard becomes the vLLM shard by a local permutation (qkv: Megatron's
per-query-group interleave -> q, k, v blocks; everything else is already identical), no communication.

Not yet verified against a live vLLM module on CPU (only the layouts, against our Qwen2 mapping); vLLM pads
the vocabulary of `embed_tokens`/`lm_head` to a multiple of 64 per rank, which the sync must pad for.
"""

from __future__ import annotations

import torch

from model_providers.ar_dit.decoder_mapping import DecoderMapping, all_decoder_mappings, split_gqa_qkv

_FUSED = {"fuse_qkv": ("q_proj", "qkv_proj"), "fuse_gate_up": ("gate_proj", "gate_up_proj")}


def vllm_name(mapping: DecoderMapping) -> str:
    """The vLLM Qwen2 parameter a Megatron decoder tensor maps to (full Qwen2 names, fused where vLLM fuses)."""
    first = mapping.hf[0]
    if mapping.kind in _FUSED:
        old, new = _FUSED[mapping.kind]
        return first.replace(old, new)
    return first


def vllm_names(num_layers: int, tie_word_embeddings: bool = False) -> list[str]:
    """Every vLLM parameter name of a decoder with `num_layers` layers."""
    return [vllm_name(m) for m in all_decoder_mappings(num_layers, tie_word_embeddings)]


def megatron_shard_to_vllm(mapping: DecoderMapping, shard: torch.Tensor, num_heads: int, num_groups: int,
                           tp_size: int) -> torch.Tensor:
    """One tp rank's Megatron tensor -> the same rank's vLLM tensor (equal tp on both sides)."""
    if mapping.kind == "fuse_qkv":
        q, k, v = split_gqa_qkv(shard, num_heads // tp_size, num_groups // tp_size)
        return torch.cat([q, k, v], dim=0)
    return shard
