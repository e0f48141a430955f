"""One planned job as plain values (what a dry run plans), its plan and its peak memory with the extra
weight copies the trainer keeps (KL reference, EMA) that the memory model's total leaves out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_omni.parallel.layout import ParallelLayout
from megatron_omni.planner.disaggregated import DisaggregatedReport, plan_disaggregated
from megatron_omni.planner.plan import plan
from megatron_omni.planner.report import PlanReport
from megatron_omni.planner.specs import DEFAULT_MFU, LoRASpec, Precision, RolloutSpec, Workload


@dataclass(frozen=True)
class StateCopy:
    """One more copy of this rank's weight shard that the trainer keeps: `label` names it (with the config
    field that asks for it), `bytes_per_param` its width."""

    label: str
    bytes_per_param: int


@dataclass(frozen=True)
class JobPlan:
    """Everything a dry run plans with, as plain values. model: a preset name or diffusers config;
    model_source: where it came from (printed); gpu: a key of `GPUS`; world_size: trainer ranks; the names
    (`rollout_engine`, dtypes, `backend`) are printed and select the bridge plan; lora: adapters on a frozen
    base (None: full fine-tuning; its KL reference is no state copy); rollout_gpus > 0: a disaggregated job whose
    `world_size` trainer ranks train while that many rollout ranks of their own roll out
    (`planner.disaggregated`); limits: what the trainer cannot run yet with this job (printed after the plan;
    the dry run then refuses it)."""

    model: str | dict[str, Any]
    model_source: str
    layout: ParallelLayout
    world_size: int
    gpu: str
    workload: Workload
    rollout: RolloutSpec
    precision: Precision
    recompute: str = "none"
    mfu: float = DEFAULT_MFU
    mfu_source: str | None = None
    gpus_per_node: int = 8
    reward_gpus: int = 0
    state_copies: tuple[StateCopy, ...] = ()
    rollout_engine: str = "diffusers"
    params_dtype: str = "bf16"
    rollout_dtype: str = "bf16"
    backend: str = "local"
    lora: LoRASpec | None = None
    rollout_gpus: int = 0
    limits: tuple[str, ...] = ()


def plan_disaggregated_job(job: JobPlan) -> DisaggregatedReport:
    """The planner's disaggregated report for `job` (rollout_gpus > 0); raises LayoutError as `plan_job`."""
    return plan_disaggregated(job.model, job.layout, job.world_size, job.rollout_gpus, job.gpu, job.workload,
                              rollout=job.rollout, precision=job.precision, recompute=job.recompute,
                              gpus_per_node=job.gpus_per_node, reward_gpus=job.reward_gpus, mfu=job.mfu,
                              lora=job.lora)


def plan_job(job: JobPlan) -> PlanReport:
    """The planner's report for `job`; raises LayoutError for a layout that cannot run."""
    return plan(job.model, job.layout, job.world_size, job.gpu, job.workload, rollout=job.rollout,
                precision=job.precision, recompute=job.recompute, gpus_per_node=job.gpus_per_node,
                reward_gpus=job.reward_gpus, mfu=job.mfu, lora=job.lora)


def copy_bytes(job: JobPlan, report: PlanReport) -> list[tuple[StateCopy, int]]:
    """Bytes per GPU of each extra weight copy (on the fullest pipeline stage)."""
    return [(c, c.bytes_per_param * max(report.stage_parameters)) for c in job.state_copies]


def total_bytes(job: JobPlan, report: PlanReport) -> int:
    """Peak bytes per GPU: the memory model's total plus the extra weight copies."""
    return report.memory.total + sum(n for _, n in copy_bytes(job, report))


def fits(job: JobPlan, report: PlanReport) -> bool:
    """Whether the job's peak, extra copies included, fits in the GPU's memory."""
    return report.memory.fits and total_bytes(job, report) <= report.memory.capacity
