"""The DiT trainer: one readable RL step on the Megatron model, for every update rule `algorithm.name` selects.

rollout (the engine `rollout.engine` names, built by the rollout registry) -> rewards -> old log-probs
(recomputed by the Megatron model, or the rollout's in `bypass` mode) -> group advantages -> mini-batch
updates through Megatron-Core's DDP and optimizer (gradient accumulation over the window steps) -> weight
sync into the rollout engine, proven by a probe forward -> metrics. That is FlowGRPO; the other rules change
only the step's sampler and its loss (`trainer.objectives`): MixGRPO slides one window per step (Flash: fewer
ODE steps after it), GRPO-Guard normalises the ratio with the old policy's transition means (recomputed with
the old log-probs), DiffusionNFT rolls out with the ODE and trains the forward process on the clean samples
against the old policy's velocities (a forward-only pass before the update; with a lagging old policy, its
decayed copy's weights, which the rollout samples with too). The engine sleeps from the end of the
rollout to the end of the update (vLLM-Omni on GPU frees its memory for training). When the model replica is
one rank (`rollout.transformer` trainer, or auto, with the diffusers engine), the engine samples with the
trainer's Megatron module itself, so there is no copy to sync.

Data parallel ranks take disjoint prompts; the ranks of one model replica (tp x cp x pp) split that
replica's samples, each rolls out and scores its share, and the shares are gathered so they all train on the
same trajectory (each rank's diffusers engine holds the full weights: the sync gathers every pipeline stage
into every engine). Rewards are gathered over data parallel for the advantages (global or per-group
std). The recompute and the update run micro-batches (samples x one window step) through Megatron-Core's
schedules (`pipeline_step.py`; 1F1B when pp > 1). With `algorithm.beta > 0` a frozen copy of the initial
model gives the reference transition means of the KL term (docs/design.md section 3). With
`optim.ema_decay > 0` another copy holds the exponential moving average of the weights, which evaluation
samples with (`evaluation_weights`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel

from megatron_omni.algorithms.advantages import Advantages, group_advantages, term_advantages
from megatron_omni.algorithms.importance import ImportanceWeights, truncated_importance_weights
from megatron_omni.bridge import DistributedTransport, WeightSync
from megatron_omni.bridge.family_sync import family_plans, sync_mode
from megatron_omni.bridge.lora_sync import LoRAAdapterSync, MergedSources, merged_linears
from megatron_omni.checkpoint.lora import lora_sharded_state_dict
from megatron_omni.checkpoint.safetensors_io import SafetensorsFolder
from megatron_omni.checkpoint.sharded_state import content_metadata, model_layout, model_sharded_state_dict
from megatron_omni.models.dit.config import MMDiTConfig
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.models.dit.model import MMDiTModel
from megatron_omni.models.lora import adapters_disabled
from megatron_omni.parallel import platform
from megatron_omni.parallel.groups import ParallelGroups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.rollout.base import SamplingParams, Trajectory, WeightSink
from megatron_omni.rollout.probe import (
    PROBE_DISTILLED_GUIDANCE,
    QuantizedProbe,
    probe_tolerance,
    probe_trajectory,
)
from megatron_omni.rollout.quantization import QuantizationSpec, check_engine_probe
from megatron_omni.rollout.registry import EngineSettings, build_engine
from megatron_omni.trainer.config import JobConfig, ParallelConfig, torch_dtype, vae_dtype
from megatron_omni.trainer.grad_guard import GradGuard
from megatron_omni.trainer.lora_setup import attach_lora, lora_identity, lora_sync_mode
from megatron_omni.trainer.objectives import (
    FlowGRPOObjective,
    NftObjective,
    NftPoints,
    blend_old_policy,
    lagging_old_policy,
    nft_inputs,
    nft_reward_weight,
    old_policy_lags,
    step_sampling_params,
    uses_log_probs,
)
from megatron_omni.trainer.pipeline_step import MicroBatch, Objective, PipelineStep, plan_micro_batches
from megatron_omni.trainer.rewards import RewardFunction, RewardTerms, gather_rewards, gather_terms
from megatron_omni.trainer.skeleton import (
    StepResult,
    UpdateTally,
    mini_batch_rows,
    step_metrics,
    step_prompts,
    update,
)
from megatron_omni.trainer.training_state import OptimizerSettings, build_ddp_and_optimizer, build_scheduler
from model_providers import ModelFamily, get_family


@contextmanager
def holding_weights(model: torch.nn.Module, source: torch.nn.Module | None, sync: Callable[[], object],
                    sync_in: bool, sync_out: bool) -> Iterator[None]:
    """Inside, `model` holds `source`'s weights (same parameter order and shapes; synced into the engine by `sync`
    when `sync_in`); on exit the trained weights again, bit for bit (synced when `sync_out`). None: nothing
    changes. Used by every trainer's EMA evaluation and the old-policy recompute."""
    if source is None:
        yield
        return
    params = list(model.parameters())
    trained = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, source.parameters(), strict=True):
            p.copy_(e)
    if sync_in:
        sync()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, t in zip(params, trained, strict=True):
                p.copy_(t)
        if sync_out:
            sync()

