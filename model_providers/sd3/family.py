"""The SD3.5 MMDiT family's bundle (see `model_providers.registry`): the Megatron model (tensor parallel), its
presets, load/export of diffusers-named weights, the offline tiny pipeline, checkpoint conversion and the bridge
parts into the embedded diffusers engine (`rollout/diffusers_engines/sd3.py`) and into vLLM-Omni's SD3
module (`rollout_layouts.py`, sampled by `rollout/vllm_omni/image_pipelines.py`)."""

from __future__ import annotations

from model_providers.qwen_image.mapping import hf_to_megatron, megatron_to_hf
from model_providers.registry import DiTTraits, ModelFamily, TinyPipeline
from model_providers.sd3 import presets, provider
from model_providers.sd3.rollout_layouts import QUANTIZED_LINEARS

FAMILY = ModelFamily(
    name="sd3",
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
    megatron_module="megatron_omni.models.dit.sd3_model:SD3Model",
    tiny_pipeline=TinyPipeline(make=provider.make_tiny_pipeline, transformer_config=provider.tiny_transformer_config),
    # FP8 rollout on both engines (the embedded one fake-quantizes these linears, vLLM-Omni holds them in FP8)
    quantized_linears=QUANTIZED_LINEARS,
    # Images as [b, c, H, W] latents carried as packed p x p patch tokens (one token = c x p x p values); SD3.5's
    # pooled CLIP embedding rides in the trajectory; true CFG is flow_grpo's plain (unrescaled) guidance, chosen by
    # the engine and recorded in the trajectory; no Flash tail (SD3.5 samples a static-shift grid).
    traits=DiTTraits(pipeline_class="StableDiffusion3Pipeline",
                     token_channels=lambda c: int(c["in_channels"]) * int(c["patch_size"]) ** 2,
                     text_dim_key="joint_attention_dim", rollout_engines=("diffusers", "vllm_omni"), flash_tail=False,
                     pooled_dim_key="pooled_projection_dim"),
    diffusers_class="SD3Transformer2DModel",
    arch_config=provider.hf_config,
    config_mappings=provider.config_mappings,
    hf_to_megatron=hf_to_megatron,
    megatron_to_hf=megatron_to_hf,
)
