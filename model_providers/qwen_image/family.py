"""The Qwen-Image MMDiT family's bundle (see `model_providers.registry`)."""

from __future__ import annotations

from model_providers.qwen_image import mapping, presets, provider
from model_providers.qwen_image.rollout_layouts import QUANTIZED_LINEARS
from model_providers.registry import DiTTraits, ModelFamily, TinyPipeline

FAMILY = ModelFamily(
    name="qwen_image",
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
    megatron_module="megatron_omni.models.dit.model:MMDiTModel",
    tiny_pipeline=TinyPipeline(make=provider.make_tiny_pipeline, transformer_config=provider.tiny_transformer_config),
    quantized_linears=QUANTIZED_LINEARS,
    # Images: the pipeline packs 2 x 2 latent patches, so the transformer's in_channels is already a token's.
    traits=DiTTraits(pipeline_class="QwenImagePipeline", token_channels=lambda c: int(c["in_channels"]),
                     text_dim_key="joint_attention_dim", rollout_engines=("diffusers", "vllm_omni")),
    diffusers_class="QwenImageTransformer2DModel",
    arch_config=provider.hf_config,
    mappings=mapping.all_mappings,
    hf_to_megatron=mapping.hf_to_megatron,
    megatron_to_hf=mapping.megatron_to_hf,
)
