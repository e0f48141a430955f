"""Weight-name mapping between our Megatron Wan model and diffusers' `WanTransformer3DModel`, declared as data
(the checkpoint converter and the bridge planner read it), with the Qwen-Image family's `ParamMapping` and
tensor functions (the same kinds: `copy`, `fuse_qkv`).

Megatron names are global (block index over all pipeline stages). `tp_dim` is 0 for column-parallel tensors
(rows split: q/k/v, fc1, the across-heads q/k norm weights, which follow their heads), 1 for row-parallel
weights (their biases are added once after the reduce: replicated), None for replicated tensors. The self
attention's q/k/v fuse into Megatron's per-head interleave; the cross attention keeps q, k, v apart (its k/v
read the text, its q the video). Every Megatron tensor keeps its diffusers shape (the patch embedding its
Conv3d weight `[h, c, pt, ph, pw]`, the modulation tables `[1, 6, h]` / `[1, 2, h]`), so conversion copies bytes.
"""

from __future__ import annotations

from model_providers.qwen_image.mapping import ParamMapping

_NON_BLOCK = [
    # (megatron, diffusers, tp_dim, stage)
    ("patch_embedding.weight", "patch_embedding.weight", None, "pre"),
    ("patch_embedding.bias", "patch_embedding.bias", None, "pre"),
    ("text_embedder.linear_1.weight", "condition_embedder.text_embedder.linear_1.weight", 0, "pre"),
    ("text_embedder.linear_1.bias", "condition_embedder.text_embedder.linear_1.bias", 0, "pre"),
    ("text_embedder.linear_2.weight", "condition_embedder.text_embedder.linear_2.weight", 1, "pre"),
    ("text_embedder.linear_2.bias", "condition_embedder.text_embedder.linear_2.bias", None, "pre"),
    ("time_embedder.linear_1.weight", "condition_embedder.time_embedder.linear_1.weight", None, "all"),
    ("time_embedder.linear_1.bias", "condition_embedder.time_embedder.linear_1.bias", None, "all"),
    ("time_embedder.linear_2.weight", "condition_embedder.time_embedder.linear_2.weight", None, "all"),
    ("time_embedder.linear_2.bias", "condition_embedder.time_embedder.linear_2.bias", None, "all"),
    ("time_proj.weight", "condition_embedder.time_proj.weight", 0, "all"),
    ("time_proj.bias", "condition_embedder.time_proj.bias", 0, "all"),
    ("scale_shift_table", "scale_shift_table", None, "post"),
    ("proj_out.weight", "proj_out.weight", None, "post"),
    ("proj_out.bias", "proj_out.bias", None, "post"),
]


def _column(meg: str, hf: str, layer: int) -> list[ParamMapping]:
    return [ParamMapping(f"{meg}.{k}", (f"{hf}.{k}",), "copy", 0, layer, "block") for k in ("weight", "bias")]


def _row(meg: str, hf: str, layer: int) -> list[ParamMapping]:
    return [ParamMapping(f"{meg}.weight", (f"{hf}.weight",), "copy", 1, layer, "block"),
            ParamMapping(f"{meg}.bias", (f"{hf}.bias",), "copy", None, layer, "block")]


def block_mappings(layer: int) -> list[ParamMapping]:
    """The mappings of block `layer` (0-based, global)."""
    b, m = f"blocks.{layer}.", f"layers.{layer}."
    out = [ParamMapping(f"{m}scale_shift_table", (f"{b}scale_shift_table",), "copy", None, layer, "block")]
    sa, ca = f"{m}self_attention.", f"{m}cross_attention."
    for kind in ("weight", "bias"):
        out.append(ParamMapping(f"{sa}linear_qkv.{kind}", tuple(f"{b}attn1.to_{p}.{kind}" for p in "qkv"),
                                "fuse_qkv", 0, layer, "block"))
    for attn, hf in ((sa, "attn1"), (ca, "attn2")):
        for norm in ("norm_q", "norm_k"):
            out.append(ParamMapping(f"{attn}{norm}.weight", (f"{b}{hf}.{norm}.weight",), "copy", 0, layer, "block"))
        out += _row(f"{attn}linear_proj", f"{b}{hf}.to_out.0", layer)
    for p in "qkv":
        out += _column(f"{ca}linear_{p}", f"{b}attn2.to_{p}", layer)
    out += [ParamMapping(f"{m}norm2.{k}", (f"{b}norm2.{k}",), "copy", None, layer, "block") for k in ("weight", "bias")]
    out += _column(f"{m}mlp.linear_fc1", f"{b}ffn.net.0.proj", layer)
    out += _row(f"{m}mlp.linear_fc2", f"{b}ffn.net.2", layer)
    return out


def all_mappings(num_layers: int) -> list[ParamMapping]:
    """Every tensor of a model with `num_layers` blocks, in a stable order."""
    out = [ParamMapping(meg, (hf,), "copy", tp_dim, None, stage) for meg, hf, tp_dim, stage in _NON_BLOCK]
    for layer in range(num_layers):
        out.extend(block_mappings(layer))
    return out
