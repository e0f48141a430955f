"""AR-DiT sizes: decoder configs as Hugging Face `Qwen2Config` dicts, and hybrid pairings with a Qwen-Image
DiT preset.

`tiny` is for CPU tests (query groups divisible by 2 so tp=2 applies, an even layer count for pp=2);
`7b` is Qwen2.5-7B's architecture (its hidden width, 3584, is the width Qwen-Image's text stream was
trained on). Hybrids name a decoder preset and a DiT preset (`model_providers.qwen_image.presets`).
"""

from __future__ import annotations

from typing import Any

DECODER_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, hidden_act="silu",
    ),
    "7b": dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rms_norm_eps=1e-6,
        rope_theta=1000000.0, tie_word_embeddings=False, hidden_act="silu",
    ),
}

# Hybrid presets: decoder preset, DiT preset, and the special tokens the rollout uses.
HYBRID_PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(decoder="tiny", dit="tiny", eos_token_id=1, pad_token_id=0),
    "7b+20b": dict(decoder="7b", dit="20b", eos_token_id=151645, pad_token_id=151643),
}


def decoder_preset(name: str) -> dict[str, Any]:
    """A copy of the Qwen2Config dict of decoder preset `name` ('tiny', '7b')."""
    if name not in DECODER_PRESETS:
        raise KeyError(f"unknown AR decoder preset {name!r}; known: {sorted(DECODER_PRESETS)}")
    return dict(DECODER_PRESETS[name])


def hybrid_preset(name: str) -> dict[str, Any]:
    """A copy of hybrid preset `name` ('tiny', '7b+20b')."""
    if name not in HYBRID_PRESETS:
        raise KeyError(f"unknown AR-DiT preset {name!r}; known: {sorted(HYBRID_PRESETS)}")
    return dict(HYBRID_PRESETS[name])
