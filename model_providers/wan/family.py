"""The Wan video DiT family's bundle (see `model_providers.registry`)."""

from __future__ import annotations

import math

from model_providers.qwen_image.mapping import hf_to_megatron, megatron_to_hf
from model_providers.registry import DiTTraits, ModelFamily, TinyPipeline
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
    megatron_module="megatron_omni.models.dit.wan_model:WanModel",
    tiny_pipeline=TinyPipeline(make=provider.make_tiny_pipeline, transformer_config=provider.tiny_transformer_config),
    # Video (4k + 1 frames: Wan's VAE compresses time 4x); true CFG is WanPipeline's plain (unrescaled) guidance,
    # chosen by the engine and recorded in the trajectory; both engines sample it (vLLM-Omni through our SDE class
    # over its Wan2.2 pipeline, rollout/vllm_omni/wan_pipeline.py); what the trainer does not support on Wan yet:
    # MixGRPO-Flash's tail (Wan samples a static-shift grid): rollout/diffusers_engines/wan.py.
    traits=DiTTraits(pipeline_class="WanPipeline", text_dim_key="text_dim", video=True, frame_multiple=4,
                     token_channels=lambda c: int(c["in_channels"]) * math.prod(c["patch_size"]),
                     rollout_engines=("diffusers", "vllm_omni"), flash_tail=False),
    diffusers_class="WanTransformer3DModel",
    arch_config=provider.hf_config,
    mappings=mapping.all_mappings,
    hf_to_megatron=hf_to_megatron,
    megatron_to_hf=megatron_to_hf,
)
