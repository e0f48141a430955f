"""A DiT stage's Megatron shards <-> full Hugging Face (diffusers) tensors, for any family described by its name
mappings (`ParamMapping`s: megatron, hf, kind, tp_dim, layer, stage), per-rank parameter counts from the same
data, and the `TransformerConfig` settings every DiT family's parallel layout gives (`layout_config`).

The model is any of our DiT stages (`megatron_omni.models.dit.model.DiTStage`): its parameters are named
locally (block i of its stage is `layers.i`), `global_name` gives the model-wide name the mappings use, and
`pg_collection.tp` is its tensor-parallel group. Fused q/k/v tensors interleave per head, so the number of
heads (`config.num_attention_heads`) is what splits them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.parallel.platform import megatron_config_defaults
from model_providers.qwen_image.mapping import ParamMapping, hf_to_megatron, megatron_to_hf, tp_shard


def layout_config(architecture: dict[str, Any], *, tp: int, pp: int, ulysses: int, ring: int,
                  params_dtype: torch.dtype, overrides: dict[str, Any]) -> dict[str, Any]:
    """The `TransformerConfig` keyword arguments of a DiT: its `architecture` ones, those its parallel layout and
    dtype give (biased linears, no dropout, this platform's defaults), then `overrides` (recompute,
    batch_p2p_comm, ...), which win over everything."""
    kwargs: dict[str, Any] = dict(
        architecture,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        ulysses_size=ulysses,
        ring_size=ring,
        add_bias_linear=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
    )
    kwargs.update(megatron_config_defaults())
    kwargs.update(overrides)
    return kwargs


def local_mappings(model: Any, mappings: Sequence[ParamMapping]) -> dict[str, ParamMapping]:
    """Local parameter name -> mapping, for the blocks and projections this stage holds. Raises KeyError naming
    a local tensor the mappings do not cover."""
    from megatron_omni.models.lora import is_adapter_name  # megatron-core: a built model is at hand here anyway

    by_global = {m.megatron: m for m in mappings}
    out = {}
    for name in model.state_dict():
        if name.endswith("_extra_state") or is_adapter_name(name):
            continue  # TE's FP8 metadata and LoRA adapters are not base weights
        key = model.global_name(name)
        if key not in by_global:
            raise KeyError(f"model tensor {name} ({key}) has no diffusers mapping")
        out[name] = by_global[key]
    return out


@torch.no_grad()
def load_hf_tensors(model: Any, hf_state: dict[str, torch.Tensor], mappings: Sequence[ParamMapping]) -> None:
    """Copy diffusers-named full tensors into this rank's shards (every rank passes the same dict). Raises
    KeyError naming a missing tensor, ValueError on a shape that does not fit."""
    tp = model.pg_collection.tp
    heads = model.config.num_attention_heads
    state = model.state_dict()
    for name, mapping in local_mappings(model, mappings).items():
        missing = [k for k in mapping.hf if k not in hf_state]
        if missing:
            raise KeyError(f"diffusers state dict lacks {missing} (needed for {mapping.megatron})")
        full = hf_to_megatron(mapping, [hf_state[k] for k in mapping.hf], heads)
        shard = tp_shard(full, mapping.tp_dim, tp.rank(), tp.size())
        if shard.shape != state[name].shape:
            raise ValueError(
                f"{mapping.hf[0]}: shape {tuple(full.shape)} gives shard {tuple(shard.shape)}, "
                f"model expects {tuple(state[name].shape)} for {name}"
            )
        state[name].copy_(shard)


def gather_full_tensor(local: torch.Tensor, tp_dim: int | None, tp_group: dist.ProcessGroup) -> torch.Tensor:
    """All-gather a tensor-parallel shard into the full tensor (replicated tensors come back as they are)."""
    if tp_dim is None or tp_group.size() == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp_group.size())]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return torch.cat(parts, dim=tp_dim)


def gather_hf_tensors(model: Any, mappings: Sequence[ParamMapping],
                      tensors: dict[str, torch.Tensor | None] | None = None) -> dict[str, torch.Tensor]:
    """Diffusers-named full tensors of this pipeline stage, gathered over tp (collective over tp).

    `tensors` (local name -> tensor) defaults to the model's parameters; pass e.g. `{name: p.grad}` to map
    gradients (None entries are skipped).
    """
    tp = model.pg_collection.tp
    heads = model.config.num_attention_heads
    source = tensors if tensors is not None else dict(model.state_dict())
    out: dict[str, torch.Tensor] = {}
    for name, mapping in local_mappings(model, mappings).items():
        if name not in source or source[name] is None:
            continue
        full = gather_full_tensor(source[name].detach(), mapping.tp_dim, tp)
        for hf_name, t in zip(mapping.hf, megatron_to_hf(mapping, full, heads)):
            out[hf_name] = t
    return out


def megatron_tensors(model: Any, mappings: Sequence[ParamMapping]) -> dict[str, torch.Tensor]:
    """This rank's Megatron tensors (local tp shards of its stage, the parameters' storage, so a sync after an
    optimizer step reads the new values) by global Megatron name."""
    state = model.state_dict(keep_vars=True)
    return {m.megatron: state[name].detach() for name, m in local_mappings(model, mappings).items()}


def stage_parameter_counts(mappings: Sequence[ParamMapping], shapes: dict[str, tuple[int, ...]], num_layers: int,
                           num_heads: int, tp: int, pp: int = 1) -> list[int]:
    """Parameters one rank of each pipeline stage holds at tensor-parallel size `tp` (index = stage), from the
    mappings and full shapes alone. Replicated tensors count on every rank that holds them (stage "all": on
    every stage)."""
    if num_layers % pp:
        raise ValueError(f"{num_layers} blocks are not divisible by pp={pp}")
    if num_heads % tp:
        raise ValueError(f"{num_heads} heads are not divisible by tp={tp}")
    per_stage = num_layers // pp
    counts = [0] * pp
    for m in mappings:
        n = math.prod(shapes[m.megatron]) // (tp if m.tp_dim is not None else 1)
        if m.stage == "all":
            stages = range(pp)
        elif m.stage == "pre":
            stages = [0]
        elif m.stage == "post":
            stages = [pp - 1]
        else:
            stages = [m.layer // per_stage]
        for s in stages:
            counts[s] += n
    return counts
