"""Qwen-Image transformer sizes, as diffusers `QwenImageTransformer2DModel` configs.

`tiny` is for CPU tests (heads divisible by 2 and 4 so tp/ulysses up to 4 apply), `small` for CPU
benchmarks (a few million parameters), `20b` is the released model.
"""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
        num_attention_heads=4, joint_attention_dim=24, axes_dims_rope=(4, 6, 6),
    ),
    "small": dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=4, attention_head_dim=32,
        num_attention_heads=8, joint_attention_dim=128, axes_dims_rope=(8, 12, 12),
    ),
    "20b": dict(
        patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
        num_attention_heads=24, joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
    ),
}

# The released model's parameter count (diffusers' QwenImageTransformer2DModel, 20b config).
PARAMS_20B = 20_430_401_088


def preset(name: str) -> dict[str, Any]:
    """A copy of the diffusers config of preset `name` ('tiny', 'small', '20b')."""
    if name not in PRESETS:
        raise KeyError(f"unknown Qwen-Image preset {name!r}; known: {sorted(PRESETS)}")
    return dict(PRESETS[name])
