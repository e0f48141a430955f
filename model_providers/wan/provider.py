"""The Wan model provider: config from a preset or a diffusers config, the Megatron model for one rank,
loading/gathering diffusers-named weights, the bridge's weight part, and exact parameter counts (full and per
rank)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from model_providers import shards
from model_providers.qwen_image.mapping import ParamMapping
from model_providers.registry import WeightPart
from model_providers.wan.mapping import all_mappings
from model_providers.wan.presets import preset
from model_providers.wan.rollout_layouts import rollout_layout

if TYPE_CHECKING:
    from megatron_omni.models.dit.config import WanConfig
    from megatron_omni.models.dit.wan_model import WanModel

_HF_KEYS = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "text_dim",
            "freq_dim", "ffn_dim", "num_layers", "eps", "rope_max_seq_len")
# Variants of diffusers' WanTransformer3DModel this family does not build (image-to-video and its relatives).
_UNSUPPORTED = {"image_dim": None, "added_kv_proj_dim": None, "pos_embed_seq_len": None}


def hf_config(name_or_config: str | dict[str, Any]) -> dict[str, Any]:
    """A diffusers `WanTransformer3DModel` config (only the architecture keys) from a preset name or a config
    dict. Raises ValueError naming what this family does not build (image conditioning, another q/k norm, no
    cross-attention norm) or what the config lacks."""
    cfg = preset(name_or_config) if isinstance(name_or_config, str) else dict(name_or_config)
    unsupported = {k: cfg[k] for k, ok in _UNSUPPORTED.items() if cfg.get(k, ok) != ok}
    if cfg.get("qk_norm", "rms_norm_across_heads") != "rms_norm_across_heads":
        unsupported["qk_norm"] = cfg["qk_norm"]
    if not cfg.get("cross_attn_norm", True):
        unsupported["cross_attn_norm"] = cfg["cross_attn_norm"]
    if unsupported:
        raise ValueError(f"Wan variant options not supported (text-to-video transformers only): {unsupported}")
    missing = [k for k in _HF_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"diffusers config lacks {missing}")
    out = {k: (tuple(cfg[k]) if k == "patch_size" else cfg[k]) for k in _HF_KEYS}
    out.update(cross_attn_norm=True, qk_norm="rms_norm_across_heads")
    return out


def transformer_config(
    name_or_config: str | dict[str, Any],
    *,
    tp: int = 1,
    pp: int = 1,
    ulysses: int = 1,
    ring: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> WanConfig:
    """The Megatron `WanConfig` of a Wan transformer for a parallel layout."""
    from megatron_omni.models.dit.config import WanConfig  # megatron-core: only where a model is configured

    c = hf_config(name_or_config)
    return WanConfig(**shards.layout_config(dict(
        num_layers=c["num_layers"],
        hidden_size=c["num_attention_heads"] * c["attention_head_dim"],
        num_attention_heads=c["num_attention_heads"],
        kv_channels=c["attention_head_dim"],
        ffn_hidden_size=c["ffn_dim"],
        in_channels=c["in_channels"],
        out_channels=c["out_channels"],
        patch_size=c["patch_size"],
        text_dim=c["text_dim"],
        freq_dim=c["freq_dim"],
        norm_eps=c["eps"],
        rope_max_seq_len=c["rope_max_seq_len"],
    ), tp=tp, pp=pp, ulysses=ulysses, ring=ring, params_dtype=params_dtype, overrides=overrides))


def build_model(config: WanConfig, groups, backend: str = "local") -> WanModel:
    """This rank's stage of the model (`groups`: `megatron_omni.parallel.ParallelGroups`)."""
    from megatron_omni.models.dit.wan_model import WanModel
    from model_providers.wan.specs import layer_spec

    groups.layout.validate_model(num_heads=config.num_attention_heads, num_layers=config.num_layers)
    return WanModel(config, layer_spec(backend), groups)


def model_mappings(model: WanModel) -> list[ParamMapping]:
    """The mappings of `model`'s whole architecture (every stage's)."""
    return all_mappings(model.config.num_layers)


