"""Weight-name mapping between the Megatron-Core GPT decoder and Hugging Face's Qwen2 layout, as data plus
pure tensor functions (the provider, the checkpoint converter and the vLLM layout read it).

Megatron names are those of `GPTModel` with the local spec and global layer indices. Kinds:

- `copy`: one tensor, same layout;
- `fuse_qkv`: Qwen2's q/k/v (`[n*d, ...]`, `[g*d, ...]`, `[g*d, ...]`, n heads in g query groups) ->
  Megatron's GQA interleave, per query group `[q heads of the group (n/g*d) | k (d) | v (d)]`. A
  tensor-parallel rank holds g/tp whole groups, so its shard is a contiguous row block of the fused tensor;
- `fuse_gate_up`: Qwen2's gate/up projections -> `linear_fc1`. SwiGLU under tensor parallelism keeps
  `[gate_r; up_r]` on each rank r, so the TP=1 tensor `[gate; up]` is NOT chunked contiguously: shards are
  built per rank from the Qwen2 tensors.

`tp_dim`: 0 for column-parallel rows (and the vocab-parallel embedding), 1 for row-parallel weights, None
for replicated tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecoderMapping:
    """One Megatron decoder tensor and the Qwen2 tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # "copy" | "fuse_qkv" | "fuse_gate_up"
    tp_dim: int | None
    layer: int | None  # global layer index, None for embeddings/final norm/head
    stage: str  # "pre" (first pipeline stage), "block", "post" (last stage)


def layer_mappings(layer: int, hf_root: str = "model.", meg_suffix: str = "",
                   hf_suffix: str = "") -> list[DecoderMapping]:
    """The mappings of decoder layer `layer` (0-based, global).

    hf_root: the prefix of the Qwen2 model's names (BAGEL's LLM: `language_model.model.`); meg_suffix, hf_suffix:
    one expert's suffix on each Megatron module and each Qwen2 module (BAGEL's generation expert: `_gen` and
    `_moe_gen`, as in `q_proj_moe_gen.weight` and `mlp_moe_gen.gate_proj.weight`); empty for a plain decoder.
    """
    s, g = meg_suffix, hf_suffix
    m, h = f"decoder.layers.{layer}.", f"{hf_root}layers.{layer}."
    attn, mlp = f"{h}self_attn.", f"{h}mlp{g}."
    out = [
        DecoderMapping(f"{m}input_layernorm{s}.weight", (f"{h}input_layernorm{g}.weight",), "copy", None, layer,
                       "block"),
        DecoderMapping(f"{m}self_attention.linear_qkv{s}.weight",
                       (f"{attn}q_proj{g}.weight", f"{attn}k_proj{g}.weight", f"{attn}v_proj{g}.weight"),
                       "fuse_qkv", 0, layer, "block"),
        DecoderMapping(f"{m}self_attention.linear_qkv{s}.bias",
                       (f"{attn}q_proj{g}.bias", f"{attn}k_proj{g}.bias", f"{attn}v_proj{g}.bias"),
                       "fuse_qkv", 0, layer, "block"),
        DecoderMapping(f"{m}self_attention.linear_proj{s}.weight", (f"{attn}o_proj{g}.weight",), "copy", 1, layer,
                       "block"),
        DecoderMapping(f"{m}pre_mlp_layernorm{s}.weight", (f"{h}post_attention_layernorm{g}.weight",), "copy", None,
                       layer, "block"),
        DecoderMapping(f"{m}mlp{s}.linear_fc1.weight", (f"{mlp}gate_proj.weight", f"{mlp}up_proj.weight"),
                       "fuse_gate_up", 0, layer, "block"),
        DecoderMapping(f"{m}mlp{s}.linear_fc2.weight", (f"{mlp}down_proj.weight",), "copy", 1, layer, "block"),
    ]
    return out


