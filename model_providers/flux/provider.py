"""The FLUX.1 model provider: config from a preset or a diffusers config, the Megatron model for one rank,
loading/gathering diffusers-named weights, and the Megatron weight shapes from the config alone."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from model_providers import shards
from model_providers.flux.mapping import all_mappings
from model_providers.flux.presets import preset
from model_providers.flux.rollout_layouts import rollout_layout
from model_providers.registry import WeightPart

if TYPE_CHECKING:
    from megatron_omni.models.dit.flux_config import FluxConfig
    from megatron_omni.models.dit.flux_model import FluxModel

_HF_KEYS = ("patch_size", "in_channels", "out_channels", "num_layers", "num_single_layers", "attention_head_dim",
            "num_attention_heads", "joint_attention_dim", "pooled_projection_dim", "guidance_embeds",
            "axes_dims_rope")


def hf_config(name_or_config: str | dict[str, Any]) -> dict[str, Any]:
    """The architecture keys of a diffusers `FluxTransformer2DModel` config (preset name or dict), with
    `out_channels` resolved (diffusers: None = in_channels). Raises ValueError on a config this model cannot hold
    (RoPE axes that do not sum to the head dim)."""
    cfg = preset(name_or_config) if isinstance(name_or_config, str) else dict(name_or_config)
    missing = [k for k in _HF_KEYS if k not in cfg and k != "out_channels"]
    if missing:
        raise ValueError(f"diffusers FLUX config lacks {missing}")
    out = {k: cfg.get(k) for k in _HF_KEYS}
    out["out_channels"] = out["out_channels"] or out["in_channels"]
    out["axes_dims_rope"] = tuple(int(a) for a in out["axes_dims_rope"])
    out["guidance_embeds"] = bool(out["guidance_embeds"])
    if sum(out["axes_dims_rope"]) != out["attention_head_dim"]:
        raise ValueError(f"axes_dims_rope {out['axes_dims_rope']} must sum to attention_head_dim "
                         f"{out['attention_head_dim']}")
    return out


def transformer_config(name_or_config: str | dict[str, Any], *, tp: int = 1, pp: int = 1, ulysses: int = 1,
                       ring: int = 1, params_dtype: torch.dtype = torch.float32, **overrides: Any) -> FluxConfig:
    """The Megatron `FluxConfig` of a FLUX.1 transformer for a parallel layout."""
    from megatron_omni.models.dit.flux_config import FluxConfig  # megatron-core: only where a model is configured

    c = hf_config(name_or_config)
    hidden = c["num_attention_heads"] * c["attention_head_dim"]
    return FluxConfig(**shards.layout_config(dict(
        num_layers=c["num_layers"], num_single_layers=c["num_single_layers"], hidden_size=hidden,
        num_attention_heads=c["num_attention_heads"], kv_channels=c["attention_head_dim"], ffn_hidden_size=4 * hidden,
        in_channels=c["in_channels"], out_channels=c["out_channels"], patch_size=c["patch_size"],
        joint_attention_dim=c["joint_attention_dim"], pooled_projection_dim=c["pooled_projection_dim"],
        guidance_embeds=c["guidance_embeds"], axes_dims_rope=c["axes_dims_rope"], qk_layernorm=True,
    ), tp=tp, pp=pp, ulysses=ulysses, ring=ring, params_dtype=params_dtype, overrides=overrides))


def config_mappings(config: FluxConfig | dict[str, Any] | str) -> list:
    """The diffusers <-> Megatron mappings of a model config (the Megatron `FluxConfig`, or a diffusers config or
    preset name): which tensors the model has depends on more than `num_layers` (the single blocks, the guidance
    embedder), so this family declares `ModelFamily.config_mappings`."""
    if not isinstance(config, (str, dict)):  # the Megatron config
        return all_mappings(config.num_layers, config.num_single_layers, config.guidance_embeds)
    c = hf_config(config)
    return all_mappings(c["num_layers"], c["num_single_layers"], c["guidance_embeds"])



def weight_parts(name_or_config: str | dict[str, Any]) -> dict[str, WeightPart]:
    """The one part the bridge syncs ("transformer"): mappings, full shapes and the rollout engines' layouts; its
    blocks are the double then the single ones (`num_layers` counts both)."""
    c = hf_config(name_or_config)
    return {"transformer": WeightPart(config_mappings(c), megatron_shapes(c), c["num_attention_heads"],
                                      c["num_layers"] + c["num_single_layers"], rollout_layout)}


def megatron_sources(model: FluxModel) -> dict[str, dict[str, torch.Tensor]]:
    """{"transformer": this rank's Megatron tensors (local tp shards, the parameters' storage) by global name}."""
    return {"transformer": shards.megatron_tensors(model, config_mappings(model.config))}


def tiny_transformer_config() -> dict[str, Any]:
    """The transformer config of the offline tiny pipeline (`model.pipeline=tiny`)."""
    from model_providers.flux.tiny_pipeline import TinyFluxPipelineConfig

    return TinyFluxPipelineConfig().transformer_config()


def make_tiny_pipeline(folder: Path, seed: int) -> Path:
    """Write the offline tiny FLUX.1 pipeline (seeded weights) to `folder`."""
    from model_providers.flux.tiny_pipeline import make_tiny_pipeline as make

    return make(folder, seed=seed)


def build_model(config: FluxConfig, groups, backend: str = "local") -> FluxModel:
    """This rank's stage of the model, its tensor-parallel shard (`groups`: `megatron_omni.parallel.ParallelGroups`);
    pipeline stages split the double and single blocks together, in model order."""
    from megatron_omni.models.dit.flux_model import FluxModel
    from model_providers.flux.specs import layer_spec

    groups.layout.validate_model(num_heads=config.num_attention_heads,
                                 num_layers=config.num_layers + config.num_single_layers)
    return FluxModel(config, layer_spec(backend), groups)


def load_hf_state_dict(model: FluxModel, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy diffusers-named full tensors into this rank's shards (every rank passes the same dict)."""
    shards.load_hf_tensors(model, hf_state, config_mappings(model.config))


