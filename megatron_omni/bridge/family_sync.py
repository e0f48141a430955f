"""A model family's sync plans, from the family bundle's data alone (`ModelFamily.weight_parts`): the one
planner every family goes through, so a new family brings mappings, shapes and layouts, not bridge code."""

from __future__ import annotations

from typing import Any

from megatron_omni.bridge.plan import PlanError, SyncPlan, plan_sync
from model_providers.registry import ModelFamily, WeightPart


def plan_part(part: WeightPart, *, trainer_tp: int, trainer_pp: int = 1, rollout_kind: str = "vllm_omni",
              rollout_tp: int = 1, mode: str = "full") -> SyncPlan:
    """The sync plan of one weight part into a rollout engine of kind `rollout_kind` at `rollout_tp`; raises
    PlanError naming the engine when the part has no layout there."""
    try:
        layout = part.layout(rollout_kind)
    except KeyError as e:
        raise PlanError(str(e.args[0])) from None
    return plan_sync(part.mappings, part.shapes, num_heads=part.num_heads, num_layers=part.num_layers,
                     layout=layout, trainer_tp=trainer_tp, trainer_pp=trainer_pp, rollout_tp=rollout_tp, mode=mode,
                     num_groups=part.num_groups)


def family_plans(family: ModelFamily, config: Any, **layout: Any) -> dict[str, SyncPlan]:
    """Every weight part's plan (`plan_part` with `layout`: trainer_tp, trainer_pp, rollout_kind, rollout_tp,
    mode), by part name, for a model of `family` with config `config`."""
    if family.weight_parts is None or family.megatron_sources is None:
        raise PlanError(f"model family {family.name!r} declares no weight parts for the bridge "
                        "(ModelFamily.weight_parts / megatron_sources)")
    return {name: plan_part(part, **layout) for name, part in family.weight_parts(config).items()}


def sync_mode(trainer_tp: int, trainer_pp: int, rollout_tp: int) -> str:
    """The bridge mode a sync into live tensor-parallel rollout shards uses: `direct` when each rollout rank's
    shard is its trainer rank's (same tp, one pipeline stage), else `full` (gathered over tp and pp, then split
    the engine's way)."""
    return "direct" if trainer_tp == rollout_tp and trainer_pp == 1 else "full"
