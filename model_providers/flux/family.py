"""The FLUX.1 family's bundle (see `model_providers.registry`): the Megatron model (tensor parallel), its presets,
load/export of diffusers-named weights, the offline tiny pipeline, checkpoint conversion and the bridge part into the
embedded diffusers engine (`rollout/diffusers_engines/flux.py`) and into vLLM-Omni's FLUX module (`rollout_layouts.py`,
sampled by `rollout/vllm_omni/image_pipelines.py`)."""

from __future__ import annotations

from model_providers.flux import presets, provider
from model_providers.flux.rollout_layouts import QUANTIZED_LINEARS
from model_providers.qwen_image.mapping import hf_to_megatron, megatron_to_hf
from model_providers.registry import DiTTraits, ModelFamily, TinyPipeline

FAMILY = ModelFamily(
    name="flux",
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
    megatron_module="megatron_omni.models.dit.flux_model:FluxModel",
    tiny_pipeline=TinyPipeline(make=provider.make_tiny_pipeline, transformer_config=provider.tiny_transformer_config),
    # FP8 rollout on both engines (the embedded one fake-quantizes these linears, vLLM-Omni holds them in FP8)
    quantized_linears=QUANTIZED_LINEARS,
    # Images as FLUX's packed 2 x 2 latent patches (one token = in_channels values); the pooled CLIP embedding and
    # the distilled guidance scale ride in the trajectory; no true CFG (FLUX.1-dev is guidance-distilled); no Flash
    # tail (not wired for this engine); planned (planner.arch.flux_arch).
    traits=DiTTraits(pipeline_class="FluxPipeline",
                     token_channels=lambda c: int(c["in_channels"]) * int(c["patch_size"]) ** 2,
                     text_dim_key="joint_attention_dim", rollout_engines=("diffusers", "vllm_omni"), true_cfg=False,
                     flash_tail=False, pooled_dim_key="pooled_projection_dim",
                     guidance_embeds_key="guidance_embeds"),
    diffusers_class="FluxTransformer2DModel",
    arch_config=provider.hf_config,
    config_mappings=provider.config_mappings,
    hf_to_megatron=hf_to_megatron,
    megatron_to_hf=megatron_to_hf,
)
