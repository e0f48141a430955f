"""Megatron shards -> rollout layouts: a pure planner (what goes where), transports (how bytes move), the
sync that runs a plan bucket by bucket, and the coverage check that follows every sync."""

from megatron_omni.bridge.coverage import CoverageError, CoverageLedger, check_plan
from megatron_omni.bridge.plan import MODES, Piece, PlanError, Region, RolloutParam, SourceTensor, SyncPlan, plan_sync
from megatron_omni.bridge.sync import DEFAULT_BUCKET_BYTES, SyncStats, WeightSync
from megatron_omni.bridge.targets import DiffusersTarget, RolloutTarget, VllmOmniTarget
from megatron_omni.bridge.transport import DistributedTransport, InProcessTransport, Transport

__all__ = [
    "DEFAULT_BUCKET_BYTES", "MODES", "CoverageError", "CoverageLedger", "DiffusersTarget", "DistributedTransport",
    "InProcessTransport", "Piece", "PlanError", "Region", "RolloutParam", "RolloutTarget", "SourceTensor",
    "SyncPlan", "SyncStats", "Transport", "VllmOmniTarget", "WeightSync", "check_plan", "plan_sync",
]
