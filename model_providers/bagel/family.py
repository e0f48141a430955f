"""The BAGEL family's bundle (see `model_providers.registry`): a Mixture-of-Transformers model whose generation
expert makes images; its state is the BAGEL-named (`ema.safetensors`) dict of the tensors our Megatron model
holds. Trained by its own trainer (`megatron_omni.trainer.bagel`: FlowGRPO on text-to-image, vLLM-Omni's BAGEL
pipeline as the rollout)."""

from __future__ import annotations

from typing import Any

from model_providers.bagel import presets, provider
from model_providers.registry import ModelFamily


def _build(cfg: Any, groups: Any, backend: str = "local", params_dtype: Any = None) -> Any:
    import torch

    if backend != "local":
        raise ValueError(f"BAGEL builds Megatron-Core local linears only, not backend={backend!r}")
    return provider.build_model(cfg, groups, params_dtype=params_dtype or torch.float32)


FAMILY = ModelFamily(
    name="bagel",
    kind="mot",
    presets=tuple(sorted(presets.BAGEL_PRESETS)),
    config=provider.bagel_config,
    build_model=_build,
    load_state=provider.load_bagel_state,
    export_state=provider.export_bagel_state,
    megatron_shapes=provider.megatron_shapes,
    weight_parts=provider.weight_parts,
    megatron_sources=provider.megatron_sources,
    trainer="megatron_omni.trainer.bagel",
)
