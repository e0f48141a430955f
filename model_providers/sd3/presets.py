"""SD3.5 transformer sizes, as diffusers `SD3Transformer2DModel` configs.

`tiny` (CPU tests) has a dual-attention first block, a plain middle block and the context-pre-only last block,
heads divisible by 2. `sd35-medium` and `sd35-large` are the published transformer/config.json of
stabilityai/stable-diffusion-3.5-medium and stabilityai/stable-diffusion-3.5-large (architecture keys).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        sample_size=32, patch_size=2, in_channels=4, out_channels=4, num_layers=3, attention_head_dim=8,
        num_attention_heads=4, joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=20,
        pos_embed_max_size=12, dual_attention_layers=(0,), qk_norm="rms_norm",
    ),
    # The published transformer/config.json of stabilityai/stable-diffusion-3.5-medium (2.5B).
    "sd35-medium": dict(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24, attention_head_dim=64,
        num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048,
        pos_embed_max_size=384, dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
    ),
    # The published transformer/config.json of stabilityai/stable-diffusion-3.5-large (8B).
    "sd35-large": dict(
        sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=38, attention_head_dim=64,
        num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048,
        pos_embed_max_size=192, dual_attention_layers=(), qk_norm="rms_norm",
    ),
}


def preset(name: str) -> dict[str, Any]:
    """A copy of the diffusers config of preset `name` ('tiny', 'sd35-medium', 'sd35-large')."""
    if name not in PRESETS:
        raise KeyError(f"unknown SD3 preset {name!r}; known: {sorted(PRESETS)}")
    return dict(PRESETS[name])
