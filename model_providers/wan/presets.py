"""Wan transformer sizes, as diffusers `WanTransformer3DModel` configs (text-to-video: no image embedder, no
added k/v projections).

`tiny` is for CPU tests (4 heads, so tp/ulysses up to 4 apply; 2 blocks for pp=2), `small` for CPU benchmarks
(a few million parameters: benchmarks/dit_step.py --family wan). The published shapes are the
diffusers configs `scripts/convert_wan_to_diffusers.py` of diffusers writes for Wan-AI's checkpoints
(`Wan-T2V-1.3B`, `Wan-T2V-14B`, `Wan2.2-TI2V-5B`; `Wan2.2-T2V-A14B`'s two experts each have the 14B's config);
`PARAMS` holds their exact parameter counts, checked on the
meta device against diffusers' module built from each config (tests/unit/test_wan_provider.py).
"""

from __future__ import annotations

from typing import Any

_COMMON = dict(patch_size=(1, 2, 2), attention_head_dim=128, freq_dim=256, text_dim=4096, cross_attn_norm=True,
               qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4,
                 text_dim=32, freq_dim=32, ffn_dim=128, num_layers=2, cross_attn_norm=True,
                 qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    "small": dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=32, in_channels=16,
                  out_channels=16, text_dim=128, freq_dim=256, ffn_dim=1024, num_layers=4, cross_attn_norm=True,
                  qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    # Wan2.1-T2V-1.3B: dim 1536
    "wan2.1-t2v-1.3b": dict(_COMMON, num_attention_heads=12, in_channels=16, out_channels=16, ffn_dim=8960,
                            num_layers=30),
    # Wan2.1-T2V-14B: dim 5120
    "wan2.1-t2v-14b": dict(_COMMON, num_attention_heads=40, in_channels=16, out_channels=16, ffn_dim=13824,
                           num_layers=40),
    # Wan2.2-T2V-A14B: two experts (high- and low-noise), each of Wan2.1-T2V-14B's shape (EXPERTS)
    "wan2.2-t2v-a14b": dict(_COMMON, num_attention_heads=40, in_channels=16, out_channels=16, ffn_dim=13824,
                            num_layers=40),
    # Wan2.2-TI2V-5B: dim 3072, its own 48-channel VAE (4 x 16 x 16 compression)
    "wan2.2-ti2v-5b": dict(_COMMON, num_attention_heads=24, in_channels=48, out_channels=48, ffn_dim=14336,
                           num_layers=30),
}

# Exact parameter counts of diffusers' WanTransformer3DModel with each preset's config.
PARAMS = {
    "wan2.1-t2v-1.3b": 1_418_996_800,
    "wan2.1-t2v-14b": 14_288_491_584,
    "wan2.2-ti2v-5b": 4_999_787_712,
}


# Transformers of this shape a preset's pipeline holds (Wan2.2 A14B: `transformer` and `transformer_2`, switched at
# a boundary timestep; model_providers/wan/experts.py): all resident in the rollout engine, one trained.
EXPERTS = {"wan2.2-t2v-a14b": 2}


def preset(name: str) -> dict[str, Any]:
    """A copy of the diffusers config of preset `name`."""
    if name not in PRESETS:
        raise KeyError(f"unknown Wan preset {name!r}; known: {sorted(PRESETS)}")
    return dict(PRESETS[name])
