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

Nothing lost at a checkpoint: the steps asked for ahead (up to s, sampled with versions the trainer no longer holds
once it has updated) are collected first and saved in the checkpoint by the trainer root
(`checkpointing.ASYNC_IN_FLIGHT`), and the rollout ranks join the collective save (`Checkpoint` message; their RNG
states). A resume trains on those saved steps and asks for the following ones exactly as the uninterrupted run does,
after pushing the version it loaded, so a SIGKILLed and resumed run equals the uninterrupted one bit for bit. A
checkpoint that holds no in-flight steps (a colocated run's) is continued with the versions the trainer holds: a
step whose behaviour version is older than the loaded one is sampled with the loaded one (lag 0).

The trainer's own engine copy (built for the probe and the plan) samples the held-out evaluation: it is synced
before each one (`evaluation_sync`).

Several trainer ranks: the root asks for whole steps (every data-parallel rank's prompts and seeds), scores them
and scatters each data-parallel rank's share to the ranks of its replica (`AsyncLoop._shares`); the weights are
pushed from the root's replica: the bridge gathers the tensor-parallel shards, and each pipeline stage's first
rank broadcasts its stage's blocks to the rollout ranks over its own weights group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.bridge import DistributedTransport, WeightSync
from megatron_omni.bridge.family_sync import family_plans
from megatron_omni.bridge.lora_sync import MergedSources, merged_linears
from megatron_omni.parallel import platform
from megatron_omni.parallel.placement import PlacementGroups
from megatron_omni.rollout.async_service import (
    AsyncSettings,
    RolloutClient,
    RolloutRankFailed,
    RolloutService,
    WeightReceiver,
    behaviour_version,
    check_staleness,
    push_weights,
    staleness_histogram,
)
from megatron_omni.rollout.async_service.channel import ChannelLost, Failed, recv_object, send_object
from megatron_omni.rollout.base import FinishedSample, Trajectory
from megatron_omni.rollout.quantization import QuantizationSpec
from megatron_omni.rollout.registry import EngineSettings, build_engine
from megatron_omni.trainer.checkpoint_folders import resume_folder
from megatron_omni.trainer.checkpointing import ASYNC_IN_FLIGHT, load_checkpoint, save_checkpoint
from megatron_omni.trainer.config import JobConfig, torch_dtype, vae_dtype
from megatron_omni.trainer.preemption import TrainingStopped
from megatron_omni.trainer.skeleton import StepResult, step_prompts
from model_providers import get_family

# The whole-job all_gather_object calls of megatron.core.optimizer.get_megatron_optimizer (megatron-core 0.16:
# `_get_param_groups`, for the dense and the MoE parameter groups), which the rollout ranks must join.
MEGATRON_OPTIMIZER_WORLD_GATHERS = 2


def async_settings(cfg: JobConfig) -> AsyncSettings:
    """The `async.*` keys as the service's settings."""
    a = cfg.async_
    return AsyncSettings(a.max_staleness, a.liveness_timeout_s, a.heartbeat_s, a.stall_timeout_s)


def engine_tp(cfg: JobConfig) -> int:
    """The tensor parallelism of a rollout rank's engine: `rollout.tp` for vLLM-Omni's `Omni` engine (its workers
    on the rollout group's GPUs), 1 for the embedded diffusers engine."""
    return cfg.rollout.tp if cfg.rollout.engine == "vllm_omni" else 1


def rollout_plan(cfg: JobConfig, hf_config: dict[str, Any]) -> Any:
    """The bridge's plan from the trainer's layout into a rollout rank's transformer (full tensors: the embedded
    diffusers engine's at tp 1, or the `Omni` engine workers' with `rollout.engine=vllm_omni`, each worker slicing
    what it is sent), the same on both sides."""
    p = cfg.parallel
    plans = family_plans(get_family(cfg.model.family), hf_config, trainer_tp=p.tp, trainer_pp=p.pp,
                         rollout_kind=cfg.rollout.engine, rollout_tp=engine_tp(cfg), mode="full")
    if len(plans) != 1:
        raise ValueError(f"model family {cfg.model.family!r} has weight parts {sorted(plans)}; the rollout service "
                         "serves one (a DiT's transformer)")
    return next(iter(plans.items()))


def trainer_side(cfg: JobConfig) -> JobConfig:
    """The config the trainer ranks build their trainer with. With `rollout.engine=vllm_omni` the rollout ranks own
    the `Omni` engines; the trainer's own engine copy (its config, initial weights, text lengths and the held-out
    evaluation) is the embedded diffusers engine (the same prompt encoding and sampler as our vLLM-Omni pipeline
    class), so a trainer GPU holds no vLLM-Omni engine and the trainer ranks start no engine processes."""
    if cfg.rollout.engine != "vllm_omni":
        return cfg
    return replace(cfg, rollout=replace(cfg.rollout, engine="diffusers", tp=1))


def build_rollout_engine(cfg: JobConfig, pipeline_dir: Path) -> Any:
    """A rollout owner's engine (this rank alone, not collective): the embedded diffusers engine (tp 1), or with
    `rollout.engine=vllm_omni` vLLM-Omni's `Omni` engine with `rollout.tp` worker processes on its rollout group's
    GPUs (this rank's and the next tp - 1 local ones; on the host through our CPU platform plugin), which takes the
    pushes into its workers' back buffers."""
    r = cfg.rollout
    tp = engine_tp(cfg)
    # rollout.quantization: the engine samples quantized on the family's linears, as the colocated engine does
    quantization = QuantizationSpec(r.quantization, tuple(get_family(cfg.model.family).quantized_linears))
    settings = EngineSettings(tp=1, dtype=torch_dtype(r.dtype), max_batch_size=r.max_batch_size,
                              quantization=quantization, vae_dtype=vae_dtype(r))
    if r.engine != "vllm_omni":
        return build_engine(r.engine, pipeline_dir, settings)
    from megatron_omni.rollout.vllm_omni.engine import VllmOmniRolloutEngine, _without_env, start_omni
    from megatron_omni.rollout.vllm_omni.faults import EngineStartError, root_cause

    # torchrun's TORCHELASTIC_USE_AGENT_STORE makes every env:// or tcp:// rendezvous a client of torchrun's own
    # store: the engine's worker processes would wait forever for the rendezvous server vLLM starts itself.
    local = int(os.environ.get("LOCAL_RANK", "0"))
    node = int(os.environ.get("LOCAL_WORLD_SIZE", str(local + tp)))
    if local + tp > node:
        raise EngineStartError(f"rollout.tp={tp}: the rollout group of local rank {local} would span {tp} GPUs past "
                               f"its node's {node}; place the rollout ranks so that each group lies on one node")
    try:
        with _without_env("TORCHELASTIC_USE_AGENT_STORE"), platform.devices_for_workers(range(local, local + tp)):
            omni = start_omni(pipeline_dir, tp, settings)
    except Exception as exc:  # one line naming the cause (vLLM-Omni wraps it in messageless exceptions)
        raise EngineStartError(f"vLLM-Omni engine for {pipeline_dir} failed to start: {root_cause(exc)}") from exc
    engine = VllmOmniRolloutEngine(pipeline_dir, tp, settings.dtype, omni=omni, quantization=quantization)
    engine.load_initial_weights()  # FP8: the folder's weights quantized as every swap quantizes them
    return engine


def transport(cfg: JobConfig, groups: PlacementGroups) -> DistributedTransport:
    """The weights' broadcast to the rollout ranks from each pipeline stage's first trainer rank (the root alone
    without pipeline parallelism) over the placement's weights groups."""
    return DistributedTransport(sources=list(groups.weight_sources), rollout_ranks=groups.placement.rollout_owners,
                                dtype=torch_dtype(cfg.model.params_dtype), groups=groups.weights)


def serve_rollout(cfg: JobConfig, groups: PlacementGroups, pipeline_dir: Path) -> dict[str, Any]:
    """A rollout rank's whole run: the job's collectives of the set-up (the optimizer build's, the resume's), the
    engine (its transformer double-buffered), the service until the trainer stops it (joining each checkpoint's
    save), then the job's closing collectives (`finish`'s). Returns the service's counters. Raises
    `TrainingStopped` when the trainer stopped on a signal (every rank of the job exits with the stop status)."""
    # The engine starts first, while the trainer builds its model: the trainer's liveness bound counts from the
    # first request, after the set-up collectives below, so a slow start (vLLM-Omni's engine: its worker process,
    # minutes for 20B weights) is never taken for a silent rank. One that fails is told to the trainer.
    settings = async_settings(cfg)
    owner = groups.placement.rollout_group_of(groups.rank)[0]
    engine, failure = None, None
    if owner == groups.rank:
        try:
            engine = build_rollout_engine(cfg, pipeline_dir)
        except Exception as exc:  # noqa: BLE001 - reported to the trainer below, then raised here
            failure = exc
    # Megatron-Core's get_megatron_optimizer gathers the parameter-group keys over the default (whole-job) group,
    # once for the dense and once for the expert parameters; the rollout ranks hold none and join both gathers.
    for _ in range(MEGATRON_OPTIMIZER_WORLD_GATHERS):
        dist.all_gather_object([None] * dist.get_world_size(), [])
    run_dir = Path(cfg.run_dir)
    folder = resume_folder(cfg.checkpoint.resume, run_dir)  # collective: the ranks verify it together
    if folder is not None:
        load_checkpoint(folder, None, None, None)  # this rank's RNG states (the trainer loads the rest)

    def join_checkpoint(step: int) -> Path:
        return save_checkpoint(run_dir, step, None, None, None, {}, cfg.checkpoint.keep)

    if owner != groups.rank:
        follow_owner(groups, owner, join_checkpoint)
        stats: dict[str, Any] = {}
    else:
        try:
            if failure is not None:
                report_start_failure(groups, settings, f"rollout.engine={cfg.rollout.engine!r} failed to start on "
                                                       f"rollout rank {groups.rank}: {type(failure).__name__}: "
                                                       f"{failure}")
                raise failure
            _, plan = rollout_plan(cfg, engine.transformer_config())
            receiver = WeightReceiver(engine, plan, transport(cfg, groups), torch_dtype(cfg.model.params_dtype),
                                      groups.rank, wait_timeout_s=settings.liveness_timeout_s)

            def checkpoint(step: int) -> Path:
                _tell_group(groups, ("checkpoint", step))
                return join_checkpoint(step)

            try:
                stats = RolloutService(engine, groups, receiver, settings, on_checkpoint=checkpoint).serve()
            finally:
                engine.close()
        except BaseException as exc:
            _tell_group(groups, ("failed", f"{type(exc).__name__}: {exc}"))
            raise
        _tell_group(groups, ("end", None))
    closing: list[Any] = [None]
    dist.broadcast_object_list(closing, src=groups.placement.trainer_root)  # `AsyncLoop.finish`'s
    stopped = closing[0]
    if stopped is None:
        dist.barrier()  # the run's final barrier
        return stats
    raise TrainingStopped(*stopped)


def _tell_group(groups: PlacementGroups, message: tuple[str, Any]) -> None:
    """On a rollout owner at rollout tp > 1: tell the other ranks of its rollout group ("checkpoint", step: join
    the save; "end"; "failed", text); nothing to tell at tp 1."""
    if groups.engine_group is not None:
        dist.broadcast_object_list([message], src=groups.rank, group=groups.engine_group)


def follow_owner(groups: PlacementGroups, owner: int, join_checkpoint: Callable[[int], Path]) -> None:
    """A rollout rank that is not its group's owner (rollout tp > 1: its GPU runs one of the owner's engine
    workers): join each checkpoint's save the owner announces until it says the service ended. Raises
    `RolloutRankFailed` naming the owner when the owner failed (its engine did not start, its service raised)."""
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=owner, group=groups.engine_group)
        kind, value = box[0]
        if kind == "checkpoint":
            join_checkpoint(value)
        elif kind == "failed":
            raise RolloutRankFailed(owner, None, f"(the engine owner of rollout rank {groups.rank}'s group) {value}")
        else:
            return


def report_start_failure(groups: PlacementGroups, settings: AsyncSettings, error: str) -> None:
    """Tell the trainer root that this rollout rank's engine did not start (`Failed`, the message its next
    `collect` raises), and wait (bounded) for its first message, so the trainer reads the failure before the
    connection closes."""
    root, rank = groups.placement.trainer_root, groups.rank
    send_object(Failed(rank, None, error), root, groups.results[rank])
    try:
        recv_object(root, groups.requests[rank], settings.liveness_timeout_s)
    except ChannelLost:
        pass  # the trainer is gone or silent: nothing more to tell it


def _rows(traj: Trajectory, first: int, end: int) -> Trajectory:
    """Samples first..end-1 of `traj` (itself when that is all of it)."""
    return traj if (first, end) == (0, len(traj)) else traj.select(list(range(first, end)))


class AsyncLoop:
    """The trainer side of the asynchronous loop, on every trainer rank. The trainer root talks to the rollout
    ranks (`client`; None elsewhere): it asks for whole steps (every data-parallel rank's prompts), scores what comes
    back and scatters each data-parallel rank's share to the ranks of its replica; every trainer rank trains on its
    share and joins the weight push (the tensor-parallel gathers of the bridge)."""

    def __init__(self, cfg: JobConfig, trainer: Any, groups: PlacementGroups) -> None:
        self.cfg = cfg
        self.trainer = trainer
        self.root = groups.placement.trainer_root
        self.is_root = groups.rank == self.root
        self.trainer_group = groups.trainer
        self.trainer_ranks = list(groups.placement.trainer_ranks)
        self.settings = async_settings(cfg)
        self.client = RolloutClient(groups, self.settings) if self.is_root else None
        self.split_rollout = len(groups.placement.rollout_owners) > 1
        part, plan = rollout_plan(cfg, trainer.hf_config)
        tg = trainer.groups
        sources = trainer.family.megatron_sources(trainer.model)[part]
        if trainer.lora.enabled:  # the back buffer takes full weights: the adapters merged in (lora_sync=merge's)
            sources = MergedSources(sources, merged_linears(trainer.model, trainer.model.global_name))
        self.weight_sync = WeightSync(plan, sources=sources, target=None, tp_group=tg.tp, tp_rank=tg.tp.rank(),
                                      stage=tg.coords["pp"], transport=transport(cfg, groups))
        # The data-parallel rank of every trainer rank (the share of a step it trains on), in trainer-rank order.
        self.dp_of_rank: list[int] = [0] * len(self.trainer_ranks)
        if len(self.trainer_ranks) > 1:
            dist.all_gather_object(self.dp_of_rank, tg.dp.rank(), group=self.trainer_group)
        self.dp_size = tg.dp.size()
        self.version = 0  # optimizer steps (RL steps) applied: the policy the trainer holds
        self.first_version = 0  # the oldest version this run can push (the one it started or resumed with)
        self.next_request = 0
        self.pushes = 0
        self.collected: dict[int, Trajectory] = {}  # steps collected ahead of their turn (a checkpoint's)

    def _from_root(self, value: Any) -> Any:
        """The root's `value` on every trainer rank."""
        if len(self.trainer_ranks) == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=self.root, group=self.trainer_group)
        return box[0]

    def start(self, step: int, in_flight: dict[int, Trajectory] | None = None) -> None:
        """The run starts (or resumes) at `step`, holding policy version `step`; `in_flight` (the root's): the
        steps a resumed checkpoint saved ahead (consecutive from `step`). A resumed run pushes its version to the
        rollout ranks, which start from the pipeline's weights. Every trainer rank calls it."""
        in_flight = dict(in_flight or {})
        if sorted(in_flight) != list(range(step, step + len(in_flight))):
            raise ValueError(f"resuming at step {step}: the checkpoint's in-flight steps {sorted(in_flight)} do not "
                             "follow it")
        # Saved steps older than this job's bound (a resume with a smaller async.max_staleness) are sampled again.
        s = self.settings.max_staleness
        kept = 0
        while step + kept in in_flight and step + kept - int(in_flight[step + kept].policy_version.min()) <= s:
            kept += 1
        if kept < len(in_flight):
            print(f"resuming with async.max_staleness={s}: the checkpoint's steps {sorted(in_flight)[kept:]} were "
                  "sampled with older policy versions than the bound allows; they are sampled again", flush=True)
        self.version = self.first_version = step
        self.collected = {k: in_flight[k] for k in range(step, step + kept)}
        self.next_request = step + self._from_root(kept)
        if step > 0 and self.next_request < self.cfg.steps:
            self.push()

    def step_samples(self, step: int) -> tuple[list[str], list[int], list[tuple[int, int]]]:
        """RL step `step`'s samples over every data-parallel rank, in dp-rank order: prompts (groups expanded) and
        seeds [N], and each dp rank's (first, end) rows."""
        r = self.cfg.rollout
        prompts, seeds, rows = [], [], []
        for d in range(self.dp_size):
            mine, _, mine_seeds = step_prompts(self.cfg.prompts, self.cfg.seed, step, r.prompts_per_step,
                                               r.group_size, d, self.dp_size)
            rows.append((len(seeds), len(seeds) + len(mine_seeds)))
            prompts += [p for p in mine for _ in range(r.group_size)]
            seeds += mine_seeds
        return prompts, seeds, rows

    def _request_ahead(self, step: int) -> None:
        """Ask for every step up to `step` + s the trainer can ask for now: its version is <= the one held. Every
        trainer rank advances the count (the push after an update depends on it); the root sends."""
        s = self.settings.max_staleness
        while self.next_request < self.cfg.steps and self.next_request <= step + s:
            k = self.next_request
            # A resumed run holds no version older than the one it loaded (none older is asked for when the
            # checkpoint saved its in-flight steps; a colocated run's checkpoint saved none).
            version = max(behaviour_version(k, s), self.first_version)
            if version > self.version:  # not pushed yet (cannot happen with the bound; kept as a guard)
                break
            if self.is_root:
                prompts, seeds, _ = self.step_samples(k)
                params = self.trainer.sampling_params(k)
                if self.split_rollout and params.text_length is None:
                    # every rollout rank's share padded to one text length, as one engine call over the step would
                    params = replace(params, text_length=self.trainer.common_text_length(prompts, params))
                self.client.request(k, version, prompts, seeds, params)
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

    def _shares(self, step: int) -> tuple[Trajectory, torch.Tensor, dict[str, float], Any]:
        """The root collects step `step` (or takes it from a checkpoint's), checks its versions against the bound
        and scores it; every trainer rank gets its data-parallel rank's share [n] of the trajectory, rewards and a
        weighted reward's terms (None for one scorer), and the step's whole-step figures (staleness, versions,
        waits)."""
        out: list[Any] = [None]
        if self.is_root:
            t0 = time.perf_counter()
            traj = self.collected.pop(step) if step in self.collected else self.client.collect(step)
            wait = time.perf_counter() - t0
            lag = check_staleness(traj, self.version, self.settings.max_staleness, step)
            _, seeds, rows = self.step_samples(step)
            rewards, reward_s = self.scored(traj, seeds)
            versions = traj.policy_version
            figures = {"rollout_wait": wait, "reward": reward_s,
                       **staleness_histogram(lag, self.settings.max_staleness),
                       "policy_version_min": int(versions.min()), "policy_version_max": int(versions.max())}
            terms = getattr(self.trainer.reward_fn, "terms", None)
            shares = [(_rows(traj, *rows[d]), rewards[rows[d][0]:rows[d][1]], figures,
                       None if terms is None else terms.rows(*rows[d])) for d in self.dp_of_rank]
            if len(self.trainer_ranks) == 1:
                return shares[0]
            dist.scatter_object_list(out, shares, src=self.root, group=self.trainer_group)
        else:
            dist.scatter_object_list(out, None, src=self.root, group=self.trainer_group)
        return out[0]

    def train_step(self, step: int) -> StepResult:
        """RL step `step`: ask ahead, collect the step, check its versions against the bound, score it, train on
        this rank's share with the synchronous loop's step, push the new version. Every trainer rank calls it."""
        self._request_ahead(step)
        traj, rewards, figures, terms = self._shares(step)
        if hasattr(self.trainer.reward_fn, "terms"):
            self.trainer.reward_fn.terms = terms  # this rank's share: train_on gathers them like the rewards
        t = {"rollout_wait": figures.pop("rollout_wait"), "reward": figures.pop("reward")}
        _, group_ids, _ = self.trainer.step_prompts(step)
        result = self.trainer.train_on(step, traj, rewards, group_ids, t, sync=False)
        self.version += 1
        push = 0.0
        if self.next_request < self.cfg.steps:  # a step still to ask for samples with this version
            push = self.push()
        result.metrics.update(figures, push_s=push)
        if "train_rollout_dlogp" in result.metrics:
            result.metrics["behaviour_dlogp"] = result.metrics["train_rollout_dlogp"]
        return result

    def push(self) -> float:
        """Push the version the trainer holds into the rollout ranks' back buffers (with its probe means);
        returns the seconds it took. Every trainer rank calls it."""
        t0 = time.perf_counter()
        try:
            push_weights(self.version, self.weight_sync, self.trainer.probe_means(), self.client)
        except RuntimeError as exc:
            # A rollout rank that left (its engine did not start, on a resume the first thing the trainer does is
            # this push) breaks the broadcast with a transport error: the root raises the cause it reported.
            reported = None if self.client is None else self.client.reported_failure(self.settings.heartbeat_s + 5)
            if reported is None:
                raise
            raise reported from exc
        if isinstance(self.weight_sync.sources, MergedSources):
            self.weight_sync.sources.forget()  # the next push merges the updated adapters
        self.pushes += 1
        return time.perf_counter() - t0

    def checkpoint(self, done: int) -> dict[str, Any] | None:
        """Before the job's checkpoint after `done` RL steps: the root collects every step asked for ahead (kept
        for their turn) and tells the rollout ranks to join the save. Returns the objects the root saves,
        {ASYNC_IN_FLIGHT: {step: Trajectory}} (None on the other trainer ranks)."""
        if not self.is_root:
            return None
        for k in sorted(self.client.in_flight()):
            self.collected[k] = self.client.collect(k)
        self.client.checkpoint(done)
        return {ASYNC_IN_FLIGHT: dict(self.collected)}

    def finish(self, stopped: tuple[str, int, str] | None) -> None:
        """Stop the rollout ranks (dropping a step asked for ahead) and tell every rank how the run ends: None, the
        final barrier; `stopped` (signal name, step, checkpoint folder), the rollout ranks raise `TrainingStopped`
        with it. Every trainer rank calls it."""
        if self.is_root:
            for k in sorted(self.client.in_flight()):
                self.client.cancel(k)
            for rank, stats in sorted(self.client.close().items()):
                diffs = stats.get("swap_probe_diffs", [])
                print(f"rollout rank {rank}: {stats.get('requests', 0)} requests, {stats.get('swaps', 0)} swaps, every "
                      f"swap's probe passed (max |diff| {max(diffs, default=0.0):.3g})", flush=True)
        dist.broadcast_object_list([stopped], src=self.root)

    def evaluation_sync(self) -> None:
        """Bring the trainer's own engine copy (which samples the held-out evaluation) to the trained weights.
        Every trainer rank calls it."""
        self.trainer.sync_weights()

    def abandon(self) -> None:
        """After a lost or failed rollout rank: stop those still reachable (the trainer is about to raise)."""
        if self.client is not None:
            self.client.abandon()
