"""Weight-name mapping between our Megatron SD3 model and diffusers' `SD3Transformer2DModel`, as data
(`ParamMapping`s, the kinds and tensor functions of `model_providers.qwen_image.mapping`: `copy`, `fuse_qkv`).

Which tensors a block has depends on the architecture: a dual-attention block adds `attn2` (the image's second
attention, Megatron `img_attn2`), the last block's text stream is context-pre-only (no `attn.to_add_out`,
no `ff_context`), so the mappings take the block count and the dual-attention blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from model_providers.qwen_image.mapping import ParamMapping

_NON_BLOCK = [
    ("time_embedder.linear_1", "time_text_embed.timestep_embedder.linear_1", "all"),
    ("time_embedder.linear_2", "time_text_embed.timestep_embedder.linear_2", "all"),
    ("pooled_embedder.linear_1", "time_text_embed.text_embedder.linear_1", "all"),
    ("pooled_embedder.linear_2", "time_text_embed.text_embedder.linear_2", "all"),
    ("patch_embed.proj", "pos_embed.proj", "pre"),
    ("context_embedder", "context_embedder", "pre"),
    ("norm_out.linear", "norm_out.linear", "post"),
    ("proj_out", "proj_out", "post"),
]


def _attention(m: str, b: str, layer: int, qkv: Sequence[str], norms: Sequence[str],
               out: str | None) -> list[ParamMapping]:
    """Fused qkv, QK norms and (unless None) the row-parallel output projection of one attention stream."""
    res = []
    for kind in ("weight", "bias"):
        res.append(ParamMapping(f"{m}linear_qkv.{kind}", tuple(f"{b}{n}.{kind}" for n in qkv), "fuse_qkv", 0,
                                layer, "block"))
        if out is not None:
            res.append(ParamMapping(f"{m}linear_proj.{kind}", (f"{b}{out}.{kind}",), "copy",
                                    1 if kind == "weight" else None, layer, "block"))
    for meg, hf in zip(("q_layernorm", "k_layernorm"), norms, strict=True):
        res.append(ParamMapping(f"{m}{meg}.weight", (f"{b}{hf}.weight",), "copy", None, layer, "block"))
    return res


def _adaln_mlp(m: str, b: str, layer: int, adaln: str, ff: str | None) -> list[ParamMapping]:
    res = []
    for kind in ("weight", "bias"):
        res.append(ParamMapping(f"{m}adaln.{kind}", (f"{b}{adaln}.{kind}",), "copy", 0, layer, "block"))
        if ff is not None:
            res.append(ParamMapping(f"{m}linear_fc1.{kind}", (f"{b}{ff}.net.0.proj.{kind}",), "copy", 0, layer,
                                    "block"))
            res.append(ParamMapping(f"{m}linear_fc2.{kind}", (f"{b}{ff}.net.2.{kind}",), "copy",
                                    1 if kind == "weight" else None, layer, "block"))
    return res


def block_mappings(layer: int, num_layers: int, dual_attention_layers: Sequence[int] = ()) -> list[ParamMapping]:
    """The mappings of block `layer` (0-based) of a `num_layers`-block model."""
    b, m = f"transformer_blocks.{layer}.", f"layers.{layer}."
    pre_only = layer == num_layers - 1
    out = _adaln_mlp(f"{m}img.", b, layer, "norm1.linear", "ff")
    out += _attention(f"{m}img.", b, layer, ("attn.to_q", "attn.to_k", "attn.to_v"), ("attn.norm_q", "attn.norm_k"),
                      "attn.to_out.0")
    if layer in tuple(dual_attention_layers):
        out += _attention(f"{m}img_attn2.", b, layer, ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
                          ("attn2.norm_q", "attn2.norm_k"), "attn2.to_out.0")
    out += _adaln_mlp(f"{m}txt.", b, layer, "norm1_context.linear", None if pre_only else "ff_context")
    out += _attention(f"{m}txt.", b, layer, ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
                      ("attn.norm_added_q", "attn.norm_added_k"), None if pre_only else "attn.to_add_out")
    return out


def all_mappings(num_layers: int, dual_attention_layers: Sequence[int] = ()) -> list[ParamMapping]:
    """Every tensor of the model, in a stable order (the fixed sincos table `pos_embed` included: diffusers
    stores it as a persistent buffer)."""
    out = [ParamMapping(f"{meg}.{kind}", (f"{hf}.{kind}",), "copy", None, None, stage)
           for meg, hf, stage in _NON_BLOCK for kind in ("weight", "bias")]
    out.append(ParamMapping("patch_embed.pos_embed", ("pos_embed.pos_embed",), "copy", None, None, "pre"))
    for layer in range(num_layers):
        out.extend(block_mappings(layer, num_layers, dual_attention_layers))
    return out
