"""The AR-DiT RL step: joint GRPO over plan tokens and FlowGRPO over SDE window steps, on the Megatron hybrid.

rollout (embedded torch hybrid: plan tokens, then the DiT's SDE window) -> rewards -> group advantages ->
old log-probs (recomputed by the Megatron hybrid, or the rollout's) -> mini-batch updates of the joint
objective `w_tok L_GRPO(tokens) + w_win L_FlowGRPO(window)` through Megatron-Core DDP and optimizer ->
weight sync into the rollout hybrid.

The window log-probs depend on the decoder through the conditioning, so the window term trains the decoder
too (unless it is frozen). The backward runs in two phases with the same gradients as one: the DiT phase
stops at the conditioning (a detached leaf), the decoder phase backpropagates the token loss together with
the conditioning's gradient. This keeps the two halves' time separately measurable (`time_decoder`,
`time_dit`). `freeze="decoder"` trains connector + DiT, `freeze="dit"` trains the decoder only.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate

from megatron_omni.algorithms.advantages import group_advantages
from megatron_omni.algorithms.loss import flowgrpo_loss
from megatron_omni.algorithms.token_loss import grpo_token_loss, joint_loss
from megatron_omni.algorithms.transition import transition_step
from megatron_omni.bridge import WeightSync
from megatron_omni.bridge.family_sync import family_plans
from megatron_omni.bridge.targets import DiffusersTarget
from megatron_omni.checkpoint.sharded_state import ar_dit_content_metadata, ar_dit_sharded_state_dict
from megatron_omni.models.ar.context_parallel import gather_sequence, split_sequence
from megatron_omni.models.ar.decoder import token_log_probs
from megatron_omni.models.ar.hybrid import ARDiTModel
from megatron_omni.parallel.groups import ParallelGroups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.rollout.diffusers_engines.ar_dit import (
    ARDiTRolloutEngine,
    ARDiTSamplingParams,
    ARDiTTrajectory,
    plan_positions,
)
from megatron_omni.rollout.vllm_omni.hybrid import VllmOmniHybridDiT
from megatron_omni.rollout.vllm_omni.plan_writer import VLLMPlanWriter
from megatron_omni.trainer.config import JobConfig
from megatron_omni.trainer.grad_guard import GradGuard
from megatron_omni.trainer.rewards import gather_rewards
from megatron_omni.trainer.skeleton import StepResult, UpdateTally, mini_batch_rows, step_metrics, step_prompts, update
from megatron_omni.trainer.training_state import OptimizerSettings, build_ddp_and_optimizer, build_scheduler
from model_providers import get_family

if TYPE_CHECKING:
    from model_providers.ar_dit.provider import TorchHybrid

RewardFn = Callable[[ARDiTTrajectory], torch.Tensor]
FREEZE = (None, "decoder", "dit")


@dataclass
class ARDiTTrainConfig:
    """One AR-DiT RL job. `prompts` are token-id lists; rows of a step: `prompts_per_step` x `group_size`."""

    hybrid: str = "tiny"
    seed: int = 0
    prompts: list[list[int]] = field(default_factory=lambda: [[5, 6, 7], [9, 10], [20, 21, 22, 23]])
    prompts_per_step: int = 2
    group_size: int = 4
    # The tiny hybrid's window: 4 steps, noise 0.7 (the shared defaults are the Qwen-Image ones).
    sampling: ARDiTSamplingParams = field(default_factory=lambda: ARDiTSamplingParams(num_steps=4, noise_level=0.7))
    lr: float = 1e-3
    decoder_lr_scale: float = 1.0  # the decoder's lr is lr * this (its updates move the DiT's conditioning too)
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    mini_batches: int = 1
    token_clip: float | tuple[float, float] = 0.2
    window_clip: float | tuple[float, float] = 1e-3
    token_weight: float = 1.0
    window_weight: float = 1.0
    aggregation: str = "token_mean"
    std_mode: str = "global"
    freeze: str | None = None
    old_logprob: str = "recompute"  # "recompute" (Megatron hybrid, no grad) | "rollout"
    max_bad_steps: int = 3  # updates with NaN/inf gradients in a row (each skipped) before the run stops

    def __post_init__(self) -> None:
        if self.freeze not in FREEZE:
            raise ValueError(f"freeze must be one of {FREEZE}, got {self.freeze!r}")
        if self.old_logprob not in ("recompute", "rollout"):
            raise ValueError(f"old_logprob must be 'recompute' or 'rollout', got {self.old_logprob!r}")
        if self.mini_batches < 1 or self.prompts_per_step < 1 or self.group_size < 1 or self.max_bad_steps < 1:
            raise ValueError("mini_batches, prompts_per_step, group_size and max_bad_steps must be >= 1")
        if not self.prompts:
            raise ValueError("no prompts")
        if self.lr <= 0 or self.decoder_lr_scale <= 0:
            raise ValueError(f"lr and decoder_lr_scale must be > 0, got {self.lr}, {self.decoder_lr_scale}")
        if self.freeze == "decoder" and self.window_weight == 0:
            raise ValueError("freeze='decoder' with window_weight=0 leaves nothing to train")
        if self.freeze == "dit" and self.token_weight == 0 and self.window_weight == 0:
            raise ValueError("all part weights are 0")

    @classmethod
    def from_job(cls, cfg: JobConfig) -> ARDiTTrainConfig:
        """The trainer's settings of a `JobConfig` with model.family=ar_dit (validated by `JobConfig.validate`):
        the hybrid preset is model.preset, the prompts' token ids are `prompts`, the window's SDE settings and
        the group sizes come from `rollout`, the optimizer from `optim`, the window's clip range and the
        advantages' std mode from `algorithm`, the rest from the `ar_dit` section."""
        a, o, al, r = cfg.ar_dit, cfg.optim, cfg.algorithm, cfg.rollout
        return cls(
            hybrid=cfg.model.preset, seed=cfg.seed, prompts=[[int(t) for t in p.split()] for p in cfg.prompts],
            prompts_per_step=r.prompts_per_step, group_size=r.group_size,
            sampling=ARDiTSamplingParams.from_config(r, max_plan_tokens=a.max_plan_tokens,
                                                     temperature=a.temperature, grid=tuple(a.grid)),
            lr=o.lr, decoder_lr_scale=a.decoder_lr_scale, weight_decay=o.weight_decay,
            adam_betas=(o.adam_beta1, o.adam_beta2), adam_eps=o.adam_eps, clip_grad=o.clip_grad,
            mini_batches=o.mini_batches, token_clip=a.token_clip, window_clip=al.clip_range,
            token_weight=a.token_weight, window_weight=a.window_weight, aggregation=a.aggregation,
            std_mode=al.std_mode, freeze=a.freeze,
            old_logprob="rollout" if al.old_logprob == "bypass" else "recompute", max_bad_steps=o.max_bad_steps)


