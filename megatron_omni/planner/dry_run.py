"""The dry run's printout for one planned job: the planner's table, the weight-sync plan, the extra weight
copies and, when the job does not fit, the changes that the planner checked fit. Returns the exit status."""

from __future__ import annotations

import sys
from collections.abc import Callable

from megatron_omni.bridge.family_sync import plan_part, sync_mode
from megatron_omni.planner.advice import suggest
from megatron_omni.planner.arch import arch_of
from megatron_omni.planner.job import JobPlan, copy_bytes, fits, plan_disaggregated_job, plan_job
from model_providers import get_family

FITS, DOES_NOT_FIT = 0, 3  # exit statuses of `python -m megatron_omni.train --dry-run`


def dry_run(job: JobPlan, replan: Callable[[tuple[str, ...], int], JobPlan]) -> int:
    """Print the plan of `job` and return 0 when it fits, 3 (and the checked advice) when it does not.
    `replan(overrides, world_size)`: the job those `--set` overrides and that world size give (see
    `planner.advice.suggest`). A disaggregated job (rollout_gpus > 0) prints its trainer ranks' table, then the
    disaggregated figures next to the colocated job on as many GPUs (no advice: it searches colocated changes).
    Raises LayoutError for a layout that cannot run."""
    split = plan_disaggregated_job(job) if job.rollout_gpus else None
    report = split.trainer if split is not None else plan_job(job)
    rollout = job.rollout
    # On the cluster vLLM-Omni's workers are processes of their own: its sync is full mode (bucketed RPCs).
    vllm = job.rollout_engine == "vllm_omni"
    mode = "full" if vllm else sync_mode(job.layout.tp, job.layout.pp, rollout.tp)
    arch = arch_of(job.model)
    part = get_family(arch.family).weight_parts(arch.config)["transformer"]
    sync = plan_part(part, trainer_tp=job.layout.tp, trainer_pp=job.layout.pp, rollout_kind=job.rollout_engine,
                     rollout_tp=rollout.tp, mode=mode)
    elements = sync.numel_per_rollout_rank()[0]
    ranks = (f"world size {job.world_size} trainer ranks" if split is None else
             f"world size {job.world_size + job.rollout_gpus} = {job.world_size} trainer ranks + {job.rollout_gpus} "
             "rollout ranks (disaggregated)")
    print(f"dry run: {ranks} + {job.reward_gpus} reward GPUs, model from {job.model_source}")
    print(f"precision: model {job.params_dtype} ({job.backend} layer spec), rollout {job.rollout_engine} engine "
          f"in {job.rollout_dtype} at tp={rollout.tp}"
          + (f"; MFU {job.mfu:.3f} from {job.mfu_source}" if job.mfu_source else ""))
    print(report.table())
    print(f"bridge: {len(sync.sources)} Megatron tensors -> {len(sync.params)} rollout parameters ({mode} mode, "
          f"{job.rollout_engine} engine tp={rollout.tp}), {elements:,} elements = "
          f"{elements * job.precision.rollout_param_bytes / 2**30:.2f} GiB {job.rollout_dtype} per rollout rank "
          "per sync")
    m = report.memory
    total = m.total
    for copy, nbytes in copy_bytes(job, report):
        total += nbytes
        print(f"{copy.label}: + {nbytes / 2**30:.1f} GiB per GPU -> {total / 2**30:.1f} GiB of "
              f"{m.capacity / 2**30:.1f} GiB")
    if split is not None:
        print("(the table's step runs the phases one after the other; the disaggregated step overlaps them:)")
        print(split.table())
        for limit in job.limits:
            print(f"not runnable yet: {limit}")
        if fits(job, report) and split.rollout_memory.fits:
            print("dry run OK: the disaggregated layout is valid for this world size and fits" if not job.limits else
                  "dry run: the disaggregated layout is valid for this world size and fits, but the trainer cannot "
                  "run this job yet (see 'not runnable yet' above)")
            return FITS
        side = "trainer" if not fits(job, report) else "rollout"
        print(f"plan error: the {side} GPUs do not fit in {job.gpu} memory (see above): change the trainer layout "
              "or recompute (trainer side), or use a GPU with more memory (rollout side)", file=sys.stderr)
        return DOES_NOT_FIT
    if fits(job, report):
        print("dry run OK: the layout is valid for this world size and fits")
        return FITS
    advice = suggest(job, replan)
    if advice:
        print("changes that fit (each planned again with the change applied; fewest GPUs, then fastest, first):")
        for s in advice:
            print(f"  {s.describe(job.world_size)}  -> {s.total_bytes / 2**30:.1f} of {s.capacity / 2**30:.1f} GiB, "
                  f"{s.step_s:.1f} s/step, {s.images_per_s_per_gpu:.3f} images/s/GPU")
        hint = "try one of the changes listed above"
    else:
        hint = ("no change the planner tried fits (recompute, parallel.tp/ulysses/pp, the distributed optimizer, "
                "a smaller micro-batch, 2x or 4x the GPUs, up to three of them together): use a GPU with more "
                "memory or a smaller model")
    print(f"plan error: the layout does not fit in {job.gpu} memory (see 'total' above): {hint}", file=sys.stderr)
    return DOES_NOT_FIT