def all_decoder_mappings(num_layers: int, tie_word_embeddings: bool = False) -> list[DecoderMapping]:
    """Every tensor of a decoder with `num_layers` layers, in a stable order."""
    out = [DecoderMapping("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "copy", 0, None,
                          "pre")]
    for layer in range(num_layers):
        out.extend(layer_mappings(layer))
    out.append(DecoderMapping("decoder.final_layernorm.weight", ("model.norm.weight",), "copy", None, None, "post"))
    if not tie_word_embeddings:
        out.append(DecoderMapping("output_layer.weight", ("lm_head.weight",), "copy", 0, None, "post"))
    return out


def fuse_gqa_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, num_groups: int) -> torch.Tensor:
    """Qwen2 q [n*d, ...], k/v [g*d, ...] -> Megatron linear_qkv [g*(n/g + 2)*d, ...] (per group q..., k, v)."""
    if num_heads % num_groups:
        raise ValueError(f"{num_heads} heads do not split into {num_groups} query groups")
    qg = q.unflatten(0, (num_groups, -1))
    kg = k.unflatten(0, (num_groups, -1))
    vg = v.unflatten(0, (num_groups, -1))
    return torch.cat([qg, kg, vg], dim=1).flatten(0, 1)


def split_gqa_qkv(
    fused: torch.Tensor, num_heads: int, num_groups: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_gqa_qkv`: [g*(n/g + 2)*d, ...] -> q [n*d, ...], k [g*d, ...], v [g*d, ...]."""
    per = fused.unflatten(0, (num_groups, -1))
    d = per.shape[1] // (num_heads // num_groups + 2)
    nq = num_heads // num_groups * d
    return (per[:, :nq].flatten(0, 1), per[:, nq:nq + d].flatten(0, 1), per[:, nq + d:].flatten(0, 1))


def _chunk(t: torch.Tensor, dim: int, rank: int, size: int, what: str) -> torch.Tensor:
    if t.shape[dim] % size:
        raise ValueError(f"{what}: dim {dim} of shape {tuple(t.shape)} does not split over tp={size}")
    return t.chunk(size, dim=dim)[rank]


def hf_to_megatron_shard(
    mapping: DecoderMapping, hf: list[torch.Tensor], num_heads: int, num_groups: int, tp_rank: int, tp_size: int
) -> torch.Tensor:
    """This tensor-parallel rank's Megatron tensor of `mapping` from the full Qwen2 tensors (`mapping.hf` order)."""
    if mapping.kind == "fuse_qkv":
        if num_groups % tp_size:
            raise ValueError(f"{num_groups} query groups do not split over tp={tp_size}")
        return _chunk(fuse_gqa_qkv(*hf, num_heads, num_groups), 0, tp_rank, tp_size, mapping.megatron)
    if mapping.kind == "fuse_gate_up":
        gate, up = hf
        return torch.cat([_chunk(gate, 0, tp_rank, tp_size, mapping.megatron),
                          _chunk(up, 0, tp_rank, tp_size, mapping.megatron)], dim=0)
    if mapping.kind != "copy":
        raise ValueError(f"unknown mapping kind {mapping.kind!r}")
    (t,) = hf
    return t if mapping.tp_dim is None or tp_size == 1 else _chunk(t, mapping.tp_dim, tp_rank, tp_size,
                                                                    mapping.megatron)


def megatron_shards_to_hf(
    mapping: DecoderMapping, shards: list[torch.Tensor], num_heads: int, num_groups: int
) -> list[torch.Tensor]:
    """The full Qwen2 tensors (in `mapping.hf` order) from all tensor-parallel shards in rank order
    (one entry for a replicated tensor)."""
    if mapping.tp_dim is None:
        return [shards[0]]
    if mapping.kind == "fuse_gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)]
    full = torch.cat(shards, dim=mapping.tp_dim)
    if mapping.kind == "fuse_qkv":
        return list(split_gqa_qkv(full, num_heads, num_groups))
    return [full]
