"""The AR-DiT hybrid family's bundle (decoder + connector + Qwen-Image DiT; see `model_providers.registry`).
Its state is the (decoder, connector, DiT) triple of Hugging Face-layout dicts."""

from __future__ import annotations

from typing import Any

from model_providers.ar_dit import presets, provider
from model_providers.registry import ModelFamily


def _load(model: Any, state: tuple[dict, dict, dict]) -> None:
    provider.load_hf_state(model, *state)


FAMILY = ModelFamily(
    name="ar_dit",
    kind="ar_dit",
    presets=tuple(sorted(presets.HYBRID_PRESETS)),
    config=provider.hybrid_config,
    build_model=provider.build_model,
    load_state=_load,
    export_state=provider.hf_state,
    megatron_shapes=provider.megatron_shapes,
    reference_model=provider.torch_hybrid,
    weight_parts=provider.weight_parts,
    megatron_sources=provider.megatron_sources,
)
