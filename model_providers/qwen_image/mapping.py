"""Weight-name mapping between our Megatron Qwen-Image model and diffusers' `QwenImageTransformer2DModel`,
declared as data (the checkpoint converter and the bridge planner read it) plus pure tensor functions.

Megatron names are global (block index over all pipeline stages). Each entry says which diffusers tensors
feed the Megatron tensor, how they are combined, and along which dimension tensor parallelism splits it:

- `fuse_qkv`: diffusers q, k, v ([n*d, ...] each) -> Megatron's per-head interleave [n, (q|k|v), d, ...];
- `copy`: one tensor, same layout;
- `tp_dim`: 0 for column-parallel (rows split), 1 for row-parallel weights, None for replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamMapping:
    """One Megatron tensor and the diffusers tensors it is made of."""

    megatron: str
    hf: tuple[str, ...]
    kind: str  # "copy" | "fuse_qkv"
    tp_dim: int | None
    layer: int | None  # block index, None for the non-block tensors
    stage: str  # "pre" (first pipeline stage), "block", "post" (last stage), "all" (replicated on every stage)


_NON_BLOCK = [
    ("time_embedder.linear_1.weight", "time_text_embed.timestep_embedder.linear_1.weight", "all"),
    ("time_embedder.linear_1.bias", "time_text_embed.timestep_embedder.linear_1.bias", "all"),
    ("time_embedder.linear_2.weight", "time_text_embed.timestep_embedder.linear_2.weight", "all"),
    ("time_embedder.linear_2.bias", "time_text_embed.timestep_embedder.linear_2.bias", "all"),
    ("img_in.weight", "img_in.weight", "pre"),
    ("img_in.bias", "img_in.bias", "pre"),
    ("txt_norm.weight", "txt_norm.weight", "pre"),
    ("txt_in.weight", "txt_in.weight", "pre"),
    ("txt_in.bias", "txt_in.bias", "pre"),
    ("norm_out.linear.weight", "norm_out.linear.weight", "post"),
    ("norm_out.linear.bias", "norm_out.linear.bias", "post"),
    ("proj_out.weight", "proj_out.weight", "post"),
    ("proj_out.bias", "proj_out.bias", "post"),
]

# (megatron suffix, diffusers suffixes, kind, tp_dim) per stream; {s} is img/txt.
_STREAM = {
    "img": {
        "adaln": ("img_mod.1", 0),
        "qkv": (("attn.to_q", "attn.to_k", "attn.to_v"),),
        "q_layernorm": "attn.norm_q",
        "k_layernorm": "attn.norm_k",
        "linear_proj": "attn.to_out.0",
        "linear_fc1": "img_mlp.net.0.proj",
        "linear_fc2": "img_mlp.net.2",
    },
    "txt": {
        "adaln": ("txt_mod.1", 0),
        "qkv": (("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),),
        "q_layernorm": "attn.norm_added_q",
        "k_layernorm": "attn.norm_added_k",
        "linear_proj": "attn.to_add_out",
        "linear_fc1": "txt_mlp.net.0.proj",
        "linear_fc2": "txt_mlp.net.2",
    },
}


def block_mappings(layer: int) -> list[ParamMapping]:
    """The mappings of block `layer` (0-based, global)."""
    out = []
    b = f"transformer_blocks.{layer}."
    m = f"layers.{layer}."
    for stream, names in _STREAM.items():
        p = f"{m}{stream}."
        for kind in ("weight", "bias"):
            out.append(ParamMapping(f"{p}adaln.{kind}", (f"{b}{names['adaln'][0]}.{kind}",), "copy", 0, layer,
                                    "block"))
            out.append(ParamMapping(f"{p}linear_qkv.{kind}", tuple(f"{b}{n}.{kind}" for n in names["qkv"][0]),
                                    "fuse_qkv", 0, layer, "block"))
            out.append(ParamMapping(f"{p}linear_fc1.{kind}", (f"{b}{names['linear_fc1']}.{kind}",), "copy", 0,
                                    layer, "block"))
            # Row-parallel: weights split on the input dim, the bias is added once after the reduce.
            for meg in ("linear_proj", "linear_fc2"):
                out.append(ParamMapping(f"{p}{meg}.{kind}", (f"{b}{names[meg]}.{kind}",), "copy",
                                        1 if kind == "weight" else None, layer, "block"))
        for norm in ("q_layernorm", "k_layernorm"):
            out.append(ParamMapping(f"{p}{norm}.weight", (f"{b}{names[norm]}.weight",), "copy", None, layer,
                                    "block"))
    return out


def all_mappings(num_layers: int) -> list[ParamMapping]:
    """Every tensor of a model with `num_layers` blocks, in a stable order."""
    out = [ParamMapping(meg, (hf,), "copy", None, None, stage) for meg, hf, stage in _NON_BLOCK]
    for layer in range(num_layers):
        out.extend(block_mappings(layer))
    return out


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int) -> torch.Tensor:
    """diffusers q, k, v [n*d, ...] -> Megatron fused [n*3*d, ...] ordered per head (q_h, k_h, v_h)."""
    parts = [t.unflatten(0, (num_heads, -1)) for t in (q, k, v)]
    return torch.stack(parts, dim=1).flatten(0, 2)


def split_qkv(fused: torch.Tensor, num_heads: int,
              views: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: [n*3*d, ...] -> q, k, v [n*d, ...] (copies: a part's rows are strided per head);
    `views=True`: q, k, v as [n, d, ...] views of `fused` (their first two dims flattened are the parts)."""
    per_head = fused.unflatten(0, (num_heads, 3, -1))
    if views:
        return tuple(per_head[:, i] for i in range(3))
    return tuple(per_head[:, i].flatten(0, 1) for i in range(3))


def hf_to_megatron(mapping: ParamMapping, hf_tensors: list[torch.Tensor], num_heads: int) -> torch.Tensor:
    """The full (unsharded) Megatron tensor of `mapping` from its diffusers tensors."""
    if mapping.kind == "fuse_qkv":
        return fuse_qkv(*hf_tensors, num_heads=num_heads)
    (t,) = hf_tensors
    return t


def megatron_to_hf(mapping: ParamMapping, full: torch.Tensor, num_heads: int,
                   views: bool = False) -> list[torch.Tensor]:
    """The diffusers tensors (in `mapping.hf` order) of a full Megatron tensor; `views=True` returns views of
    `full` without copying (a fused qkv's parts as [heads, head_dim, ...]: see `split_qkv`)."""
    if mapping.kind == "fuse_qkv":
        return list(split_qkv(full, num_heads, views=views))
    return [full]


def tp_shard(full: torch.Tensor, tp_dim: int | None, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This tensor-parallel rank's slice of a full tensor (the whole tensor when replicated)."""
    if tp_dim is None or tp_size == 1:
        return full
    if full.shape[tp_dim] % tp_size:
        raise ValueError(f"dim {tp_dim} of shape {tuple(full.shape)} does not split over tp={tp_size}")
    return full.chunk(tp_size, dim=tp_dim)[tp_rank]