def load_hf_state_dict(model: WanModel, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy diffusers-named full tensors into this rank's shards (every rank passes the same dict)."""
    shards.load_hf_tensors(model, hf_state, model_mappings(model))


def stage_hf_tensors(model: WanModel, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Diffusers-named full tensors of this pipeline stage, gathered over tp (collective over tp); `tensors`
    (local name -> tensor, e.g. gradients) defaults to the parameters."""
    return shards.gather_hf_tensors(model, model_mappings(model), tensors)


def local_mappings(model: WanModel) -> dict[str, ParamMapping]:
    """Local parameter name -> mapping, for the blocks and ends this stage holds."""
    return shards.local_mappings(model, model_mappings(model))


def weight_parts(name_or_config: str | dict[str, Any]) -> dict[str, WeightPart]:
    """The one part the bridge syncs ("transformer"): mappings, full shapes and the rollout engines' layouts."""
    c = hf_config(name_or_config)
    return {"transformer": WeightPart(all_mappings(c["num_layers"]), megatron_shapes(c), c["num_attention_heads"],
                                      c["num_layers"], rollout_layout)}


def megatron_sources(model: WanModel) -> dict[str, dict[str, torch.Tensor]]:
    """{"transformer": this rank's Megatron tensors (local tp shards of its stage) by global Megatron name}."""
    return {"transformer": shards.megatron_tensors(model, model_mappings(model))}


def tiny_transformer_config() -> dict[str, Any]:
    """The transformer config of the offline tiny pipeline (`model.pipeline=tiny`)."""
    from model_providers.wan.tiny_pipeline import TinyWanPipelineConfig

    return TinyWanPipelineConfig().transformer_config()


def make_tiny_pipeline(folder: Path, seed: int) -> Path:
    """Write the offline tiny Wan pipeline (seeded weights) to `folder`."""
    from model_providers.wan.tiny_pipeline import make_tiny_pipeline as make

    return make(folder, seed=seed)


# ------------------------------------------------------------------------------------- parameter counts


def megatron_shapes(name_or_config: str | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every Megatron tensor, from the config alone (no tensors allocated)."""
    c = hf_config(name_or_config)
    h = c["num_attention_heads"] * c["attention_head_dim"]
    f, t = c["ffn_dim"], c["text_dim"]
    patch = tuple(c["patch_size"])
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embedding.weight": (h, c["in_channels"], *patch), "patch_embedding.bias": (h,),
        "text_embedder.linear_1.weight": (h, t), "text_embedder.linear_1.bias": (h,),
        "text_embedder.linear_2.weight": (h, h), "text_embedder.linear_2.bias": (h,),
        "time_embedder.linear_1.weight": (h, c["freq_dim"]), "time_embedder.linear_1.bias": (h,),
        "time_embedder.linear_2.weight": (h, h), "time_embedder.linear_2.bias": (h,),
        "time_proj.weight": (6 * h, h), "time_proj.bias": (6 * h,),
        "scale_shift_table": (1, 2, h),
        "proj_out.weight": (c["out_channels"] * math.prod(patch), h),
        "proj_out.bias": (c["out_channels"] * math.prod(patch),),
    }
    per_block = {
        "scale_shift_table": (1, 6, h),
        "self_attention.linear_qkv.weight": (3 * h, h), "self_attention.linear_qkv.bias": (3 * h,),
        "norm2.weight": (h,), "norm2.bias": (h,),
        "mlp.linear_fc1.weight": (f, h), "mlp.linear_fc1.bias": (f,),
        "mlp.linear_fc2.weight": (h, f), "mlp.linear_fc2.bias": (h,),
    }
    for attn in ("self_attention", "cross_attention"):
        per_block |= {f"{attn}.norm_q.weight": (h,), f"{attn}.norm_k.weight": (h,),
                      f"{attn}.linear_proj.weight": (h, h), f"{attn}.linear_proj.bias": (h,)}
    for p in "qkv":
        per_block |= {f"cross_attention.linear_{p}.weight": (h, h), f"cross_attention.linear_{p}.bias": (h,)}
    for layer in range(c["num_layers"]):
        for suffix, shape in per_block.items():
            shapes[f"layers.{layer}.{suffix}"] = shape
    return shapes


def parameter_count(name_or_config: str | dict[str, Any]) -> int:
    """Exact parameter count of the full model."""
    return sum(math.prod(s) for s in megatron_shapes(name_or_config).values())


def per_rank_parameter_counts(name_or_config: str | dict[str, Any], tp: int, pp: int = 1) -> list[int]:
    """Parameters held by one rank of each pipeline stage at tensor-parallel size `tp` (index = stage);
    replicated tensors count on every rank that holds them (the timestep embedder and projection on every
    stage)."""
    c = hf_config(name_or_config)
    return shards.stage_parameter_counts(all_mappings(c["num_layers"]), megatron_shapes(c), c["num_layers"],
                                         c["num_attention_heads"], tp, pp)
