"""The Qwen-Image-Edit family's bundle (see `model_providers.registry`).

The transformer is Qwen-Image's (`QwenImageTransformer2DModel`, the same Megatron `MMDiTModel`, mapping,
bridge plan and checkpoints); what differs is the image stream (source-image tokens appended:
`conditioning`), the pipeline (`QwenImageEditPlusPipeline`, with a Qwen2.5-VL processor reading image +
instruction) and the data (image + instruction records). Conversion of a transformer folder goes through the
`qwen_image` family: both name the same diffusers class, and one class must name one family.
"""

from __future__ import annotations

from dataclasses import replace

from model_providers.qwen_image import provider
from model_providers.qwen_image.family import FAMILY as QWEN_IMAGE
from model_providers.qwen_image_edit import tiny_pipeline
from model_providers.qwen_image_edit.data import negative_record
from model_providers.qwen_image_edit.panels import source_output_panels
from model_providers.registry import DiTTraits, TinyPipeline

FAMILY = replace(
    QWEN_IMAGE,
    name="qwen_image_edit",
    tiny_pipeline=TinyPipeline(make=lambda folder, seed: tiny_pipeline.make_tiny_edit_pipeline(folder, seed=seed),
                               transformer_config=provider.tiny_transformer_config),
    # Both engines: the embedded one and vLLM-Omni's edit plus pipeline under our SDE class
    # (`rollout/vllm_omni/edit_pipeline.py`, fed by Qwen-Image's bridge plan). True CFG as the edit pipeline applies
    # it (the negative prompt encoded with each record's sources, per-token rescale); the Flash tail is the Qwen-Image
    # engine's.
    traits=DiTTraits(pipeline_class="QwenImageEditPlusPipeline", token_channels=lambda c: int(c["in_channels"]),
                     text_dim_key="joint_attention_dim", rollout_engines=("diffusers", "vllm_omni"), conditioned=True,
                     true_cfg=True, sample_panels=source_output_panels, negative_text=negative_record),
    diffusers_class=None,
    arch_config=None,
    mappings=None,
    hf_to_megatron=None,
    megatron_to_hf=None,
)
