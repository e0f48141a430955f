"""The SD3.5 model provider: config from a preset or a diffusers config, the Megatron model for one rank,
loading/gathering diffusers-named weights, and the Megatron weight shapes from the config alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from model_providers import shards
from model_providers.registry import WeightPart
from model_providers.sd3.mapping import all_mappings
from model_providers.sd3.presets import preset
from model_providers.sd3.rollout_layouts import rollout_layout

if TYPE_CHECKING:
    from megatron_omni.models.dit.sd3_config import SD3Config
    from megatron_omni.models.dit.sd3_model import SD3Model

_HF_KEYS = ("sample_size", "patch_size", "in_channels", "out_channels", "num_layers", "attention_head_dim",
            "num_attention_heads", "joint_attention_dim", "caption_projection_dim", "pooled_projection_dim",
            "pos_embed_max_size", "dual_attention_layers", "qk_norm")


def hf_config(name_or_config: str | dict[str, Any]) -> dict[str, Any]:
    """The architecture keys of a diffusers `SD3Transformer2DModel` config (preset name or dict). Raises
    ValueError on a config this model cannot hold (no QK RMSNorm: SD3.0; caption width != heads x head dim)."""
    cfg = preset(name_or_config) if isinstance(name_or_config, str) else dict(name_or_config)
    cfg.setdefault("dual_attention_layers", ())
    missing = [k for k in _HF_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"diffusers SD3 config lacks {missing}")
    if cfg["qk_norm"] != "rms_norm":
        raise ValueError(f"SD3 qk_norm={cfg['qk_norm']!r} is not supported (only 'rms_norm', SD3.5)")
    inner = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    if cfg["caption_projection_dim"] != inner:
        raise ValueError(f"caption_projection_dim {cfg['caption_projection_dim']} must equal heads x head dim {inner}")
    out = {k: cfg[k] for k in _HF_KEYS}
    out["dual_attention_layers"] = tuple(int(i) for i in cfg["dual_attention_layers"])
    return out


def transformer_config(name_or_config: str | dict[str, Any], *, tp: int = 1, pp: int = 1, ulysses: int = 1,
                       ring: int = 1, params_dtype: torch.dtype = torch.float32, **overrides: Any) -> SD3Config:
    """The Megatron `SD3Config` of an SD3.5 transformer for a parallel layout."""
    from megatron_omni.models.dit.sd3_config import SD3Config  # megatron-core: only where a model is configured

    c = hf_config(name_or_config)
    hidden = c["num_attention_heads"] * c["attention_head_dim"]
    return SD3Config(**shards.layout_config(dict(
        num_layers=c["num_layers"], hidden_size=hidden, num_attention_heads=c["num_attention_heads"],
        kv_channels=c["attention_head_dim"], ffn_hidden_size=4 * hidden, in_channels=c["in_channels"],
        out_channels=c["out_channels"], patch_size=c["patch_size"], sample_size=c["sample_size"],
        joint_attention_dim=c["joint_attention_dim"], pooled_projection_dim=c["pooled_projection_dim"],
        pos_embed_max_size=c["pos_embed_max_size"], dual_attention_layers=c["dual_attention_layers"],
        qk_layernorm=True,
    ), tp=tp, pp=pp, ulysses=ulysses, ring=ring, params_dtype=params_dtype, overrides=overrides))


def config_mappings(config: SD3Config | dict[str, Any]) -> list:
    """The diffusers <-> Megatron mappings of a model config: the Megatron `SD3Config` or a diffusers config
    (preset name or dict). Which tensors a block has depends on more than the block count (SD3.5-M's
    dual-attention blocks), so this family declares `ModelFamily.config_mappings`."""
    if not isinstance(config, (str, dict)):  # the Megatron config
        return all_mappings(config.num_layers, config.dual_attention_layers)
    c = hf_config(config)
    return all_mappings(c["num_layers"], c["dual_attention_layers"])


_mappings = config_mappings



def _synced(mappings: list) -> list:
    # The sincos table is a constant both sides compute from the config (a buffer, not a parameter): never synced.
    return [m for m in mappings if m.megatron != "patch_embed.pos_embed"]


def weight_parts(name_or_config: str | dict[str, Any]) -> dict[str, WeightPart]:
    """The one part the bridge syncs ("transformer"): mappings, full shapes and the rollout engines' layouts."""
    c = hf_config(name_or_config)
    return {"transformer": WeightPart(_synced(config_mappings(c)), megatron_shapes(c), c["num_attention_heads"],
                                      c["num_layers"], rollout_layout)}


def megatron_sources(model: SD3Model) -> dict[str, dict[str, torch.Tensor]]:
    """{"transformer": this rank's Megatron tensors (local tp shards of its stage, the parameters' storage) by global
    name}."""
    tensors = shards.megatron_tensors(model, config_mappings(model.config))  # this stage's only, under PP
    return {"transformer": {m.megatron: tensors[m.megatron] for m in _synced(config_mappings(model.config))
                            if m.megatron in tensors}}


