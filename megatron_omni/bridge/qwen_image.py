"""The bridge bound to the Qwen-Image provider: its plan from a preset/config, and a model's shards by name."""

from __future__ import annotations

from typing import Any

import torch

from megatron_omni.bridge.plan import SyncPlan, plan_sync
from model_providers.qwen_image import provider
from model_providers.qwen_image.mapping import ParamMapping, all_mappings
from model_providers.qwen_image.rollout_layouts import rollout_layout


def qwen_image_plan(
    name_or_config: str | dict[str, Any],
    *,
    trainer_tp: int,
    trainer_pp: int = 1,
    rollout_kind: str = "vllm_omni",
    rollout_tp: int = 1,
    mode: str = "full",
    mappings: list[ParamMapping] | None = None,
) -> SyncPlan:
    """The sync plan of a Qwen-Image transformer (preset name or diffusers config); shapes only.

    `mappings` overrides the provider's Megatron <-> diffusers mappings (tests pass broken ones).
    """
    cfg = provider.hf_config(name_or_config)
    return plan_sync(
        mappings if mappings is not None else all_mappings(cfg["num_layers"]),
        provider.megatron_shapes(cfg),
        num_heads=cfg["num_attention_heads"],
        num_layers=cfg["num_layers"],
        layout=rollout_layout(rollout_kind),
        trainer_tp=trainer_tp,
        trainer_pp=trainer_pp,
        rollout_tp=rollout_tp,
        mode=mode,
    )


def sync_mode(trainer_tp: int, trainer_pp: int, rollout_tp: int) -> str:
    """The bridge mode a vLLM-Omni sync uses: `direct` when each rollout rank's shard is its trainer rank's
    (same tp, one pipeline stage), else `full` (gathered over tp and pp, then split the engine's way)."""
    return "direct" if trainer_tp == rollout_tp and trainer_pp == 1 else "full"


def megatron_sources(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's Megatron tensors (local tp shards of its stage) by global Megatron name.

    The tensors are the parameters' storage, so a sync after an optimizer step reads the new values.
    """
    state = model.state_dict(keep_vars=True)
    return {m.megatron: state[name].detach() for name, m in provider.local_mappings(model).items()}
