"""Weight-name mapping between our Megatron FLUX model and diffusers' `FluxTransformer2DModel`, as data
(`ParamMapping`s with the kinds and tensor functions of `model_providers.qwen_image.mapping`: `copy`, `fuse_qkv`).

Double-stream block i is Megatron `layers.i` (the MMDiT block's `img` / `txt` streams), single-stream block j is
`single_layers.j`, with global block index `num_layers + j` in the mappings (what splits blocks over pipeline
stages). The single block's output projection keeps diffusers' layout (`linear_out`, column-parallel: see
`megatron_omni.models.dit.flux_layer`); the guidance embedder exists only in guidance-distilled models.
"""

from __future__ import annotations

from model_providers.qwen_image.mapping import ParamMapping

_NON_BLOCK = [
    ("time_embedder.linear_1", "time_text_embed.timestep_embedder.linear_1", "all"),
    ("time_embedder.linear_2", "time_text_embed.timestep_embedder.linear_2", "all"),
    ("pooled_embedder.linear_1", "time_text_embed.text_embedder.linear_1", "all"),
    ("pooled_embedder.linear_2", "time_text_embed.text_embedder.linear_2", "all"),
    ("x_embedder", "x_embedder", "pre"),
    ("context_embedder", "context_embedder", "pre"),
    ("norm_out.linear", "norm_out.linear", "post"),
    ("proj_out", "proj_out", "post"),
]
_GUIDANCE = [
    ("guidance_embedder.linear_1", "time_text_embed.guidance_embedder.linear_1", "all"),
    ("guidance_embedder.linear_2", "time_text_embed.guidance_embedder.linear_2", "all"),
]
# Per stream of a double block: adaLN, q/k/v, QK norms, output projection, MLP (diffusers suffixes).
_DOUBLE = {
    "img": ("norm1.linear", ("attn.to_q", "attn.to_k", "attn.to_v"), ("attn.norm_q", "attn.norm_k"), "attn.to_out.0",
            "ff"),
    "txt": ("norm1_context.linear", ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
            ("attn.norm_added_q", "attn.norm_added_k"), "attn.to_add_out", "ff_context"),
}


def _linear(meg: str, hf: str, tp_dim: int | None, layer: int, kind: str = "copy",
            parts: tuple[str, ...] | None = None) -> list[ParamMapping]:
    """Weight and bias of one linear; a row-parallel weight (tp_dim 1) has a replicated bias."""
    out = []
    for k in ("weight", "bias"):
        names = tuple(f"{p}.{k}" for p in parts) if parts else (f"{hf}.{k}",)
        dim = None if (tp_dim == 1 and k == "bias") else tp_dim
        out.append(ParamMapping(f"{meg}.{k}", names, kind, dim, layer, "block"))
    return out


def double_block_mappings(layer: int) -> list[ParamMapping]:
    """The mappings of double-stream block `layer` (0-based)."""
    b, m = f"transformer_blocks.{layer}.", f"layers.{layer}."
    out = []
    for stream, (adaln, qkv, norms, proj, ff) in _DOUBLE.items():
        p = f"{m}{stream}."
        out += _linear(f"{p}adaln", f"{b}{adaln}", 0, layer)
        out += _linear(f"{p}linear_qkv", "", 0, layer, "fuse_qkv", tuple(f"{b}{n}" for n in qkv))
        out += _linear(f"{p}linear_proj", f"{b}{proj}", 1, layer)
        out += _linear(f"{p}linear_fc1", f"{b}{ff}.net.0.proj", 0, layer)
        out += _linear(f"{p}linear_fc2", f"{b}{ff}.net.2", 1, layer)
        for meg, hf in zip(("q_layernorm", "k_layernorm"), norms, strict=True):
            out.append(ParamMapping(f"{p}{meg}.weight", (f"{b}{hf}.weight",), "copy", None, layer, "block"))
    return out


def single_block_mappings(index: int, num_layers: int) -> list[ParamMapping]:
    """The mappings of single-stream block `index` (0-based among them) of a model with `num_layers` double
    blocks (its global block index is `num_layers + index`)."""
    b, m, layer = f"single_transformer_blocks.{index}.", f"single_layers.{index}.", num_layers + index
    out = _linear(f"{m}adaln", f"{b}norm.linear", 0, layer)
    out += _linear(f"{m}linear_qkv", "", 0, layer, "fuse_qkv", tuple(f"{b}attn.to_{n}" for n in "qkv"))
    out += _linear(f"{m}linear_fc1", f"{b}proj_mlp", 0, layer)
    out += _linear(f"{m}linear_out", f"{b}proj_out", 0, layer)
    for meg, hf in (("q_layernorm", "attn.norm_q"), ("k_layernorm", "attn.norm_k")):
        out.append(ParamMapping(f"{m}{meg}.weight", (f"{b}{hf}.weight",), "copy", None, layer, "block"))
    return out


def all_mappings(num_layers: int, num_single_layers: int, guidance_embeds: bool) -> list[ParamMapping]:
    """Every tensor of the model, in a stable order."""
    non_block = _NON_BLOCK + (_GUIDANCE if guidance_embeds else [])
    out = [ParamMapping(f"{meg}.{k}", (f"{hf}.{k}",), "copy", None, None, stage)
           for meg, hf, stage in non_block for k in ("weight", "bias")]
    for layer in range(num_layers):
        out.extend(double_block_mappings(layer))
    for index in range(num_single_layers):
        out.extend(single_block_mappings(index, num_layers))
    return out
