"""The planner's prediction for a disaggregated job (`placement.mode=disaggregated`, docs/async.md): T trainer
GPUs train while R rollout GPUs of their own generate the next step, next to the colocated job on the same T + R
GPUs. Pure functions over `plan.plan`; no GPU, no process group.

Model (stated, so a reader can redo it by hand; `ASSUMPTIONS` is what the report prints):
- steady state at staleness 1 (`async.max_staleness=1`): the rollout of step k + 1 runs while the trainer trains
  on step k, so a step takes max(rollout on R GPUs, old log-probs + training on T GPUs + the weight push). The
  push is the trainer's (a collective over its ranks, after the update); the rollout ranks receive it into their
  back buffer on a control thread and swap between two requests (storage exchange, no copy: not counted);
- the rollout, old log-prob and training phases are `plan.plan`'s, for the trainer layout on T GPUs and a rollout
  engine on R GPUs of its own (R / rollout tp replicas splitting the images);
- the push: one rollout rank's weights (`rollout_parameter_count` at rollout tp, in the rollout dtype) at NVLink
  bandwidth x link efficiency when T + R fit in one node, else at the network's;
- a trainer GPU holds the training state and activations only; a rollout GPU holds the live engine (transformer,
  text encoder, VAE), the back buffer of the transformer (what a push writes), one batch's working set and the
  reserve: no gradients, no optimizer state;
- images/s/GPU counts every GPU the job holds (T + R + reward GPUs); the first step (nothing to overlap yet),
  the rollout's idle wait on a slow trainer and the reward server's latency are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from megatron_omni.parallel.layout import LayoutError, ParallelLayout
from megatron_omni.planner.arch import arch_of
from megatron_omni.planner.memory import GIB, rollout_activation_bytes, rollout_parameter_count
from megatron_omni.planner.plan import plan
from megatron_omni.planner.report import PlanReport
from megatron_omni.planner.specs import DEFAULT_MFU, GPUS, GPUSpec, LoRASpec, Precision, RolloutSpec, Workload

STALENESS = 1  # the steady state modelled: the rollout runs one version behind the trainer
ASSUMPTIONS = (
    "disaggregated model: steady state at staleness 1, step = max(rollout on R GPUs, old log-probs + training on "
    "T GPUs + weight push); the push is received into the rollout ranks' back buffer (swap not counted); a rollout "
    "GPU holds the engine (transformer + text encoder + VAE), the transformer's back buffer, one batch's working set "
    "and the reserve, no optimizer state; the first step and idle waits are not modelled"
)


@dataclass(frozen=True)
class RolloutMemory:
    """Bytes on one rollout GPU: the live engine's weights (transformer + extra parameters), the back buffer the
    pushes write (the transformer's shard), one batch's working set and the reserve."""

    weights: int
    back_buffer: int
    activations: int
    reserve: int
    capacity: int

    @property
    def total(self) -> int:
        return self.weights + self.back_buffer + self.activations + self.reserve

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity


@dataclass(frozen=True)
class DisaggregatedReport:
    """A disaggregated job on `trainer_gpus` + `rollout_gpus` and the colocated one on as many GPUs (None, with
    `colocated_error`, when the trainer layout cannot run colocated on T + R GPUs)."""

    trainer: PlanReport  # the trainer ranks' plan (rollout on GPUs of its own): phases and trainer memory
    trainer_gpus: int
    rollout_gpus: int
    reward_gpus: int
    rollout_memory: RolloutMemory
    push_s: float
    colocated: PlanReport | None
    colocated_error: str | None = None
    staleness: int = STALENESS

    @property
    def rollout_s(self) -> float:
        return self.trainer.time.rollout_s

    @property
    def train_s(self) -> float:
        """The trainer's side of a step: old log-probs + training + the weight push."""
        t = self.trainer.time
        return t.old_logprob_s + t.train_s + self.push_s

    @property
    def step_s(self) -> float:
        return max(self.rollout_s, self.train_s)

    @property
    def gpus(self) -> int:
        return self.trainer_gpus + self.rollout_gpus + self.reward_gpus

    @property
    def images_per_s_per_gpu(self) -> float:
        return self.trainer.workload.images / (self.step_s * self.gpus)

    @property
    def fits(self) -> bool:
        return self.trainer.memory.fits and self.rollout_memory.fits

    @property
    def bound(self) -> str:
        """Which side sets the step: 'rollout' or 'trainer'."""
        return "rollout" if self.rollout_s >= self.train_s else "trainer"

    def table(self) -> str:
        """The disaggregated figures next to the colocated ones (the trainer's full table is printed before)."""
        m, r, gib = self.trainer.memory, self.rollout_memory, lambda b: f"{b / GIB:.1f} GiB"
        lines = [
            f"disaggregated: {self.trainer_gpus} trainer + {self.rollout_gpus} rollout GPUs"
            f"{f' + {self.reward_gpus} reward' if self.reward_gpus else ''}, staleness {self.staleness}",
            f"  trainer GPU memory  {gib(m.total)} of {gib(m.capacity)} -> {'fits' if m.fits else 'DOES NOT FIT'}",
            f"  rollout GPU memory  {gib(r.total)} of {gib(r.capacity)} (engine {gib(r.weights)}, back buffer "
            f"{gib(r.back_buffer)}, activations {gib(r.activations)}, reserve {gib(r.reserve)}, no optimizer "
            f"state) -> {'fits' if r.fits else 'DOES NOT FIT'}",
            f"  rollout side        {self.rollout_s:8.1f} s on {self.rollout_gpus} GPUs",
            f"  trainer side        {self.train_s:8.1f} s on {self.trainer_gpus} GPUs (old log-probs "
            f"{self.trainer.time.old_logprob_s:.1f} + training {self.trainer.time.train_s:.1f} + push "
            f"{self.push_s:.1f})",
            f"  step                {self.step_s:8.1f} s ({self.bound}-bound) -> {self.images_per_s_per_gpu:.3f} "
            f"images/s/GPU",
        ]
        n = self.trainer_gpus + self.rollout_gpus
        if self.colocated is None:
            lines.append(f"colocated on {n} GPUs: no plan fits ({self.colocated_error})")
        else:
            c = self.colocated
            same = ("same layout" if self.colocated_error is None
                    else f"tp={c.layout.tp}: the trainer's layout does not run on {n} GPUs")
            lines.append(f"colocated on {n} GPUs ({same}): {c.memory.total / GIB:.1f} GiB per GPU "
                         f"({'fits' if c.memory.fits else 'DOES NOT FIT'}), {c.time.step_s:.1f} s/step -> "
                         f"{c.time.images_per_s_per_gpu:.3f} images/s/GPU; disaggregated/colocated = "
                         f"{self.images_per_s_per_gpu / c.time.images_per_s_per_gpu:.2f}")
        lines.append(f"assumption: {ASSUMPTIONS}")
        return "\n".join(lines)


def plan_disaggregated(
    model: str | dict[str, Any],
    layout: ParallelLayout,
    trainer_gpus: int,
    rollout_gpus: int,
    gpu: GPUSpec | str = "H200",
    workload: Workload | None = None,
    *,
    rollout: RolloutSpec | None = None,
    precision: Precision | None = None,
    recompute: str = "full",
    mfu: float = DEFAULT_MFU,
    link_efficiency: float = 0.7,
    reserve_bytes: int = 4 * GIB,
    gpus_per_node: int = 8,
    reward_gpus: int = 0,
    lora: LoRASpec | None = None,
) -> DisaggregatedReport:
    """Predict a disaggregated job: `layout` trains on `trainer_gpus`, the engine `rollout` (its tp, batch, MFU;
    its `colocated` and `gpus` are set here) rolls out on `rollout_gpus`; and the colocated job with the same
    layout on trainer_gpus + rollout_gpus. Raises LayoutError naming the count that is wrong."""
    for name, n in (("trainer GPUs", trainer_gpus), ("rollout GPUs (placement.rollout_ranks)", rollout_gpus)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise LayoutError(f"{name}={n!r}: a disaggregated job needs at least one on each side")
    rollout = rollout or RolloutSpec()
    precision = precision or Precision()
    gpu_spec = GPUS.get(gpu) if isinstance(gpu, str) else gpu
    kw = dict(precision=precision, recompute=recompute, mfu=mfu, link_efficiency=link_efficiency,
              reserve_bytes=reserve_bytes, gpus_per_node=gpus_per_node, reward_gpus=reward_gpus, lora=lora)
    trainer = plan(model, layout, trainer_gpus, gpu, workload,
                   rollout=replace(rollout, colocated=False, gpus=rollout_gpus, sleeps=False), **kw)
    gpu_spec = trainer.gpu if gpu_spec is None else gpu_spec
    w, cfg = trainer.workload, arch_of(model).config
    shard = precision.rollout_param_bytes * rollout_parameter_count(model, rollout.tp)
    rollout_memory = RolloutMemory(
        weights=shard + precision.rollout_param_bytes * rollout.extra_params,
        back_buffer=shard,
        activations=rollout_activation_bytes(model, tokens=trainer.image_tokens + w.text_tokens,
                                             batch=rollout.batch * (2 if w.cfg else 1), rollout_tp=rollout.tp,
                                             act_bytes=precision.activation_bytes),
        reserve=reserve_bytes, capacity=gpu_spec.memory_bytes)
    one_node = trainer_gpus + rollout_gpus <= gpus_per_node
    push_bw = (gpu_spec.link_bytes_per_s if one_node else gpu_spec.internode_bytes_per_s) * link_efficiency
    colocated, error = None, None
    together = replace(rollout, colocated=True, gpus=None)
    try:
        colocated = plan(model, layout, trainer_gpus + rollout_gpus, gpu, workload, rollout=together, **kw)
    except LayoutError as exc:
        error = str(exc)
        # The trainer's layout does not run on T + R GPUs (e.g. tp=6 on 8): the fastest fitting colocated plan at
        # another tp (the same cp and pp), so that the comparison is still on as many GPUs.
        tried = []
        for tp in range(1, cfg["num_attention_heads"] + 1):
            try:
                tried.append(plan(model, replace(layout, tp=tp, dp=None), trainer_gpus + rollout_gpus, gpu, workload,
                                  rollout=together, **kw))
            except LayoutError:
                continue
        fitting = [r for r in tried if r.memory.fits]
        if fitting:
            colocated = max(fitting, key=lambda r: r.time.images_per_s_per_gpu)
    return DisaggregatedReport(trainer=trainer, trainer_gpus=trainer_gpus, rollout_gpus=rollout_gpus,
                               reward_gpus=reward_gpus, rollout_memory=rollout_memory, push_s=shard / push_bw,
                               colocated=colocated, colocated_error=error)