class FlowGRPOTrainer:
    """Holds the model, optimizer, rollout engine and reward function of one rank."""

    # The model's sharded state for checkpoints (the MMDiT's).
    sharded_state = staticmethod(model_sharded_state_dict)

    def __init__(self, cfg: JobConfig, groups: ParallelGroups, pipeline_dir: str | Path,
                 reward_fn: RewardFunction, job_group: dist.ProcessGroup | None = None) -> None:
        """`job_group`: the trainer's ranks when they are not the whole job (a disaggregated placement's), for
        the collectives that span every trainer rank; None: the job."""
        self.cfg = cfg
        self.groups = groups
        self.reward_fn = reward_fn
        seed_everything(cfg.seed, tp_rank=groups.tp.rank())
        r = cfg.rollout
        self.family = get_family(cfg.model.family)
        # rollout.quantization: the engine's own copy samples quantized on the family's linears; the trainer not.
        self.quantization = QuantizationSpec(r.quantization, tuple(self.family.quantized_linears))
        self.engine = build_engine(r.engine, pipeline_dir, EngineSettings(tp=r.tp, dtype=torch_dtype(r.dtype),
                                                                          max_batch_size=r.max_batch_size,
                                                                          quantization=self.quantization,
                                                                          vllm_omni_process=r.vllm_omni_process,
                                                                          vae_dtype=vae_dtype(r)))
        self.hf_config = self.engine.transformer_config()
        p = cfg.parallel
        # batched p2p on gloo gave wrong results (docs/design.md section 5)
        overrides: dict = {"batch_p2p_comm": False}
        if cfg.model.recompute == "full":
            overrides.update(recompute_granularity="full", recompute_method="block", recompute_num_layers=None)
        elif cfg.model.recompute == "selective":
            overrides.update(recompute_granularity="selective")
        params_dtype = torch_dtype(cfg.model.params_dtype)
        if self.family.kind != "dit":
            raise ValueError(f"FlowGRPOTrainer trains DiT families; model.family={self.family.name} is "
                             f"{self.family.kind!r} (trainer.run picks the trainer by kind)")
        mcfg = self.family.megatron_config(self.hf_config, tp=p.tp, pp=p.pp, ulysses=p.ulysses, ring=p.ring,
                                           params_dtype=params_dtype, **overrides)
        hf_state = _initial_weights(self.engine.initial_state_dict(), pipeline_dir, params_dtype,
                                    getattr(self.engine, "policy_component", "transformer"))
        self.model = self.family.build_model(mcfg, groups, backend=cfg.model.backend)
        self.family.load_state(self.model, hf_state)
        _count_stage_replicas_once(self.model, groups)
        # LoRA: adapters on the parallel linears, the base frozen (only adapters reach DDP and the optimizer);
        # checkpoints then hold the adapters and record the base they were trained on.
        self.lora = cfg.model.lora
        self.lora_linears = attach_lora(self.model, self.lora, cfg.seed, groups.mcore.pp) if self.lora.enabled else []
        self.checkpoint_identity = ({"lora": lora_identity(self.lora, self.lora_linears, pipeline_dir, job_group)}
                                    if self.lora.enabled else {})
        if self.lora.enabled:
            self.sharded_state = lora_sharded_state_dict
        # Built before DDP wraps the policy, from the same weights, never trained (no grads, no optimizer). With
        # LoRA the reference is the policy with its adapters off (`reference_means`): no second copy.
        self.reference = (_frozen_copy(self.family, mcfg, groups, cfg.model.backend, hf_state)
                          if cfg.algorithm.beta > 0 and not self.lora.enabled else None)
        # fp32 whatever the parameters' dtype: in bf16, (1 - decay) x a small update would round away.
        self.ema = (_frozen_copy(self.family, mcfg, groups, cfg.model.backend, hf_state).float()
                    if cfg.optim.ema_decay > 0 else None)
        if self.ema is not None:
            names = [n for n, _ in self.model.named_parameters()]
            if names != [n for n, _ in self.ema.named_parameters()]:
                raise RuntimeError("the EMA copy's parameters do not match the model's")
        # DiffusionNFT's old (sampling) policy, when its decay schedule lets it lag the model within this run: a
        # frozen fp32 copy (as the EMA's), checkpointed under `nft_old.`. Without one (or while the schedule is
        # 0) the old policy is the model as the step starts.
        self.nft_old = None
        if old_policy_lags(cfg.algorithm, cfg.steps * cfg.optim.mini_batches):
            self.nft_old = _frozen_copy(self.family, mcfg, groups, cfg.model.backend, hf_state).float()
        self.extra_copies = {} if self.nft_old is None else {"nft_old": self.nft_old}
        o = cfg.optim
        # bf16: Megatron-Core's mixed precision (bf16 parameters, fp32 main params and Adam state, grads reduced
        # in fp32), as Megatron-LM's --bf16; the same with the distributed optimizer.
        self.ddp, self.optimizer = build_ddp_and_optimizer(
            self.model, mcfg, groups.mcore,
            OptimizerSettings(lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                              adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                              distributed_optimizer=o.distributed_optimizer),
        )
        total_updates = cfg.steps * o.mini_batches
        self.scheduler = build_scheduler(self.optimizer, o.lr, o.weight_decay, o.warmup_steps, total_updates)
        self.pipeline = PipelineStep(mcfg, groups)
        self.shares_model = _rollout_uses_trainer_model(cfg, mcfg.params_dtype, self.engine.dtype)
        # The bridge into the engine's transformer (coverage-checked): direct copies into its live shards where
        # they sit in this process at the trainer's tp, else full tensors gathered over tp into its loader. With
        # pp > 1 each stage's first rank broadcasts its stage's buckets so every engine gets all blocks. LoRA:
        # the adapters alone (gathered, loaded through the engine's peft loader), or merged weights through
        # the same bridge (`rollout.lora_sync`).
        self.lora_sync = None
        lora_mode = (lora_sync_mode(r.lora_sync, r.engine, self.quantization.enabled, r.vllm_omni_process)
                     if self.lora.enabled else None)
        if lora_mode is not None and dist.get_rank() == 0:  # what `auto` chose, in the run's log
            print(f"rollout.lora_sync={r.lora_sync}: {lora_mode} ({r.engine} engine)", flush=True)
        if lora_mode == "adapter":
            self.lora_sync = LoRAAdapterSync(self.model, self.engine, self.family, self.hf_config, self.lora_linears,
                                             self.lora.rank, self.lora.alpha, groups.tp, groups.mcore.pp,
                                             self.model.global_name)
        sink = self.engine.weight_sink()
        plans = family_plans(self.family, self.hf_config, trainer_tp=p.tp, trainer_pp=p.pp, rollout_kind=sink.kind,
                             rollout_tp=sink.tp, mode=_sync_mode(sink, p))
        if len(plans) != 1:
            raise ValueError(f"model family {self.family.name!r} has weight parts {sorted(plans)}; a DiT's engine "
                             "takes one (its transformer)")
        (part, plan), = plans.items()
        transport = None
        if p.pp > 1:
            # Every rank's engine gets every stage's blocks from the stage's first rank. The trainer's ranks of a
            # disaggregated job broadcast over their own group (the job's rollout ranks take no part).
            first = groups.first_rank
            roots = groups.layout.stage_roots(first)
            members = range(first, first + groups.layout.world_size)
            transport = DistributedTransport(sources=roots, rollout_ranks=members, dtype=mcfg.params_dtype,
                                             groups=None if job_group is None else dict.fromkeys(roots, job_group))
        sources = self.family.megatron_sources(self.model)[part]
        if lora_mode == "merge":
            sources = MergedSources(sources, merged_linears(self.model, self.model.global_name))
        self.weight_sync = None
        if self.lora_sync is None:
            self.weight_sync = WeightSync(plan, sources=sources, target=sink.target, tp_group=groups.tp,
                                          tp_rank=groups.tp.rank(), stage=groups.coords["pp"], transport=transport)
        self.guard = GradGuard(cfg.optim.max_bad_steps, "optim.max_bad_steps", job_group)
        traits = self.family.traits
        pooled_dim = None if traits.pooled_dim_key is None else int(self.hf_config[traits.pooled_dim_key])
        guided = traits.guidance_embeds_key is not None and bool(self.hf_config.get(traits.guidance_embeds_key))
        self.probe = probe_trajectory(self.hf_config, platform.device(), channels=traits.token_channels(self.hf_config),
                                      text_dim=int(self.hf_config[traits.text_dim_key]), pooled_dim=pooled_dim,
                                      distilled_guidance=PROBE_DISTILLED_GUIDANCE if guided else None)
        self.probe_tolerance = probe_tolerance(mcfg.params_dtype, self.engine.dtype)
        self.syncs = 0
        self.last_quantized_probe: QuantizedProbe | None = None
        if self.shares_model:
            self.engine.velocity_model = DiffusersForward(self.model)

    # ------------------------------------------------------------------------------------------ pieces

    def sampling_params(self, step: int | None = None) -> SamplingParams:
        """The rollout's sampler (`rollout.*`), or with `step` the one RL step `step` samples with under
        `algorithm.name` (`objectives.step_sampling_params`: MixGRPO's window, DiffusionNFT's ODE)."""
        base = self.cfg.rollout.sampling_params()
        return base if step is None else step_sampling_params(self.cfg.algorithm, base, step)

    def step_prompts(self, step: int) -> tuple[list[str], list[int], list[int]]:
        """This data-parallel rank's prompts, global group ids and per-sample seeds for RL step `step`."""
        r = self.cfg.rollout
        return step_prompts(self.cfg.prompts, self.cfg.seed, step, r.prompts_per_step, r.group_size,
                            self.groups.dp.rank(), self.groups.dp.size())

    def sync_weights(self) -> float:
        """Push the trained weights into the rollout engine's transformer through the bridge (raises on any
        unwritten or doubly written rollout element), then prove the engine holds them (`check_engine`).
        A step calls it only when the engine samples with its own copy; with a shared model it refreshes that
        (unused) copy. Returns the probe's max |difference|. Collective."""
        with self.engine.weight_update():
            if self.lora_sync is not None:
                self.lora_sync.sync()
            else:
                self.weight_sync.sync()
                if isinstance(self.weight_sync.sources, MergedSources):
                    self.weight_sync.sources.forget()
        self.syncs += 1
        return self.check_engine(f"after weight sync {self.syncs}")

    def check_engine(self, what: str) -> float:
        """The transition means of the fixed probe batch under the engine's transformer against the trainer
        model's; raises `ProbeMismatch` naming the max difference and the tolerance (set by the two dtypes)
        when they differ by more. Returns the max difference. Collective (the replica and the engine's ranks).

        A quantized engine (`rollout.quantization`) is held to `check_quantized_probe`: its unquantized view
        within the dtypes' tolerance of the trainer (returned), its quantized means within the quantizer's bound
        (kept in `last_quantized_probe`); an engine with FP8 weights only, its means within both bounds of the
        trainer's (returned)."""
        diff, got = check_engine_probe(self.engine, self.quantization, self.probe, self.probe_means(),
                                       self.probe_tolerance, what)
        if got is not None:
            self.last_quantized_probe = got
        return diff

    def probe_means(self) -> torch.Tensor:
        """The trainer model's transition means [1, 1, 4, C] of the fixed probe batch (every rank of the replica;
        what an engine's probe forward must match). Collective over the replica."""
        rows = plan_micro_batches(torch.arange(len(self.probe)), self.probe.window_size, None)
        return self.pipeline.from_last_stage(self.pipeline.transitions(self.ddp, self.probe, rows,
                                                                       return_means=True).means)

    def probe_metrics(self, diff: float) -> dict[str, float]:
        """The step's probe keys after the sync whose max difference is `diff` (`check_engine`): with a quantized
        engine also the quantizer's move of the probe and its bound."""
        out = {"sync_probe_max_diff": diff}
        if self.last_quantized_probe is not None:
            out.update(sync_probe_quant_diff=self.last_quantized_probe.quantization_diff,
                       sync_probe_quant_bound=self.last_quantized_probe.bound)
        return out

    @contextmanager
    def unquantized_rollout(self) -> Iterator[None]:
        """Inside, the rollout engine samples with its quantizers off (the same synced weights, unrounded): the
        evaluation's unquantized comparison. Nothing changes for an unquantized engine. Raises RuntimeError for a
        quantized engine without that view (vLLM-Omni's FP8 engine holds FP8 weights only)."""
        if not self.quantization.enabled:
            yield
            return
        quantizer = getattr(self.engine, "quantizer", None)
        if quantizer is None:
            raise RuntimeError(f"the {type(self.engine).__name__} holds quantized weights only: it cannot sample "
                               "unquantized (rollout.engine=diffusers can)")
        with quantizer.disabled():
            yield

    def close(self) -> None:
        """Release the rollout engine (its workers or its parallel state)."""
        self.engine.close()

    def content_metadata(self, step: int) -> dict[str, Any]:
        """What a checkpoint after `step` RL steps records about the model (family, config, layout; with LoRA
        its settings and base, `lora_identity`)."""
        return content_metadata(self.family.name, self.hf_config, model_layout(self.model), step=step,
                                **self.checkpoint_identity)

    def micro_batches(self, n: int, window: int, step: int) -> list[list[MicroBatch]]:
        """RL step `step`'s mini-batches (a fixed random split of the N samples), each as its micro-batches
        (chunks of optim.micro_batch_size transitions: sample x window step)."""
        return [plan_micro_batches(rows, window, self.cfg.optim.micro_batch_size)
                for rows in mini_batch_rows(n, self.cfg.seed, step, self.cfg.optim.mini_batches)]

    def old_log_probs(self, traj: Trajectory, step: int) -> torch.Tensor:
        """[N, W] log-probs of the trajectory under the current model (forward only, the same micro-batches
        as the update), on every rank of the replica."""
        return self.old_transitions(traj, step).log_probs

    def old_transitions(self, traj: Trajectory, step: int, return_means: bool = False):
        """The trajectory's transitions under the current model (`PipelineStep.transitions`: log-probs [N, W] on
        every rank of the replica, means [N, W, S, C] on the last stage when `return_means`)."""
        flat = [mb for mini in self.micro_batches(*traj.log_probs.shape, step) for mb in mini]
        return self.pipeline.transitions(self.ddp, traj, flat, return_means=return_means)

    def reference_means(self, traj: Trajectory, step: int) -> torch.Tensor | None:
        """[N, W, S, C] transition means under the frozen reference (last pipeline stage; None elsewhere or
        when beta == 0): the initial model's copy, or with LoRA the policy with its adapters off (the base)."""
        if self.cfg.algorithm.beta == 0:
            return None
        flat = [mb for mini in self.micro_batches(*traj.log_probs.shape, step) for mb in mini]
        if self.reference is None:
            with adapters_disabled(self.model):
                return self.pipeline.transitions(self.ddp, traj, flat, return_means=True).means
        return self.pipeline.transitions(self.reference, traj, flat, return_means=True).means

    @torch.no_grad()
    def update_ema(self) -> None:
        """ema <- decay * ema + (1 - decay) * weights, for this rank's parameter shards (after an optimizer step;
        nothing without `optim.ema_decay`)."""
        if self.ema is None:
            return
        weight = 1.0 - self.cfg.optim.ema_decay
        for e, p in zip(self.ema.parameters(), self.model.parameters(), strict=True):
            e.lerp_(p.detach().to(e.dtype), weight)

    @contextmanager
    def evaluation_weights(self) -> Iterator[None]:
        """Collective (every rank): inside, the model, and the engine when it samples with its own copy, hold
        the EMA weights; on exit the trained weights again, bit for bit. Without an EMA nothing changes."""
        with self._holding(self.ema, sync_in=not self.shares_model, sync_out=not self.shares_model):
            yield

    def _holding(self, source: torch.nn.Module | None, sync_in: bool, sync_out: bool) -> Iterator[None]:
        """`holding_weights` on this trainer's model and weight sync."""
        return holding_weights(self.model, source, self.sync_weights, sync_in=sync_in, sync_out=sync_out)

    def lagging_old_policy(self) -> torch.nn.Module | None:
        """DiffusionNFT's old-policy copy when it differs from the model now (the decay of the last blend, at the
        optimizer updates done, was > 0), else None: the model itself is the old policy."""
        return lagging_old_policy(self.nft_old, self.cfg.algorithm, self.scheduler.num_steps)

    def update_old_policy(self) -> float:
        """After a step's updates: old <- decay old + (1 - decay) model (DiffusionNFT's old policy), decay from the
        schedule at the optimizer updates done. Returns the decay (0 without a lagging copy)."""
        if self.nft_old is None:
            return 0.0
        return blend_old_policy(self.nft_old, self.model, self.cfg.algorithm, self.scheduler.num_steps)

    # ------------------------------------------------------------------------------------------- a step

    def train_step(self, step: int) -> StepResult:
        """One synchronous RL step: this rank's rollout of step `step`, then `train_on` it (update and sync)."""
        t: dict[str, float] = {}
        if hasattr(self.engine, "step"):
            self.engine.step = step  # named in the engine's fault report (vLLM-Omni's: a worker that died)
        prompts, group_ids, seeds = self.step_prompts(step)
        # DiffusionNFT with a lagging old policy samples with it (the engine gets the old weights; the update's
        # sync brings the trained ones back).
        old_policy = self.lagging_old_policy()
        t0 = time.perf_counter()
        with self._holding(old_policy, sync_in=not self.shares_model, sync_out=False):
            traj, local_rewards, t["reward"] = self.rollout(prompts, seeds, self.sampling_params(step))
        self.engine.sleep()  # its memory is the update's until the sync
        t["rollout"] = time.perf_counter() - t0 - t["reward"]
        return self.train_on(step, traj, local_rewards, group_ids, t, old_policy)

    def train_on(self, step: int, traj: Trajectory, local_rewards: torch.Tensor, group_ids: list[int],
                 t: dict[str, float], old_policy: torch.nn.Module | None = None, sync: bool = True) -> StepResult:
        """The step after the rollout, the same for the synchronous and the asynchronous loop: rewards [N] of
        this rank's trajectory (N = prompts x group_size samples, `group_ids` one per prompt) -> group
        advantages -> old log-probs (and the truncated importance weights of `algorithm.is_cap`, which also
        correct an asynchronous rollout's version gap) -> updates -> with `sync`, the weight sync into this
        rank's engine (the asynchronous loop pushes to the rollout ranks instead). `t`: the phases' seconds so
        far (more are added). Collective over the trainer's ranks."""
        cfg = self.cfg
        gid = traj.group_ids = torch.tensor([g for g in group_ids for _ in range(cfg.rollout.group_size)],
                                            dtype=torch.long)
        all_rewards, all_gids, offset = gather_rewards(self.groups.dp, local_rewards, gid)
        adv, all_rewards, term_metrics = self.advantages_of(local_rewards, all_rewards, all_gids)
        advantages = adv.advantages[offset: offset + len(traj)]

        gap: dict[str, float] = {}
        if uses_log_probs(cfg.algorithm):
            objective, dlogp_mean, gap = self.policy_gradient_objective(traj, advantages, step, t)
        else:
            objective = self.nft_objective(traj, advantages, step, t, old_policy)
            dlogp_mean = float("nan")  # an ODE rollout records no log-probs
            gap = {"nft_sigma_max": float(objective.draws.sigmas.max())}  # this rank's highest training noise level
        t0 = time.perf_counter()
        train_metrics = self.run_updates(objective, step)
        t["train"] = time.perf_counter() - t0
        if self.nft_old is not None:
            train_metrics["old_policy_decay"] = self.update_old_policy()
        self.engine.wake_up()
        probe = {}
        if sync and not self.shares_model:
            t0 = time.perf_counter()
            probe = self.probe_metrics(self.sync_weights())
            t["sync"] = time.perf_counter() - t0

        metrics = {**step_metrics(all_rewards, adv.zero_std_ratio, dlogp_mean, t, self.groups.layout.world_size),
                   **term_metrics, **gap, **train_metrics, **probe}
        return StepResult(metrics=metrics, trajectory=traj, rewards=local_rewards, images=traj.images,
                          prompts=list(traj.prompts))

    def advantages_of(self, local_rewards: torch.Tensor, all_rewards: torch.Tensor,
                      all_gids: torch.Tensor) -> tuple[Advantages, torch.Tensor, dict[str, float]]:
        """Group advantages of the gathered rewards [N]; with a weighted reward's terms (the reward function's,
        for this rank's samples), the terms of all data-parallel ranks: an optional term that failed on any rank
        is left out of every sample's reward (so of the normalisation), by name; `reward.term_advantages`
        normalises each term before the sum (GDPO). Returns (advantages, the rewards [N] they are of, the
        per-term metrics). Collective over data parallel."""
        a = self.cfg.algorithm
        terms = getattr(self.reward_fn, "terms", None)
        if terms is not None and len(terms.values) != len(local_rewards):
            terms = None  # scored elsewhere (the asynchronous loop's shares): no per-sample terms here
        terms = gather_terms(self.groups.dp, terms)  # every rank calls it: all have terms or none (one spec)
        if terms is None:
            return (group_advantages(all_rewards, all_gids, std_mode=a.std_mode, clip=a.adv_clip), all_rewards, {})
        exclude = terms.excluded()
        rewards = terms.combined(exclude)
        if self.cfg.reward.term_advantages:
            keep = [j for j, k in enumerate(terms.names) if k not in exclude]
            adv = term_advantages(terms.values[:, keep], torch.tensor([terms.weights[j] for j in keep]), all_gids,
                                  std_mode=a.std_mode, clip=a.adv_clip)
        else:
            adv = group_advantages(rewards, all_gids, std_mode=a.std_mode, clip=a.adv_clip)
        return adv, rewards, terms.metrics(exclude)

    def policy_gradient_objective(self, traj: Trajectory, advantages: torch.Tensor, step: int,
                                  t: dict[str, float]) -> tuple[FlowGRPOObjective, float, dict[str, float]]:
        """The clipped surrogate of the step (flowgrpo, mixgrpo, grpo_guard) with the old log-probs (recomputed,
        or the rollout's in bypass mode; GRPO-Guard also the old transition means), the KL's reference means
        and, with `algorithm.is_cap`, the truncated importance weights of the rollout's transitions; the mean
        trainer/rollout log-prob gap, and the step's gap metrics (`train_rollout_dlogp_max`, with the weights
        `importance_metrics`). Adds the phases' seconds to `t`."""
        a = self.cfg.algorithm
        guard = a.name == "grpo_guard"
        t0 = time.perf_counter()
        old, old_means = traj.log_probs, None
        if a.old_logprob == "recompute" or guard:
            rec = self.old_transitions(traj, step, return_means=guard)
            old = rec.log_probs if a.old_logprob == "recompute" else traj.log_probs
            old_means = rec.means
        dlogp_mean, dlogp_max = self.logp_gap(old, traj.log_probs, step)
        gap = {"train_rollout_dlogp_max": dlogp_max}
        weights = None
        if a.importance_weighted:
            iw = truncated_importance_weights(old, traj.log_probs, a.is_cap, a.is_level)
            weights = iw.weights
            gap.update(self.importance_metrics(iw))
        t["old_logprob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref_means = self.reference_means(traj, step)
        if a.beta > 0:
            t["reference"] = time.perf_counter() - t0
        objective = FlowGRPOObjective(traj, old, advantages, a.clip_range, a.beta, ref_means,
                                      old_means if guard else None, is_weights=weights)
        return objective, dlogp_mean, gap

    def importance_metrics(self, iw: ImportanceWeights) -> dict[str, float]:
        """The truncated importance weights' metrics over the step's samples of every data-parallel rank
        (`iw` of this rank's [N, W] log-probs): `is_weight_mean`, `is_weight_max`, `is_truncated_frac` (of the
        weighted units: transitions, or samples) and `train_rollout_dlogp_after_is` (the gap the weights leave
        uncorrected, per transition). Collective over data parallel."""
        m = iw.metrics
        entries = float(iw.weights.numel())
        units = entries if self.cfg.algorithm.is_level == "token" else float(iw.weights.shape[0])
        sums = torch.stack([m["is_weight_mean"].double() * entries, m["is_truncated_frac"].double() * units,
                            m["dlogp_abs_mean_after"].double() * units,
                            torch.tensor(entries, dtype=torch.float64), torch.tensor(units, dtype=torch.float64)])
        peak = m["is_weight_max"].double().clone()
        if self.groups.dp.size() > 1:
            dist.all_reduce(sums, group=self.groups.dp)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.groups.dp)
        return {"is_weight_mean": float(sums[0] / sums[3]), "is_weight_max": float(peak),
                "is_truncated_frac": float(sums[1] / sums[4]), "train_rollout_dlogp_after_is": float(sums[2] / sums[4])}

    def nft_objective(self, traj: Trajectory, advantages: torch.Tensor, step: int, t: dict[str, float],
                      old_policy: torch.nn.Module | None) -> NftObjective:
        """DiffusionNFT's objective of the step: each sample's noised points (`NftPoints`), their velocities under
        the old policy (the model as it starts the step, or the lagging copy's weights) and, with
        `algorithm.beta > 0`, under the reference. Adds the phases' seconds to `t` (`old_logprob`: the old
        policy's pass)."""
        a = self.cfg.algorithm
        grids = nft_grids(traj.sigmas, getattr(self.engine, "experts", None))
        count = max(1, int((grids.shape[1] - 1) * a.nft.timestep_fraction))
        draws = NftPoints.draw(traj, count, grids)
        flat = [mb for mini in self.micro_batches(len(traj), count, step) for mb in mini]
        shape = (len(traj), count, *traj.final_latents.shape[1:])

        def make(mb: MicroBatch):
            return nft_inputs(traj, draws, mb)

        t0 = time.perf_counter()
        with self._holding(old_policy, sync_in=False, sync_out=False):
            old_v = self.pipeline.velocities(self.ddp, flat, make, shape, traj.final_latents.device)
        t["old_logprob"] = time.perf_counter() - t0
        ref_v = None
        if a.beta > 0:
            t0 = time.perf_counter()
            if self.reference is None:
                with adapters_disabled(self.model):
                    ref_v = self.pipeline.velocities(self.ddp, flat, make, shape, traj.final_latents.device)
            else:
                ref_v = self.pipeline.velocities(self.reference, flat, make, shape, traj.final_latents.device)
            t["reference"] = time.perf_counter() - t0
        return NftObjective(traj, draws, nft_reward_weight(a, advantages), old_v, a.nft.mix_beta, a.adv_clip,
                            a.nft.weight_min, kl_beta=a.beta, ref_velocity=ref_v)

    def logp_gap(self, old: torch.Tensor, rollout: torch.Tensor, step: int) -> tuple[float, float]:
        """`logp_gap` of this trainer's data-parallel group and `algorithm.max_logp_gap`."""
        return logp_gap(old, rollout, step, self.groups.dp, self.cfg.algorithm.max_logp_gap)

    def rollout(self, prompts: list[str], seeds: list[int],
                params: SamplingParams | None = None) -> tuple[Trajectory, torch.Tensor, float]:
        """This data-parallel rank's samples (`group_size` per prompt, row-major) with their rewards [N] and
        the seconds spent waiting for rewards after the last image, sampled with `params` (default: the
        rollout's `sampling_params()`).

        The ranks of one model replica (tp x cp x pp) split the samples into contiguous shares, each rolls
        out and scores its share (images stream to the scorer as they finish), then the shares are gathered
        so every rank of the replica holds the same trajectory. Samples depend only on their seeds, so the
        split does not change what is generated.
        """
        g = self.cfg.rollout.group_size
        rows = [(p, s) for p, s in zip((p for p in prompts for _ in range(g)), seeds)]
        size, rank = self.groups.replica.size(), self.groups.replica.rank()
        mine = rows[rank * len(rows) // size: (rank + 1) * len(rows) // size]
        part, rewards, wait = None, torch.empty(0), 0.0
        params = params or self.sampling_params()
        if size > 1 and params.text_length is None:
            params = replace(params, text_length=self.common_text_length(prompts, params))
        if mine:
            self.reward_fn.begin(len(mine))
        if mine or self.engine.collective:  # a collective engine needs every peer's call, empty shares too
            part = self.engine.generate([p for p, _ in mine], params, group_size=1,
                                        seeds=[s for _, s in mine], on_sample=self.reward_fn.on_sample)
        if mine:
            t0 = time.perf_counter()
            rewards = self.reward_fn.collect()
            wait = time.perf_counter() - t0
        if size == 1:
            return part, rewards, wait
        shares: list = [None] * size
        terms = getattr(self.reward_fn, "terms", None) if mine else None
        dist.all_gather_object(shares, (part, rewards, wait, terms), group=self.groups.replica)
        traj = Trajectory.concat([tr for tr, _, _, _ in shares if tr is not None])
        if hasattr(self.reward_fn, "terms"):  # the replica's terms, in the order of its trajectory
            self.reward_fn.terms = RewardTerms.concat([t for tr, _, _, t in shares if tr is not None])
        return traj, torch.cat([r for _, r, _, _ in shares]), max(w for _, _, w, _ in shares)

    def common_text_length(self, prompts: list[str], params: SamplingParams) -> int:
        """The text length every share of this replica's rollout pads to: the longest of its prompts (and the
        negative prompt under CFG), as one engine call over all of them would pad. The recompute runs the
        gathered trajectory at one length, and a share padded shorter would round bf16 attention differently."""
        texts = list(prompts)
        if params.do_cfg:
            # an editing family encodes the negative prompt with each record's sources, as that record's instruction
            negative = self.family.traits.negative_text
            texts += ([negative(p, params.negative_prompt) for p in prompts] if negative is not None
                      else [params.negative_prompt])
        return min(params.max_sequence_length, max(self.engine.text_lengths(texts)))

    def _update(self, traj: Trajectory, old: torch.Tensor, advantages: torch.Tensor, step: int,
                ref_means: torch.Tensor | None = None) -> dict[str, float]:
        """FlowGRPO's mini-batch updates of RL step `step`: old [N, W] log-probs, advantages [N], ref_means from
        `reference_means` when beta > 0. Returns metrics averaged over micro-batches (every rank)."""
        a = self.cfg.algorithm
        return self.run_updates(FlowGRPOObjective(traj, old, advantages, a.clip_range, a.beta, ref_means), step)

    def run_updates(self, objective: Objective, step: int) -> dict[str, float]:
        """The mini-batch updates of RL step `step` with `objective` (its trajectory's N samples x its `points`
        each, split into mini-batches of samples and micro-batches of points). Returns the metrics averaged over
        micro-batches (every rank)."""
        minis = self.micro_batches(len(objective.traj), objective.points, step)
        per_micro: list[dict[str, float]] = []
        tally = UpdateTally()
        for micro_batches in minis:
            res, metrics = update(self.ddp, self.optimizer, self.scheduler, self.guard, self.groups.mcore,
                                  lambda mbs=micro_batches: self.pipeline.forward_backward(self.ddp, mbs, objective))
            per_micro += metrics
            tally.add(res)
            if res.stepped and res.ok:
                self.update_ema()
        sums = {k: sum(m[k] for m in per_micro) / len(per_micro) for k in per_micro[0]}
        return {**sums, **tally.metrics(self.optimizer)}


def nft_grids(sigmas: torch.Tensor, experts: Any | None) -> torch.Tensor:
    """The sampling grids [N, T' + 1] DiffusionNFT draws its noise levels from: the rollout's grids [N, T + 1], or
    on a two-expert (Wan2.2 A14B) folder the low-noise expert's part of them (the steps from the first one it runs,
    to 0): the policy is that expert, so it trains where it samples. Raises ValueError when it runs no step."""
    if experts is None:
        return sigmas
    first = experts.high_noise(sigmas[:, :-1]).sum(1)
    if bool((first != first[0]).any()) or int(first[0]) >= sigmas.shape[1] - 1:
        raise ValueError(f"algorithm.name=diffusionnft on a two-expert folder trains the low-noise expert at its "
                         f"noise levels, but the grid's high-noise steps are {first.tolist()} of {sigmas.shape[1] - 1}"
                         ": sample with more steps (rollout.num_steps) or a folder whose boundary leaves it steps")
    return sigmas[:, int(first[0]):]


def logp_gap(old: torch.Tensor, rollout: torch.Tensor, step: int, dp: Any, bound: float | None
             ) -> tuple[float, float]:
    """Mean and max |old - rollout| over RL step `step`'s samples of every rank of the data-parallel group `dp`
    (old, rollout [N, W] log-probs of this rank's trajectory). Raises LogpGapError on every rank when the mean
    exceeds `bound` (`algorithm.max_logp_gap`; None: never). Collective over `dp`."""
    gap = (old - rollout).abs().double()
    sums = torch.stack([gap.sum(), torch.tensor(float(gap.numel()), dtype=torch.float64)])
    peak = gap.max() if gap.numel() else torch.zeros((), dtype=torch.float64)
    if dp.size() > 1:
        dist.all_reduce(sums, group=dp)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=dp)
    mean, peak = float(sums[0] / sums[1]), float(peak)
    if bound is not None and mean > bound:
        raise LogpGapError(step, mean, peak, bound)
    return mean, peak


