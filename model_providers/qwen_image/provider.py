"""The Qwen-Image model provider: config from a preset or a diffusers config, the Megatron model for one
rank, loading/gathering diffusers-named weights, and exact parameter counts (full and per rank)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from model_providers import shards
from model_providers.qwen_image.mapping import ParamMapping, all_mappings
from model_providers.qwen_image.presets import preset
from model_providers.qwen_image.rollout_layouts import rollout_layout
from model_providers.registry import WeightPart

if TYPE_CHECKING:
    from megatron_omni.models.dit.config import MMDiTConfig
    from megatron_omni.models.dit.model import MMDiTModel

_HF_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
            "num_attention_heads", "joint_attention_dim", "axes_dims_rope")


def hf_config(name_or_config: str | dict[str, Any]) -> dict[str, Any]:
    """A diffusers transformer config (only the architecture keys) from a preset name or a config dict."""
    cfg = preset(name_or_config) if isinstance(name_or_config, str) else dict(name_or_config)
    unsupported = {k: cfg.get(k) for k in ("guidance_embeds", "use_additional_t_cond", "use_layer3d_rope")
                   if cfg.get(k)}
    if unsupported:
        raise ValueError(f"Qwen-Image variant options not supported yet: {unsupported}")
    missing = [k for k in _HF_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"diffusers config lacks {missing}")
    arch = {k: (tuple(cfg[k]) if k == "axes_dims_rope" else cfg[k]) for k in _HF_KEYS}
    if cfg.get("zero_cond_t"):  # Qwen-Image-Edit-2511 (only when set: the other configs keep their keys)
        arch["zero_cond_t"] = True
    return arch


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
    from megatron_omni.models.dit.config import MMDiTConfig  # megatron-core: only where a model is configured

    c = hf_config(name_or_config)
    hidden = c["num_attention_heads"] * c["attention_head_dim"]
    return MMDiTConfig(**shards.layout_config(dict(
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
        qk_layernorm=True,
        zero_cond_t=bool(c.get("zero_cond_t", False)),
    ), tp=tp, pp=pp, ulysses=ulysses, ring=ring, params_dtype=params_dtype, overrides=overrides))


def build_model(config: MMDiTConfig, groups, backend: str = "local") -> MMDiTModel:
    """This rank's stage of the model (`groups`: `megatron_omni.parallel.ParallelGroups`)."""
    from megatron_omni.models.dit.model import MMDiTModel
    from model_providers.qwen_image.specs import layer_spec

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
    return {"transformer": shards.megatron_tensors(model, all_mappings(model.config.num_layers))}


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
    return shards.local_mappings(model, all_mappings(model.config.num_layers))


def load_hf_state_dict(model: MMDiTModel, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy diffusers-named full tensors into this rank's shards (every rank passes the same dict)."""
    shards.load_hf_tensors(model, hf_state, all_mappings(model.config.num_layers))


gather_full_tensor = shards.gather_full_tensor


def stage_hf_tensors(
    model: MMDiTModel, tensors: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Diffusers-named full tensors of this pipeline stage, gathered over tp (collective over tp).

    `tensors` defaults to the model's parameters; pass e.g. `{name: p.grad}` to map gradients.
    """
    return shards.gather_hf_tensors(model, all_mappings(model.config.num_layers), tensors)


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
    return shards.stage_parameter_counts(all_mappings(c["num_layers"]), megatron_shapes(c), c["num_layers"],
                                         c["num_attention_heads"], tp, pp)
