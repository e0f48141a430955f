"""The FlowGRPO trainer: one readable RL step on the Megatron model.

rollout (embedded engine) -> rewards -> old log-probs (recomputed by the Megatron model, or the rollout's in
`bypass` mode) -> group advantages -> mini-batch updates through Megatron-Core's DDP and optimizer
(gradient accumulation over the window steps) -> weight sync into the rollout engine -> metrics.

Data parallel ranks take disjoint prompts; ranks of one model replica (tp x cp) run the same rollout with
the same seeds. Rewards are gathered over data parallel for the advantages (global or per-group std).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_omni.algorithms.advantages import group_advantages
from megatron_omni.algorithms.loss import flowgrpo_loss
from megatron_omni.bridge import DiffusersTarget, WeightSync
from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.parallel.groups import ParallelGroups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.rollout.base import SamplingParams, Trajectory
from megatron_omni.rollout.diffusers_engine import DiffusersRolloutEngine
from megatron_omni.rollout.logprob import recompute_log_probs, transition_step
from megatron_omni.trainer.config import JobConfig
from megatron_omni.trainer.rewards import RewardFunction
from model_providers.qwen_image import provider


@dataclass
class StepResult:
    metrics: dict[str, float]
    trajectory: Trajectory
    rewards: torch.Tensor


class FlowGRPOTrainer:
    """Holds the model, optimizer, rollout engine and reward function of one rank."""

    def __init__(self, cfg: JobConfig, groups: ParallelGroups, pipeline_dir: str | Path,
                 reward_fn: RewardFunction) -> None:
        self.cfg = cfg
        self.groups = groups
        self.reward_fn = reward_fn
        seed_everything(cfg.seed, tp_rank=groups.tp.rank())
        self.engine = DiffusersRolloutEngine(pipeline_dir, max_batch_size=cfg.rollout.max_batch_size)
        p = cfg.parallel
        overrides = {}
        if cfg.model.recompute == "full":
            overrides = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=None)
        elif cfg.model.recompute == "selective":
            overrides = dict(recompute_granularity="selective")
        mcfg = provider.transformer_config(dict(self.engine.transformer.config), tp=p.tp, pp=p.pp,
                                           ulysses=p.ulysses, ring=p.ring, **overrides)
        self.model = provider.build_model(mcfg, groups, backend=cfg.model.backend)
        provider.load_hf_state_dict(self.model, self.engine.transformer.state_dict())
        self.ddp = DistributedDataParallel(
            config=mcfg,
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                     use_distributed_optimizer=False),
            module=self.model,
            pg_collection=groups.mcore,
        )
        o = cfg.optim
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=o.lr, min_lr=o.lr, weight_decay=o.weight_decay,
                            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                            clip_grad=o.clip_grad, params_dtype=mcfg.params_dtype),
            [self.ddp], use_gloo_process_groups=False, pg_collection=groups.mcore,
        )
        total_updates = cfg.steps * o.mini_batches
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.lr,
            lr_warmup_steps=o.warmup_steps, lr_decay_steps=max(total_updates, o.warmup_steps + 1),
            lr_decay_style="constant", start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=total_updates, wd_incr_style="constant",
        )
        self.velocity = DiffusersForward(self.model)
        # Full-mode bridge into the engine's diffusers transformer (gathered over tp, coverage-checked).
        plan = qwen_image_plan(dict(self.engine.transformer.config), trainer_tp=p.tp, trainer_pp=p.pp,
                               rollout_kind="diffusers", rollout_tp=1, mode="full")
        self.weight_sync = WeightSync(plan, sources=megatron_sources(self.model),
                                      target=DiffusersTarget(self.engine.transformer), tp_group=groups.tp,
                                      tp_rank=groups.tp.rank(), stage=groups.coords["pp"])
        self.bad_steps = 0

    # ------------------------------------------------------------------------------------------ pieces

    def sampling_params(self) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(
            height=r.height, width=r.width, num_steps=r.num_steps, noise_level=r.noise_level,
            sde_type=r.sde_type, window_size=r.window_size,
            window_range=tuple(r.window_range) if r.window_range else None,
            guidance_scale=r.guidance_scale, negative_prompt=r.negative_prompt,
        )

    def step_prompts(self, step: int) -> tuple[list[str], list[int], list[int]]:
        """This data-parallel rank's prompts, global group ids and per-sample seeds for RL step `step`."""
        r = self.cfg.rollout
        prompts = self.cfg.prompts
        dp, d = self.groups.dp.size(), self.groups.dp.rank()
        global_groups = [(step * r.prompts_per_step + i) for i in range(r.prompts_per_step)]
        mine = global_groups[d::dp]
        seeds = [self.cfg.seed * 1_000_003 + g * r.group_size + k for g in mine for k in range(r.group_size)]
        return [prompts[g % len(prompts)] for g in mine], mine, seeds

    def sync_weights(self) -> None:
        """Push the trained weights into the rollout engine through the bridge (raises on any unwritten
        or doubly written rollout element)."""
        self.weight_sync.sync()

    def _log_probs(self, traj: Trajectory, rows: torch.Tensor, j: int) -> torch.Tensor:
        """Log-probs [B] of window step j for samples `rows` under the current model (with grad)."""
        return transition_step(traj, self.velocity, rows, j).log_prob

    def _grads_finite(self) -> bool:
        ok = torch.tensor([1.0])
        for p in self.model.parameters():
            g = getattr(p, "main_grad", None)
            if g is not None and not bool(torch.isfinite(g).all()):
                ok.zero_()
                break
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank skips together
        return bool(ok.item())

    # ------------------------------------------------------------------------------------------- a step

    def train_step(self, step: int) -> StepResult:
        cfg, t = self.cfg, {}
        prompts, group_ids, seeds = self.step_prompts(step)
        t0 = time.perf_counter()
        self.reward_fn.begin(len(prompts) * cfg.rollout.group_size)
        traj = self.engine.generate(prompts, self.sampling_params(), group_size=cfg.rollout.group_size, seeds=seeds,
                                    on_sample=self.reward_fn.on_sample)
        t["rollout"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        local_rewards = self.reward_fn.collect()
        t["reward"] = time.perf_counter() - t0
        gid = torch.tensor([g for g in group_ids for _ in range(cfg.rollout.group_size)], dtype=torch.long)
        all_rewards, all_gids, offset = self._gather_rewards(local_rewards, gid)
        adv = group_advantages(all_rewards, all_gids, std_mode=cfg.algorithm.std_mode, clip=cfg.algorithm.adv_clip)
        advantages = adv.advantages[offset: offset + len(traj)]

        t0 = time.perf_counter()
        if cfg.algorithm.old_logprob == "recompute":
            with torch.no_grad():
                old = recompute_log_probs(traj, self.velocity).log_probs
        else:
            old = traj.log_probs
        dlogp_rollout = float((old - traj.log_probs).abs().mean())
        t["old_logprob"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        train_metrics = self._update(traj, old, advantages, step)
        t["train"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.sync_weights()
        t["sync"] = time.perf_counter() - t0

        metrics = {
            "reward_mean": float(all_rewards.mean()), "reward_std": float(all_rewards.std(correction=0)),
            "zero_std_ratio": float(adv.zero_std_ratio), "train_rollout_dlogp": dlogp_rollout,
            **train_metrics, **{f"time_{k}": v for k, v in t.items()},
        }
        total = sum(t.values())
        metrics["time_step"] = total
        metrics["images_per_s_per_rank"] = len(all_rewards) / total / self.groups.layout.world_size
        return StepResult(metrics=metrics, trajectory=traj, rewards=local_rewards)

    def _gather_rewards(self, rewards: torch.Tensor, gid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        dp = self.groups.dp
        if dp.size() == 1:
            return rewards, gid, 0
        parts: list = [None] * dp.size()
        dist.all_gather_object(parts, (rewards, gid), group=dp)
        offset = sum(len(p[0]) for p in parts[: dp.rank()])
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]), offset

    def _update(self, traj: Trajectory, old: torch.Tensor, advantages: torch.Tensor, step: int) -> dict[str, float]:
        cfg = self.cfg
        n, w = traj.log_probs.shape
        order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 7919 + step))
        chunks = order.chunk(cfg.optim.mini_batches)
        cp_scale = float(self.groups.layout.cp)  # DDP averages over dp x cp; CP grads are partial sums
        sums: dict[str, float] = {}
        grad_norms = []
        skipped = 0
        for rows in chunks:
            self.ddp.zero_grad_buffer()
            self.optimizer.zero_grad()
            for j in range(w):
                lp = self._log_probs(traj, rows, j)
                out = flowgrpo_loss(lp, old[rows, j], advantages[rows], cfg.algorithm.clip_range)
                (out.loss * cp_scale / w).backward()
                for k, v in out.metrics.items():
                    sums[k] = sums.get(k, 0.0) + float(v) / (w * len(chunks))
            finalize_model_grads([self.ddp], pg_collection=self.groups.mcore)
            if not self._grads_finite():
                skipped += 1
                self.bad_steps += 1
                if self.bad_steps >= cfg.optim.max_bad_steps:
                    raise FloatingPointError(
                        f"{self.bad_steps} updates in a row had NaN/inf gradients (optim.max_bad_steps)"
                    )
                continue
            self.bad_steps = 0
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
            grad_norms.append(float(grad_norm) if grad_norm is not None else math.nan)
        sums["grad_norm"] = sum(grad_norms) / len(grad_norms) if grad_norms else math.nan
        sums["skipped_updates"] = float(skipped)
        sums["lr"] = float(self.optimizer.param_groups[0]["lr"])
        return sums