def tiny_transformer_config() -> dict[str, Any]:
    """The transformer config of the offline tiny pipeline (`model.pipeline=tiny`)."""
    from model_providers.sd3.tiny_pipeline import TinySD3PipelineConfig

    return TinySD3PipelineConfig().transformer_config()


def make_tiny_pipeline(folder: Path, seed: int) -> Path:
    """Write the offline tiny SD3.5 pipeline (seeded weights) to `folder`."""
    from model_providers.sd3.tiny_pipeline import make_tiny_pipeline as make

    return make(folder, seed=seed)


def build_model(config: SD3Config, groups, backend: str = "local") -> SD3Model:
    """This rank's stage of the model, its tensor-parallel shard (`groups`: `megatron_omni.parallel.ParallelGroups`)."""
    from megatron_omni.models.dit.sd3_model import SD3Model
    from model_providers.qwen_image.specs import layer_spec

    groups.layout.validate_model(num_heads=config.num_attention_heads, num_layers=config.num_layers)
    return SD3Model(config, layer_spec(backend), groups)


def load_hf_state_dict(model: SD3Model, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy diffusers-named full tensors into this rank's shards (every rank passes the same dict)."""
    shards.load_hf_tensors(model, hf_state, _mappings(model.config))


def stage_hf_tensors(model: SD3Model, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Diffusers-named full tensors, gathered over tp (collective over tp); `tensors` defaults to the model's
    parameters and buffers (pass `{name: p.grad}` to map gradients)."""
    return shards.gather_hf_tensors(model, _mappings(model.config), tensors)


def megatron_shapes(name_or_config: str | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every Megatron tensor, from the config alone (no tensors allocated)."""
    c = hf_config(name_or_config)
    h = c["num_attention_heads"] * c["attention_head_dim"]
    d, p, m = c["attention_head_dim"], c["patch_size"], c["pos_embed_max_size"]
    j, pooled = c["joint_attention_dim"], c["pooled_projection_dim"]
    out_dim = p * p * c["out_channels"]
    shapes = {
        "time_embedder.linear_1.weight": (h, 256), "time_embedder.linear_1.bias": (h,),
        "time_embedder.linear_2.weight": (h, h), "time_embedder.linear_2.bias": (h,),
        "pooled_embedder.linear_1.weight": (h, pooled), "pooled_embedder.linear_1.bias": (h,),
        "pooled_embedder.linear_2.weight": (h, h), "pooled_embedder.linear_2.bias": (h,),
        "patch_embed.proj.weight": (h, c["in_channels"], p, p), "patch_embed.proj.bias": (h,),
        "patch_embed.pos_embed": (1, m * m, h),
        "context_embedder.weight": (h, j), "context_embedder.bias": (h,),
        "norm_out.linear.weight": (2 * h, h), "norm_out.linear.bias": (2 * h,),
        "proj_out.weight": (out_dim, h), "proj_out.bias": (out_dim,),
    }
    attn = {"linear_qkv.weight": (3 * h, h), "linear_qkv.bias": (3 * h,), "q_layernorm.weight": (d,),
            "k_layernorm.weight": (d,), "linear_proj.weight": (h, h), "linear_proj.bias": (h,)}
    mlp = {"linear_fc1.weight": (4 * h, h), "linear_fc1.bias": (4 * h,), "linear_fc2.weight": (h, 4 * h),
           "linear_fc2.bias": (h,)}
    n = c["num_layers"]
    for layer in range(n):
        dual, pre_only = layer in c["dual_attention_layers"], layer == n - 1
        streams = {
            "img": dict(attn, **mlp, **{"adaln.weight": ((9 if dual else 6) * h, h),
                                        "adaln.bias": ((9 if dual else 6) * h,)}),
            "txt": dict(attn, **mlp, **{"adaln.weight": (6 * h, h), "adaln.bias": (6 * h,)}),
        }
        if dual:
            streams["img_attn2"] = dict(attn)
        if pre_only:
            streams["txt"] = {k: v for k, v in streams["txt"].items()
                              if not k.startswith(("linear_proj", "linear_fc"))}
            streams["txt"].update({"adaln.weight": (2 * h, h), "adaln.bias": (2 * h,)})
        for stream, tensors in streams.items():
            for suffix, shape in tensors.items():
                shapes[f"layers.{layer}.{stream}.{suffix}"] = shape
    return shapes


def parameter_count(name_or_config: str | dict[str, Any]) -> int:
    """Exact parameter count of the full model (diffusers' `num_parameters()`: the sincos table is a buffer)."""
    return sum(math.prod(s) for name, s in megatron_shapes(name_or_config).items() if name != "patch_embed.pos_embed")
