"""The Qwen-Image model provider: config from a preset or a diffusers config, the Megatron model for one
rank, loading/gathering diffusers-named weights, and exact parameter counts (full and per rank)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.models.dit.config import MMDiTConfig
from megatron_omni.models.dit.model import MMDiTModel
from megatron_omni.models.lora import is_adapter_name
from megatron_omni.parallel.platform import megatron_config_defaults
from model_providers.qwen_image.mapping import (
    ParamMapping,
    all_mappings,
    hf_to_megatron,
    megatron_to_hf,
    tp_shard,
)
from model_providers.qwen_image.presets import preset
from model_providers.qwen_image.rollout_layouts import rollout_layout
from model_providers.qwen_image.specs import layer_spec
from model_providers.registry import WeightPart

_HF_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
            "num_attention_heads", "joint_attention_dim", "axes_dims_rope")


def hf_config(name_or_config: str | dict[str, Any]) -> dict[str, Any]:
    """A diffusers transformer config (only the architecture keys) from a preset name or a config dict."""
    cfg = preset(name_or_config) if isinstance(name_or_config, str) else dict(name_or_config)
    unsupported = {k: cfg.get(k) for k in ("guidance_embeds", "zero_cond_t", "use_additional_t_cond",
                                           "use_layer3d_rope") if cfg.get(k)}
    if unsupported:
        raise ValueError(f"Qwen-Image variant options not supported yet: {unsupported}")
    missing = [k for k in _HF_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"diffusers config lacks {missing}")
    return {k: (tuple(cfg[k]) if k == "axes_dims_rope" else cfg[k]) for k in _HF_KEYS}


def transformer_config(
    name_or_config: str | dict[str, Any],
    *,
    tp: int = 1,
    pp: int = 1,
    ulysses: int = 1,
    ring: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> MMDiTConfig:
    """The Megatron `MMDiTConfig` of a Qwen-Image transformer for a parallel layout."""
    c = hf_config(name_or_config)
    hidden = c["num_attention_heads"] * c["attention_head_dim"]
    kwargs: dict[str, Any] = dict(
        num_layers=c["num_layers"],
        hidden_size=hidden,
        num_attention_heads=c["num_attention_heads"],
        kv_channels=c["attention_head_dim"],
        ffn_hidden_size=4 * hidden,
        in_channels=c["in_channels"],
        out_channels=c["out_channels"],
        patch_size=c["patch_size"],
        joint_attention_dim=c["joint_attention_dim"],
        axes_dims_rope=c["axes_dims_rope"],
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        ulysses_size=ulysses,
        ring_size=ring,
        qk_layernorm=True,
        add_bias_linear=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
    )
    kwargs.update(megatron_config_defaults())
    kwargs.update(overrides)
    return MMDiTConfig(**kwargs)


def build_model(config: MMDiTConfig, groups, backend: str = "local") -> MMDiTModel:
    """This rank's stage of the model (`groups`: `megatron_omni.parallel.ParallelGroups`)."""
    groups.layout.validate_model(num_heads=config.num_attention_heads, num_layers=config.num_layers)
    return MMDiTModel(config, layer_spec(backend), groups)


def weight_parts(name_or_config: str | dict[str, Any]) -> dict[str, WeightPart]:
    """The one part the bridge syncs ("transformer"): mappings, full shapes and the rollout engines' layouts."""
    c = hf_config(name_or_config)
    return {"transformer": WeightPart(all_mappings(c["num_layers"]), megatron_shapes(c), c["num_attention_heads"],
                                      c["num_layers"], rollout_layout)}


def megatron_sources(model: MMDiTModel) -> dict[str, dict[str, torch.Tensor]]:
    """{"transformer": this rank's Megatron tensors (local tp shards of its stage, the parameters' storage)
    by global Megatron name}."""
    state = model.state_dict(keep_vars=True)
    return {"transformer": {m.megatron: state[name].detach() for name, m in local_mappings(model).items()}}


def tiny_transformer_config() -> dict[str, Any]:
    """The transformer config of the offline tiny pipeline (`model.pipeline=tiny`)."""
    from model_providers.qwen_image.tiny_pipeline import TinyPipelineConfig

    tiny = TinyPipelineConfig()
    return dict(vars(tiny.transformer), joint_attention_dim=tiny.text_hidden_size)


def make_tiny_pipeline(folder: Path, seed: int) -> Path:
    """Write the offline tiny Qwen-Image pipeline (seeded weights) to `folder`."""
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline as make

    return make(folder, seed=seed)