class LogpGapError(RuntimeError):
    """The rollout's log-probs and the trainer's recomputation of them differ by more than
    `algorithm.max_logp_gap` (mean |dlogp| over the step's samples)."""

    def __init__(self, step: int, mean: float, peak: float, bound: float) -> None:
        super().__init__(f"step {step}: mean |logp_trainer - logp_rollout| = {mean:.3e} (max {peak:.3e}) exceeds "
                         f"algorithm.max_logp_gap = {bound:.3e}; the rollout engine and the trainer disagree "
                         "(dtypes, weights or padding)")
        self.step, self.mean, self.peak, self.bound = step, mean, peak, bound


def _initial_weights(state: dict[str, torch.Tensor], pipeline_dir: str | Path,
                     dtype: torch.dtype, component: str = "transformer") -> dict[str, torch.Tensor]:
    """The diffusers-named weights the trainer starts from: the engine's (`initial_state_dict`), unless it
    holds them in a narrower dtype than the trainer's (a bf16 engine for an fp32 model), then the folder's own
    tensors of the policy's `component` (a Wan2.2 A14B folder's low-noise `transformer_2`)."""
    held = {t.dtype for t in state.values() if t.is_floating_point()}
    if all(torch.finfo(h).bits >= torch.finfo(dtype).bits for h in held):
        return state
    folder = SafetensorsFolder(Path(pipeline_dir) / component)
    return {name: folder.read(name) for name in folder.entries}