def stage_hf_tensors(model: FluxModel, tensors: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Diffusers-named full tensors, gathered over tp (collective over tp); `tensors` defaults to the model's
    parameters (pass `{name: p.grad}` to map gradients)."""
    return shards.gather_hf_tensors(model, config_mappings(model.config), tensors)


def megatron_shapes(name_or_config: str | dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Full (unsharded) shape of every Megatron tensor, from the config alone (no tensors allocated)."""
    c = hf_config(name_or_config)
    d = c["attention_head_dim"]
    h = c["num_attention_heads"] * d
    out_dim = c["patch_size"] ** 2 * c["out_channels"]

    def linear(name: str, n_out: int, n_in: int) -> dict[str, tuple[int, ...]]:
        return {f"{name}.weight": (n_out, n_in), f"{name}.bias": (n_out,)}

    shapes = {**linear("time_embedder.linear_1", h, 256), **linear("time_embedder.linear_2", h, h),
              **linear("pooled_embedder.linear_1", h, c["pooled_projection_dim"]),
              **linear("pooled_embedder.linear_2", h, h), **linear("x_embedder", h, c["in_channels"]),
              **linear("context_embedder", h, c["joint_attention_dim"]), **linear("norm_out.linear", 2 * h, h),
              **linear("proj_out", out_dim, h)}
    if c["guidance_embeds"]:
        shapes |= {**linear("guidance_embedder.linear_1", h, 256), **linear("guidance_embedder.linear_2", h, h)}
    norms = {"q_layernorm.weight": (d,), "k_layernorm.weight": (d,)}
    stream = {**linear("adaln", 6 * h, h), **linear("linear_qkv", 3 * h, h), **linear("linear_proj", h, h),
              **linear("linear_fc1", 4 * h, h), **linear("linear_fc2", h, 4 * h), **norms}
    single = {**linear("adaln", 3 * h, h), **linear("linear_qkv", 3 * h, h), **linear("linear_fc1", 4 * h, h),
              **linear("linear_out", h, 5 * h), **norms}
    for layer in range(c["num_layers"]):
        for s in ("img", "txt"):
            shapes |= {f"layers.{layer}.{s}.{k}": v for k, v in stream.items()}
    for index in range(c["num_single_layers"]):
        shapes |= {f"single_layers.{index}.{k}": v for k, v in single.items()}
    return shapes


def parameter_count(name_or_config: str | dict[str, Any]) -> int:
    """Exact parameter count of the full model (diffusers' `num_parameters()`)."""
    return sum(math.prod(s) for s in megatron_shapes(name_or_config).values())
