"""The asynchronous loop of the one trainer (`placement.mode=disaggregated`, docs/async.md): the rollout ranks run
the rollout service, the trainer asks for step k + s before it trains on step k (s = `async.max_staleness`),
trains on what comes back with the synchronous loop's own step (`FlowGRPOTrainer.train_on`), and pushes its
weights into the rollout ranks' back buffers after every update.

The protocol that keeps a run deterministic (the phase-1 building blocks' rule): step k is asked for with
policy version `behaviour_version(k, s)` = max(0, k - s), and only once the trainer holds that version (it has
pushed it), so a trajectory depends on its seeds and its version only, never on timing: s = 0 is the
synchronous algorithm, bit for bit. Every trajectory is checked against the bound (`check_staleness`) before
the trainer touches it.

The ratio's denominator follows `algorithm.old_logprob` as in the synchronous loop: `recompute` takes the
trainer's current (proximal) policy, and `algorithm.is_cap`'s truncated importance weights min(exp(logp_old -
logp_behaviour), cap) correct the behaviour policy's version gap (decoupled PPO); `bypass` takes the behaviour
log-probs recorded at rollout. The step's metrics add the staleness histogram (`staleness_<k>`,
`staleness_mean`), `policy_version_min` / `_max`, `behaviour_dlogp` (mean |logp_current - logp_behaviour|: the
synchronous loop's `train_rollout_dlogp`, here also the version gap), `time_rollout_wait` (the trainer idle,
waiting for the step) and `push_s`.

Left for later (docs/async.md): more than one trainer rank (the root would scatter the trajectory over data
parallel), checkpointing the in-flight step, the trainer's own engine copy (built for the probe and the plan;
unused for sampling).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.bridge import DistributedTransport, WeightSync
from megatron_omni.bridge.family_sync import family_plans
from megatron_omni.parallel.placement import PlacementGroups
from megatron_omni.rollout.async_service import (
    AsyncSettings,
    RolloutClient,
    RolloutService,
    WeightReceiver,
    behaviour_version,
    check_staleness,
    push_weights,
    staleness_histogram,
)
from megatron_omni.rollout.base import FinishedSample, Trajectory
from megatron_omni.rollout.registry import EngineSettings, build_engine
from megatron_omni.trainer.config import JobConfig, torch_dtype
from megatron_omni.trainer.skeleton import StepResult
from model_providers import get_family

# The whole-job all_gather_object calls of megatron.core.optimizer.get_megatron_optimizer (megatron-core 0.16:
# `_get_param_groups`, for the dense and the MoE parameter groups), which the rollout ranks must join.
MEGATRON_OPTIMIZER_WORLD_GATHERS = 2


def async_settings(cfg: JobConfig) -> AsyncSettings:
    """The `async.*` keys as the service's settings."""
    a = cfg.async_
    return AsyncSettings(a.max_staleness, a.liveness_timeout_s, a.heartbeat_s)


def rollout_plan(cfg: JobConfig, hf_config: dict[str, Any]) -> Any:
    """The bridge's plan from the trainer's layout into a rollout rank's diffusers transformer (full tensors,
    rollout tp 1), the same on both sides."""
    p = cfg.parallel
    plans = family_plans(get_family(cfg.model.family), hf_config, trainer_tp=p.tp, trainer_pp=p.pp,
                         rollout_kind="diffusers", rollout_tp=1, mode="full")
    if len(plans) != 1:
        raise ValueError(f"model family {cfg.model.family!r} has weight parts {sorted(plans)}; the rollout service "
                         "serves one (a DiT's transformer)")
    return next(iter(plans.items()))


def transport(cfg: JobConfig, groups: PlacementGroups) -> DistributedTransport:
    """The weights' broadcast from the trainer root to the rollout ranks over the placement's weights group."""
    pl = groups.placement
    return DistributedTransport(sources=[pl.trainer_root], rollout_ranks=pl.rollout_ranks,
                                dtype=torch_dtype(cfg.model.params_dtype), groups=groups.weights)


def serve_rollout(cfg: JobConfig, groups: PlacementGroups, pipeline_dir: Path) -> dict[str, Any]:
    """A rollout rank's whole run: the engine (its transformer double-buffered), the service until the trainer
    stops it, then the job's closing collectives (`finish`'s). Returns the service's counters."""
    # Megatron-Core's get_megatron_optimizer gathers the parameter-group keys over the default (whole-job) group,
    # once for the dense and once for the expert parameters; the rollout ranks hold none and join both gathers.
    for _ in range(MEGATRON_OPTIMIZER_WORLD_GATHERS):
        dist.all_gather_object([None] * dist.get_world_size(), [])
    r = cfg.rollout
    engine = build_engine(r.engine, pipeline_dir, EngineSettings(tp=1, dtype=torch_dtype(r.dtype),
                                                                 max_batch_size=r.max_batch_size))
    settings = async_settings(cfg)
    _, plan = rollout_plan(cfg, engine.transformer_config())
    receiver = WeightReceiver(engine, plan, transport(cfg, groups), torch_dtype(cfg.model.params_dtype),
                              groups.rank, wait_timeout_s=settings.liveness_timeout_s)
    try:
        stats = RolloutService(engine, groups, receiver, settings).serve()
    finally:
        engine.close()
    closing: list[Any] = [None]
    dist.broadcast_object_list(closing, src=groups.placement.trainer_root)  # `AsyncLoop.finish`'s
    save_step, barrier = closing[0]
    if save_step is not None:
        from megatron_omni.trainer.checkpointing import save_checkpoint

        save_checkpoint(Path(cfg.run_dir), save_step, None, None, None, {}, cfg.checkpoint.keep)
    if barrier:
        dist.barrier()
    return stats