def _sync_mode(sink: WeightSink, p: ParallelConfig) -> str:
    """The bridge's mode rule (`sync_mode`), where the engine's shards are live tensors in this process; `full`
    into an engine in other processes (vLLM-Omni's workers on GPU take full tensors through their loader)."""
    return sync_mode(p.tp, p.pp, sink.tp) if sink.in_place else "full"


def _rollout_uses_trainer_model(cfg: JobConfig, model_dtype: torch.dtype, engine_dtype: torch.dtype) -> bool:
    """Whether the engine samples with the trainer's module (`rollout.transformer`; auto: the diffusers engine
    at a one-rank replica whose parameters are in the engine's dtype, unquantized; vLLM-Omni always samples with its own
    transformer). Raises when `trainer` is asked for with the dtypes apart."""
    p = cfg.parallel
    one_rank = p.tp * p.ulysses * p.ring * p.pp == 1 and cfg.rollout.engine == "diffusers"
    if cfg.rollout.transformer == "trainer" and model_dtype != engine_dtype:
        raise ValueError(f"rollout.transformer=trainer: the model's parameters are {model_dtype}, the engine "
                         f"samples in {engine_dtype}")
    return cfg.rollout.transformer == "trainer" or (cfg.rollout.transformer == "auto" and one_rank
                                                     and model_dtype == engine_dtype
                                                     and cfg.rollout.quantization == "none")


