"""The dry-run planner: a pure cost model of a FlowGRPO job (per-GPU memory, step time, weight-sync size) and
the advice it checks before giving it. No GPU, no process group, no trainer: it reads plain dataclasses.

Modules: `specs` (GPU kinds, workload, rollout engine, precision), `arch` (each MMDiT family's view of its
transformer and pipeline: Qwen-Image, Qwen-Image-Edit's source tokens, SD3.5), `flops` (FLOPs of one forward), `memory`
(per-GPU bytes), `plan` (validation and the time model), `report` (what is printed), `job` (one job as plain
values), `advice` (changes that fit, each planned again), `dry_run` (the printout and exit status),
`disaggregated` (trainer and rollout on GPUs of their own, overlapped at staleness 1).
"""

from megatron_omni.planner.job import JobPlan, StateCopy, plan_job
from megatron_omni.planner.plan import plan, validate
from megatron_omni.planner.report import PlanReport, TimeReport, measured_mfu, reference_implied_mfu
from megatron_omni.planner.specs import (
    DEFAULT_MFU,
    DTYPE_BYTES,
    GPUS,
    REFERENCE_GPUS,
    REFERENCE_IMAGES_PER_S_PER_GPU,
    REFERENCE_STEP_S,
    GPUSpec,
    LoRASpec,
    Precision,
    RolloutSpec,
    Workload,
)

__all__ = ["DEFAULT_MFU", "DTYPE_BYTES", "GPUS", "REFERENCE_GPUS", "REFERENCE_IMAGES_PER_S_PER_GPU", "REFERENCE_STEP_S",
           "GPUSpec", "JobPlan", "LoRASpec", "PlanReport", "Precision", "RolloutSpec", "StateCopy",
           "TimeReport", "Workload", "measured_mfu", "plan", "plan_job", "reference_implied_mfu", "validate"]