class AsyncLoop:
    """The trainer side of the asynchronous loop, on the trainer root (the only trainer rank for now)."""

    def __init__(self, cfg: JobConfig, trainer: Any, groups: PlacementGroups) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.root = groups.placement.trainer_root
        self.settings = async_settings(cfg)
        self.client = RolloutClient(groups, self.settings)
        part, plan = rollout_plan(cfg, trainer.hf_config)
        tg = trainer.groups
        self.weight_sync = WeightSync(plan, sources=trainer.family.megatron_sources(trainer.model)[part], target=None,
                                      tp_group=tg.tp, tp_rank=tg.tp.rank(), stage=tg.coords["pp"],
                                      transport=transport(cfg, groups))
        self.version = 0  # optimizer steps (RL steps) applied: the policy the trainer holds
        self.next_request = 0
        self.pushes = 0

    def start(self, step: int) -> None:
        """The run starts (or resumes) at `step`, holding policy version `step`."""
        self.version = self.next_request = step

    def _request_ahead(self, step: int) -> None:
        """Ask for every step up to `step` + s the trainer can ask for now: its version is <= the one held."""
        s = self.settings.max_staleness
        while self.next_request < self.cfg.steps and self.next_request <= step + s:
            k = self.next_request
            version = behaviour_version(k, s)
            if version > self.version:  # not pushed yet (cannot happen with the bound; kept as a guard)
                break
            prompts, group_ids, seeds = self.trainer.step_prompts(k)
            g = self.cfg.rollout.group_size
            self.client.request(k, version, [p for p in prompts for _ in range(g)], seeds,
                                self.trainer.sampling_params(k))
            self.next_request += 1

    def scored(self, traj: Trajectory, seeds: list[int]) -> tuple[torch.Tensor, float]:
        """The rewards [N] of a trajectory that came back from the rollout ranks (scored here, in order) and the
        seconds it took."""
        t0 = time.perf_counter()
        reward_fn = self.trainer.reward_fn
        reward_fn.begin(len(traj))
        for i, (prompt, seed) in enumerate(zip(traj.prompts, seeds)):
            reward_fn.on_sample(FinishedSample(i, prompt, i, seed, traj.images[i]))
        return reward_fn.collect(), time.perf_counter() - t0

    def train_step(self, step: int) -> StepResult:
        """RL step `step`: ask ahead, collect the step, check its versions against the bound, score it, train on
        it with the synchronous loop's step, push the new version."""
        t: dict[str, float] = {}
        self._request_ahead(step)
        t0 = time.perf_counter()
        traj = self.client.collect(step)
        t["rollout_wait"] = time.perf_counter() - t0
        lag = check_staleness(traj, self.version, self.settings.max_staleness, step)
        prompts, group_ids, seeds = self.trainer.step_prompts(step)
        rewards, t["reward"] = self.scored(traj, seeds)
        versions = traj.policy_version
        result = self.trainer.train_on(step, traj, rewards, group_ids, t, sync=False)
        self.version += 1
        push = 0.0
        if self.next_request < self.cfg.steps:  # a step still to ask for samples with this version
            t0 = time.perf_counter()
            push_weights(self.version, self.weight_sync, self.trainer.probe_means(), self.client)
            self.pushes += 1
            push = time.perf_counter() - t0
        result.metrics.update(staleness_histogram(lag, self.settings.max_staleness),
                              policy_version_min=int(versions.min()), policy_version_max=int(versions.max()),
                              push_s=push)
        if "train_rollout_dlogp" in result.metrics:
            result.metrics["behaviour_dlogp"] = result.metrics["train_rollout_dlogp"]
        return result

    def finish(self, save_step: int | None, barrier: bool) -> None:
        """Stop the rollout ranks (dropping a step asked for ahead) and tell them the closing collectives: the
        checkpoint after `save_step` (None: none) and the run's final barrier. Every trainer rank calls it."""
        for k in sorted(self.client.in_flight()):
            self.client.cancel(k)
        self.client.close()
        dist.broadcast_object_list([(save_step, barrier)], src=self.root)

    def abandon(self) -> None:
        """After a lost or failed rollout rank: stop those still reachable (the trainer is about to raise)."""
        self.client.abandon()
