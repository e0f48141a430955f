"""FLUX.1 transformer sizes, as diffusers `FluxTransformer2DModel` configs.

`tiny` (CPU tests): two double-stream and two single-stream blocks, 4 heads of 16 (heads divisible by 2), the
published model's packed latent width (64 = FLUX's 16 VAE channels x 2 x 2) and guidance embedding. `flux1-dev` is
the published transformer/config.json of black-forest-labs/FLUX.1-dev (12B; architecture keys).
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=1, in_channels=64, out_channels=None, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=32, pooled_projection_dim=16, guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ),
    # The published transformer/config.json of black-forest-labs/FLUX.1-dev (12B, guidance-distilled).
    "flux1-dev": dict(
        patch_size=1, in_channels=64, out_channels=None, num_layers=19, num_single_layers=38, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56),
    ),
}


def preset(name: str) -> dict[str, Any]:
    """A copy of the diffusers config of preset `name` ('tiny', 'flux1-dev')."""
    if name not in PRESETS:
        raise KeyError(f"unknown FLUX preset {name!r}; known: {sorted(PRESETS)}")
    return dict(PRESETS[name])
