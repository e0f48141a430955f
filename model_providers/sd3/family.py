"""The SD3.5 MMDiT family's bundle (see `model_providers.registry`). This slice: the Megatron model (tensor
parallel), its presets, load/export of diffusers-named weights and the weight shapes; the rollout pipeline,
bridge parts and checkpoint conversion fields are not declared yet."""

from __future__ import annotations

from megatron_omni.models.dit.sd3_model import SD3Model
from model_providers.registry import DiTTraits, ModelFamily
from model_providers.sd3 import presets, provider

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
    megatron_module=SD3Model,
    # Images as [b, c, H, W] latents: the transformer patch-embeds them itself (one token = c x p x p values).
    traits=DiTTraits(pipeline_class="StableDiffusion3Pipeline",
                     token_channels=lambda c: int(c["in_channels"]) * int(c["patch_size"]) ** 2,
                     text_dim_key="joint_attention_dim", rollout_engines=("diffusers",)),
)
