"""The Qwen-Image family's plan by preset name or config (what benchmarks, tests and the planner call); the
trainer goes through `family_sync.family_plans` with whatever family its config names."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from megatron_omni.bridge.family_sync import plan_part, sync_mode
from megatron_omni.bridge.plan import SyncPlan
from model_providers import get_family
from model_providers.qwen_image.mapping import ParamMapping

__all__ = ["megatron_sources", "qwen_image_plan", "sync_mode"]


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
    part = get_family("qwen_image").weight_parts(name_or_config)["transformer"]
    if mappings is not None:
        part = replace(part, mappings=mappings)
    return plan_part(part, trainer_tp=trainer_tp, trainer_pp=trainer_pp, rollout_kind=rollout_kind,
                     rollout_tp=rollout_tp, mode=mode)


def megatron_sources(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's Megatron tensors of a Qwen-Image model (local tp shards of its stage) by global name."""
    return get_family("qwen_image").megatron_sources(model)["transformer"]