def load_trajectory_reward(spec: str, vocab_size: int) -> RewardFn:
    """The reward `ar_dit.reward` names: MODULE:CALLABLE called with vocab_size= (a callable trajectory ->
    [N] rewards, optionally with `parts(trajectory) -> dict[str, float]`). Raises ValueError naming the spec."""
    module, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"ar_dit.reward={spec!r}: {exc}") from exc
    return factory(vocab_size=vocab_size)


class ARDiTTrainer:
    """Model, optimizer, rollout engine and reward of one rank (pp = 1; tp, cp and dp as laid out: under
    context parallelism the decoder runs on its token shard and the DiT on its image shard, each cp rank
    computing the whole loss from the gathered log-probs)."""

    def __init__(self, cfg: ARDiTTrainConfig, groups: ParallelGroups, reward_fn: RewardFn,
                 hybrid: TorchHybrid | None = None, plan_writer: VLLMPlanWriter | None = None,
                 vllm_omni_dit: torch.nn.Module | None = None, dit_server: VllmOmniHybridDiT | None = None) -> None:
        """`hybrid`: the rollout's torch hybrid (default: the config's preset, seeded); `plan_writer` (a
        `VLLMPlanWriter`) and `vllm_omni_dit` (vLLM-Omni's transformer) or `dit_server` (a served vLLM-Omni
        engine): the rollout's halves in vLLM engines (see `ARDiTRolloutEngine`; default: torch)."""
        if groups.layout.pp != 1:
            raise ValueError(f"the AR-DiT trainer runs pp=1; got {groups.layout}")
        self.cfg, self.groups, self.reward_fn = cfg, groups, reward_fn
        seed_everything(cfg.seed, tp_rank=groups.tp.rank())
        self.family = get_family("ar_dit")
        ref = hybrid if hybrid is not None else self.family.reference_model(cfg.hybrid, seed=cfg.seed)
        self.engine = ARDiTRolloutEngine(ref, plan_writer=plan_writer, vllm_omni_dit=vllm_omni_dit,
                                         dit_server=dit_server)
        self.model: ARDiTModel = self.family.build_model(ref.config, groups)
        self.family.load_state(self.model, ref.state())
        # Without vLLM halves every part (decoder, connector, DiT) reaches the embedded torch hybrid through the
        # bridge (a plan per part from the family's shapes, shards gathered over tp, coverage checked); vLLM
        # engines check their own names and shapes on a full-tensor load.
        self.weight_syncs: list[WeightSync] = []
        if vllm_omni_dit is None and dit_server is None and plan_writer is None:
            plans = family_plans(self.family, ref.config, trainer_tp=groups.tp.size(), rollout_kind="diffusers",
                                 mode="full")
            sources = self.family.megatron_sources(self.model)
            hybrid = self.engine.hybrid
            modules = {"decoder": hybrid.decoder, "connector": hybrid.connector, "dit": hybrid.dit}
            self.weight_syncs = [WeightSync(plan, sources=sources[part], target=DiffusersTarget(modules[part]),
                                            tp_group=groups.tp, tp_rank=groups.tp.rank())
                                 for part, plan in plans.items()]
        frozen = {"decoder": [self.model.decoder], "dit": [self.model.connector, self.model.dit]}.get(cfg.freeze, [])
        for module in frozen:
            module.requires_grad_(False)
        self.guard = GradGuard(cfg.max_bad_steps)
        decoder_ids = {id(p) for p in self.model.decoder.parameters()}
        dec_lr = cfg.lr * cfg.decoder_lr_scale
        # A decoder group only when its lr differs. `lr_mult` (not applied by Megatron-Core's scheduler, which
        # reads max_lr/min_lr) tells the two groups apart when a checkpoint's optimizer state is matched to them.
        overrides = {ParamKey(predicate=ParamPredicate(name="ar_decoder", fn=lambda p: id(p) in decoder_ids)):
                     {"max_lr": dec_lr, "min_lr": dec_lr, "lr_mult": cfg.decoder_lr_scale}
                     } if cfg.decoder_lr_scale != 1.0 else None
        self.ddp, self.optimizer = build_ddp_and_optimizer(
            self.model, self.model.config, groups.mcore,
            OptimizerSettings(lr=cfg.lr, weight_decay=cfg.weight_decay, adam_beta1=cfg.adam_betas[0],
                              adam_beta2=cfg.adam_betas[1], adam_eps=cfg.adam_eps, clip_grad=cfg.clip_grad),
            config_overrides=overrides)
        # Constant schedule; it applies each parameter group's own max_lr (the decoder's scale).
        self.scheduler = build_scheduler(self.optimizer, cfg.lr, cfg.weight_decay)

    # ----------------------------------------------------------------------------------- checkpoints
    # The hybrid's sharded state for checkpoints (decoder, connector and DiT under their own prefixes).
    sharded_state = staticmethod(ar_dit_sharded_state_dict)
    checkpoint_identity: dict = {}  # nothing beyond the model config a resume must match (no LoRA base)
    ema = None  # no EMA of the weights
    extra_copies: dict = {}  # no other frozen copies (DiffusionNFT's old policy is the DiT trainer's)

    def content_metadata(self, step: int) -> dict[str, Any]:
        """What a checkpoint records about the model: the hybrid config (the same after every step)."""
        return ar_dit_content_metadata(self.engine.hybrid.config.to_dict())

    def sync_weights(self) -> float:
        """Load the trained hybrid's weights into the rollout engines (through the bridge, which raises on any
        rollout element left unwritten or written twice, when the rollout is the embedded torch hybrid; as full
        tensors into vLLM halves); returns the seconds it took. Collective."""
        t0 = time.perf_counter()
        if not self.weight_syncs:
            self.engine.load_weights(*self.family.export_state(self.model))
        for sync in self.weight_syncs:
            sync.sync()
        return time.perf_counter() - t0

    def close(self) -> None:
        """Nothing to release: the embedded engines live in this process."""

    # ------------------------------------------------------------------------------------- log-probs
    def encode(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The hybrid's decoder pass on tokens [B, L], right-padded with the pad id to a multiple of 2 * cp
        (Megatron's causal token split; padding never reaches a real position). Returns (conditioning
        [B, L, j], logits [L' / cp, B, V/tp] of this cp rank's shard, the padded tokens [B, L'])."""
        unit = 2 * self.groups.cp.size() if self.groups.cp.size() > 1 else 1
        length = tokens.shape[1]
        pad = -length % unit
        if pad:
            tokens = torch.cat([tokens, tokens.new_full((tokens.shape[0], pad), self.engine.pad)], 1)
        cond, logits = self.model.encode(tokens)
        return cond[:, :length], logits, tokens

    def token_log_probs(self, traj: ARDiTTrajectory, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Plan-token log-probs [B, P] (0 outside the plan) from `encode`'s logits of its padded `tokens`
        [B, L'], at the rollout's temperature; differentiable. Under cp each rank scores its shard of the
        shifted labels and the shards are gathered (the same loss on every cp rank)."""
        cp = self.model.decoder.cp_group
        labels = torch.cat([tokens[:, 1:], tokens[:, -1:]], 1)  # position t predicts t + 1; the last is unused
        lp = token_log_probs(logits / traj.temperature, split_sequence(labels, 1, cp).t(), self.groups.tp)
        lp = gather_sequence(lp, 0, cp).t()  # [B, L']
        idx = plan_positions(traj.prompt_lens, traj.plan_mask.shape[1]).clamp(max=traj.tokens.shape[1] - 2)
        return lp.gather(1, idx) * traj.plan_mask

    def window_log_probs(self, traj: ARDiTTrajectory, cond: torch.Tensor) -> torch.Tensor:
        """Window log-probs [B, W] of `traj` under the DiT conditioned on `cond` [B, L, j]; differentiable."""
        sub = dataclasses.replace(traj.image, prompt_embeds=cond)
        rows = torch.arange(len(traj))
        return torch.stack([transition_step(sub, self.model.velocity_model, rows, j).log_prob
                            for j in range(traj.image.window_size)], dim=1)

    @torch.no_grad()
    def recompute(self, traj: ARDiTTrajectory) -> tuple[torch.Tensor, torch.Tensor]:
        """(token log-probs [N, P], window log-probs [N, W]) of a trajectory under the current hybrid."""
        cond, logits, tokens = self.encode(traj.tokens)
        return self.token_log_probs(traj, logits, tokens), self.window_log_probs(traj, cond)

    # ------------------------------------------------------------------------------------------ a step
    def step_prompts(self, step: int) -> tuple[list[list[int]], list[int], list[int]]:
        """This dp rank's prompts, global group ids and per-sample seeds for RL step `step`."""
        c = self.cfg
        return step_prompts(c.prompts, c.seed, step, c.prompts_per_step, c.group_size,
                            self.groups.dp.rank(), self.groups.dp.size())

    def train_step(self, step: int) -> StepResult:
        """One RL step: metrics (with the reward's `parts`, if it has them), this rank's trajectory, its
        rewards [N], and its images with the prompts' token ids as text."""
        c = self.cfg
        t: dict[str, float] = {}
        prompts, gids, seeds = self.step_prompts(step)
        self.engine.stats.update(decoder_s=0.0, dit_s=0.0)
        t0 = time.perf_counter()
        traj = self.engine.generate(prompts, c.sampling, group_size=c.group_size, seeds=seeds, group_ids=gids)
        t["rollout"] = time.perf_counter() - t0
        rewards = self.reward_fn(traj).detach().float()
        if rewards.shape != (len(traj),) or not bool(torch.isfinite(rewards).all()):
            raise ValueError(f"reward_fn must return {len(traj)} finite rewards, got {tuple(rewards.shape)}")
        all_r, all_g, offset = gather_rewards(self.groups.dp, rewards, traj.image.group_ids)
        adv = group_advantages(all_r, all_g, std_mode=c.std_mode)
        advantages = adv.advantages[offset: offset + len(traj)]
        t0 = time.perf_counter()
        if c.old_logprob == "recompute":
            old_tok, old_win = self.recompute(traj)
        else:
            old_tok, old_win = traj.token_log_probs, traj.image.log_probs
        t["old_logprob"] = time.perf_counter() - t0
        dlogp_tok = float(((old_tok - traj.token_log_probs).abs() * traj.plan_mask).sum() / traj.plan_mask.sum())
        dlogp_win = float((old_win - traj.image.log_probs).abs().mean())
        metrics, phases = self._update(traj, old_tok, old_win, advantages, step)
        t["train"] = phases["decoder"] + phases["dit"]
        t["sync"] = self.sync_weights()
        metrics.update({
            **step_metrics(all_r, adv.zero_std_ratio, dlogp_win, t, self.groups.layout.world_size),
            "train_rollout_dlogp_token": dlogp_tok, "plan_len_mean": float(traj.plan_lens.float().mean()),
            # the two halves' share of rollout + update (not phases of the step: time_step does not sum them)
            "time_decoder": self.engine.stats["decoder_s"] + phases["decoder"],
            "time_dit": self.engine.stats["dit_s"] + phases["dit"],
        })
        parts = getattr(self.reward_fn, "parts", None)
        if parts is not None:
            metrics.update(parts(traj))
        return StepResult(metrics, traj, rewards, traj.image.images,
                          [" ".join(str(int(t)) for t in ids[:n]) for ids, n in zip(traj.tokens, traj.prompt_lens)])

    def _update(self, traj: ARDiTTrajectory, old_tok: torch.Tensor, old_win: torch.Tensor, adv: torch.Tensor,
                step: int) -> tuple[dict[str, float], dict[str, float]]:
        c = self.cfg
        sums: dict[str, float] = {}
        phases = {"decoder": 0.0, "dit": 0.0}
        tally = UpdateTally()
        chunks = mini_batch_rows(len(traj), c.seed, step, c.mini_batches)
        for rows in chunks:
            t_update = time.perf_counter()
            res, (metrics, spent) = update(self.ddp, self.optimizer, self.scheduler, self.guard, self.groups.mcore,
                                           lambda rows=rows: self._backward(traj.select(rows), old_tok[rows],
                                                                            old_win[rows], adv[rows], phases))
            # the grads' reduction, the guard and the optimizer step: shared work, counted once (small)
            phases["dit"] += time.perf_counter() - t_update - spent
            tally.add(res)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) / len(chunks)
        return {**sums, **tally.metrics(self.optimizer)}, phases

    def _backward(self, sub: ARDiTTrajectory, old_tok: torch.Tensor, old_win: torch.Tensor, adv: torch.Tensor,
                  phases: dict[str, float]) -> tuple[dict[str, Any], float]:
        """Forward and backward of the joint loss on the mini-batch `sub` (old log-probs [B, P] / [B, W],
        advantages [B]), adding each half's seconds to `phases`. Returns (the loss metrics, seconds spent)."""
        c = self.cfg
        t0 = start = time.perf_counter()
        cond, logits, tokens = self.encode(sub.tokens)
        tok = grpo_token_loss(self.token_log_probs(sub, logits, tokens), old_tok, adv, sub.plan_mask,
                              c.token_clip, c.aggregation) if c.token_weight > 0 else None
        phases["decoder"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        leaf = cond.detach().requires_grad_(cond.requires_grad)
        win = flowgrpo_loss(self.window_log_probs(sub, leaf), old_win, adv,
                            c.window_clip) if c.window_weight > 0 else None
        _, metrics = joint_loss(tok, win, c.token_weight, c.window_weight)
        # Every cp rank computes the whole loss; Megatron's convention (its schedules do the same) scales it
        # by cp, since the gathers' backward keeps each rank's own slice and DDP averages over dp x cp.
        cp_scale = float(self.groups.cp.size())
        if win is not None and win.loss.requires_grad:
            (cp_scale * c.window_weight * win.loss).backward()
        phases["dit"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        outs, grads = [], []
        if tok is not None and tok.loss.requires_grad:
            outs.append(cp_scale * c.token_weight * tok.loss)
            grads.append(None)
        if leaf.grad is not None:
            outs.append(cond)
            grads.append(leaf.grad)
        if outs:
            torch.autograd.backward(outs, grads)
        phases["decoder"] += time.perf_counter() - t0
        return metrics, time.perf_counter() - start
