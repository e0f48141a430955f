"""The AR decoder's rollout layout in vLLM (`vllm.model_executor.models.qwen2`): names and per-rank layouts.

vLLM fuses q/k/v into `self_attn.qkv_proj` (QKVParallelLinear: tp rank r holds `[q_r; k_r; v_r]`, each the
r-th row block of q, k, v) and gate/up into `mlp.gate_up_proj` (MergedColumnParallelLinear: `[gate_r; up_r]`);
`o_proj`/`down_proj` are row-parallel, the embedding and `lm_head` vocab-parallel, norms replicated. With
equal tp on both sides a Megatron shard becomes the vLLM shard by a local permutation (qkv: Megatron's
per-query-group interleave -> q, k, v blocks; everything else is already identical), no communication.

Vocabulary: vLLM pads `embed_tokens`/`lm_head` to V_pad = V rounded up to a multiple of 64 (over the whole
vocabulary, before splitting), rank r holds rows [r*V_pad/tp, (r+1)*V_pad/tp) of the padded table, real rows
first and zeros after. At tp=1 the Megatron tensor is padded with zero rows here. At tp>1 with V != V_pad the
ranks' row ranges differ from Megatron's (V/tp rows each), so a shard alone cannot give vLLM's: use
`vllm_vocab_shard` on the gathered full table.

Verified against vLLM 0.30.0's live `Qwen2ForCausalLM` on CPU at tp=1 (tests/unit/test_ar_dit_vllm_mapping.py):
parameter names and shapes, and every parameter bit-equal to vLLM's own `load_weights` of the same Qwen2
weights, with a vocabulary vLLM pads; and in a live `vllm.LLM` engine (tests/distributed/
test_ar_dit_vllm_plans.py), where tensors from `vllm_state_dict` make vLLM's log-probs equal our Megatron
decoder's. The tp>1 vocabulary split is checked against vLLM's shard-index function, not a live tp>1 module.
"""

from __future__ import annotations

import torch

from model_providers.ar_dit.decoder_mapping import DecoderMapping, all_decoder_mappings, split_gqa_qkv

_FUSED = {"fuse_qkv": ("q_proj", "qkv_proj"), "fuse_gate_up": ("gate_proj", "gate_up_proj")}
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
VLLM_VOCAB_PADDING = 64  # vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


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


def is_vocab_parallel(mapping: DecoderMapping) -> bool:
    """Whether the tensor is vocab-parallel (embedding table or output layer), which vLLM pads."""
    return mapping.megatron in _VOCAB


def vllm_padded_vocab(vocab_size: int) -> int:
    """vLLM's padded vocabulary (rows of `embed_tokens`/`lm_head` over all tp ranks)."""
    return -(-vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING


def vllm_vocab_shard(full: torch.Tensor, tp_rank: int, tp_size: int) -> torch.Tensor:
    """vLLM rank `tp_rank`'s padded vocab shard [V_pad/tp, h] from the full table `full` [V, h]."""
    vocab = full.shape[0]
    per = vllm_padded_vocab(vocab) // tp_size
    if per * tp_size != vllm_padded_vocab(vocab):
        raise ValueError(f"padded vocabulary {vllm_padded_vocab(vocab)} does not split over tp={tp_size}")
    start = min(tp_rank * per, vocab)
    rows = full[start:min(start + per, vocab)]
    return torch.cat([rows, rows.new_zeros(per - rows.shape[0], *rows.shape[1:])], dim=0)


def megatron_shard_to_vllm(mapping: DecoderMapping, shard: torch.Tensor, num_heads: int, num_groups: int,
                           tp_size: int) -> torch.Tensor:
    """One tp rank's Megatron tensor -> the same rank's vLLM tensor (equal tp on both sides).

    Vocab-parallel tensors ([V/tp, h]) come back padded to vLLM's [V_pad/tp, h]; at tp>1 this needs V to be a
    multiple of 64 (otherwise the ranks' row ranges differ; use `vllm_vocab_shard` on the full table).
    """
    if mapping.kind == "fuse_qkv":
        q, k, v = split_gqa_qkv(shard, num_heads // tp_size, num_groups // tp_size)
        return torch.cat([q, k, v], dim=0)
    if is_vocab_parallel(mapping):
        vocab = shard.shape[0] * tp_size
        if tp_size == 1 or vllm_padded_vocab(vocab) == vocab:
            return vllm_vocab_shard(shard, 0, 1)
        raise ValueError(f"{mapping.megatron}: vocabulary {vocab} is padded by vLLM to {vllm_padded_vocab(vocab)}, "
                         f"so its tp={tp_size} shards hold other rows than Megatron's; gather the table and use "
                         "vllm_vocab_shard")
    return shard


def vllm_state_dict(model, num_heads: int, num_groups: int, tp_size: int) -> dict[str, torch.Tensor]:
    """This tp rank's tensors of a Megatron `ARDecoder` (split over `tp_size` ranks) in vLLM's names and layout
    at the same tp size; the tensors of the pipeline stage the model holds. Copies; the model is untouched."""
    from model_providers.ar_dit.decoder_provider import local_mappings

    state = model.state_dict()
    return {vllm_name(m): megatron_shard_to_vllm(m, state[name].detach(), num_heads, num_groups, tp_size).clone()
            for name, m in local_mappings(model).items()}