def _count_stage_replicas_once(model: MMDiTModel, groups: ParallelGroups) -> None:
    """Every pipeline stage holds a replica of the conditioning embedders (the parameters marked
    `pipeline_parallel`: the timestep embedder, and SD3.5's / FLUX's pooled and guidance embedders; their grads are
    summed over stages): mark the copies past the first stage `shared` so the grad norm (and clipping) counts them
    once, as at pp=1."""
    if groups.layout.pp > 1 and not groups.is_first_stage:
        for p in model.parameters():
            if getattr(p, "pipeline_parallel", False):
                p.shared = True


def _frozen_copy(family: ModelFamily, mcfg: MMDiTConfig, groups: ParallelGroups, backend: str,
                 hf_state: dict[str, torch.Tensor]) -> MMDiTModel:
    """A frozen model of the same layout and weights (the KL reference); building it leaves the torch and
    Megatron RNG streams where they were, so a beta > 0 run samples what a beta = 0 run samples."""
    tracker = tensor_parallel.get_cuda_rng_tracker()
    states = tracker.get_states()
    with torch.random.fork_rng():
        ref = family.build_model(mcfg, groups, backend=backend)
    tracker.set_states(states)
    family.load_state(ref, hf_state)
    ref.requires_grad_(False)
    return ref.eval()
