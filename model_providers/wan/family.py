"""The Wan video DiT family's bundle (see `model_providers.registry`)."""

from __future__ import annotations

from megatron_omni.models.dit.wan_model import WanModel
from model_providers.qwen_image.mapping import hf_to_megatron, megatron_to_hf
from model_providers.registry import ModelFamily, TinyPipeline
from model_providers.wan import mapping, presets, provider

FAMILY = ModelFamily(
    name="wan",
    kind="dit",
    presets=tuple(sorted(presets.PRESETS)),
    config=provider.hf_config,
    build_model=provider.build_model,
    load_state=provider.load_hf_state_dict,
    export_state=provider.stage_hf_tensors,
    megatron_shapes=provider.megatron_shapes,
    megatron_config=provider.transformer_config,
    weight_parts=provider.weight_parts,
    megatron_sources=provider.megatron_sources,
    megatron_module=WanModel,
    tiny_pipeline=TinyPipeline(make=provider.make_tiny_pipeline, transformer_config=provider.tiny_transformer_config),
    diffusers_class="WanTransformer3DModel",
    arch_config=provider.hf_config,
    mappings=mapping.all_mappings,
    hf_to_megatron=hf_to_megatron,
    megatron_to_hf=megatron_to_hf,
)