def local_mappings(model: MMDiTModel) -> dict[str, ParamMapping]:
    """Local parameter name -> mapping, for the blocks and projections this stage holds."""
    by_global = {m.megatron: m for m in all_mappings(model.config.num_layers)}
    out = {}
    for name in model.state_dict():
        if name.endswith("_extra_state") or is_adapter_name(name):
            continue  # TE's FP8 metadata and LoRA adapters are not base weights
        out[name] = by_global[model.global_name(name)]
    return out


@torch.no_grad()
def load_hf_state_dict(model: MMDiTModel, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy diffusers-named full tensors into this rank's shards (every rank passes the same dict)."""
    tp = model.pg_collection.tp
    heads = model.config.num_attention_heads
    state = model.state_dict()
    for name, mapping in local_mappings(model).items():
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


def stage_hf_tensors(
    model: MMDiTModel, tensors: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Diffusers-named full tensors of this pipeline stage, gathered over tp (collective over tp).

    `tensors` defaults to the model's parameters; pass e.g. `{name: p.grad}` to map gradients.
    """
    tp = model.pg_collection.tp
    heads = model.config.num_attention_heads
    source = tensors if tensors is not None else dict(model.state_dict())
    out: dict[str, torch.Tensor] = {}
    for name, mapping in local_mappings(model).items():
        if name not in source or source[name] is None:
            continue
        full = gather_full_tensor(source[name].detach(), mapping.tp_dim, tp)
        for hf_name, t in zip(mapping.hf, megatron_to_hf(mapping, full, heads)):
            out[hf_name] = t
    return out


# ------------------------------------------------------------------------------------- parameter counts


def megatron_shapes(name_or_config: str | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every Megatron tensor, from the config alone (no tensors allocated)."""
    c = hf_config(name_or_config)
    h = c["num_attention_heads"] * c["attention_head_dim"]
    d = c["attention_head_dim"]
    j = c["joint_attention_dim"]
    out_dim = c["patch_size"] ** 2 * c["out_channels"]
    shapes = {
        "time_embedder.linear_1.weight": (h, 256), "time_embedder.linear_1.bias": (h,),
        "time_embedder.linear_2.weight": (h, h), "time_embedder.linear_2.bias": (h,),
        "img_in.weight": (h, c["in_channels"]), "img_in.bias": (h,),
        "txt_norm.weight": (j,), "txt_in.weight": (h, j), "txt_in.bias": (h,),
        "norm_out.linear.weight": (2 * h, h), "norm_out.linear.bias": (2 * h,),
        "proj_out.weight": (out_dim, h), "proj_out.bias": (out_dim,),
    }
    per_stream = {
        "adaln.weight": (6 * h, h), "adaln.bias": (6 * h,),
        "linear_qkv.weight": (3 * h, h), "linear_qkv.bias": (3 * h,),
        "q_layernorm.weight": (d,), "k_layernorm.weight": (d,),
        "linear_proj.weight": (h, h), "linear_proj.bias": (h,),
        "linear_fc1.weight": (4 * h, h), "linear_fc1.bias": (4 * h,),
        "linear_fc2.weight": (h, 4 * h), "linear_fc2.bias": (h,),
    }
    for layer in range(c["num_layers"]):
        for stream in ("img", "txt"):
            for suffix, shape in per_stream.items():
                shapes[f"layers.{layer}.{stream}.{suffix}"] = shape
    return shapes


def parameter_count(name_or_config: str | dict[str, Any]) -> int:
    """Exact parameter count of the full model."""
    return sum(math.prod(s) for s in megatron_shapes(name_or_config).values())


def per_rank_parameter_counts(name_or_config: str | dict[str, Any], tp: int, pp: int = 1) -> list[int]:
    """Parameters held by one rank of each pipeline stage at tensor-parallel size `tp` (index = stage).

    Replicated tensors count on every rank that holds them (the timestep embedder on every stage).
    """
    c = hf_config(name_or_config)
    if c["num_layers"] % pp:
        raise ValueError(f"{c['num_layers']} blocks are not divisible by pp={pp}")
    if c["num_attention_heads"] % tp:
        raise ValueError(f"{c['num_attention_heads']} heads are not divisible by tp={tp}")
    per_stage = c["num_layers"] // pp
    shapes = megatron_shapes(c)
    counts = [0] * pp
    for m in all_mappings(c["num_layers"]):
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
