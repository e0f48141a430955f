"""What `algorithm.name` changes in the one trainer (`trainer.flowgrpo`): the sampler a step rolls out with and
the loss its micro-batches compute. The math is in megatron_omni/algorithms; here it meets the trajectory.

| name | rollout | trained points | loss |
|---|---|---|---|
| flowgrpo | SDE window drawn per sample | the window's transitions | `algorithms.loss.flowgrpo_loss` |
| mixgrpo | one window per step, sliding over training (Flash: fewer ODE steps after it) | the same | the same |
| grpo_guard | as flowgrpo (`sde` step) | the same | `algorithms.grpo_guard.grpo_guard_loss` |
| diffusionnft | the ODE | `int(T timestep_fraction)` noised points of each clean sample | `algorithms.nft.nft_loss` |

An objective holds one step's data (trajectory, advantages, the old policy's log-probs, means or velocities)
and gives the pipeline (`pipeline_step.PipelineStep.forward_backward`) each micro-batch's forward inputs and,
on the last stage, its loss from the raw velocities.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from megatron_omni.algorithms.grpo_guard import grpo_guard_loss
from megatron_omni.algorithms.loss import flowgrpo_loss, kl_penalty
from megatron_omni.algorithms.mixgrpo import flash_tail_steps, window_start_at
from megatron_omni.algorithms.nft import (
    nft_loss,
    noised_latents,
    old_policy_decay,
    optimality_probability,
    training_sigmas,
)
from megatron_omni.algorithms.transition import TransitionInputs, conditioning, transition_inputs, transition_output
from megatron_omni.algorithms.velocity import GuidedBatch, guided_batch
from megatron_omni.rollout.base import SamplingParams, Trajectory
from megatron_omni.trainer.config import AlgorithmConfig
from megatron_omni.trainer.pipeline_step import MicroBatch

# DiffusionNFT's training noise of sample seed s comes from a generator seeded NFT_NOISE_SEED + s, apart from the
# seeds the rollout draws its samples with (s itself).
NFT_NOISE_SEED = 1 << 40


def step_sampling_params(algorithm: AlgorithmConfig, base: SamplingParams, step: int) -> SamplingParams:
    """The sampler of RL step `step` under `algorithm` from the rollout's (`base`): MixGRPO fixes the step's
    window start (and with Flash the tail's steps), DiffusionNFT samples with the ODE, the others as given."""
    if algorithm.name == "diffusionnft":
        return base.ode()
    if algorithm.name != "mixgrpo":
        return base
    m = algorithm.mixgrpo
    start = window_start_at(step, base.window_size, base.resolved_window_range, m.steps_per_move, m.shift,
                            m.roll_back)
    params = replace(base, window_start=start)
    end = start + base.window_size
    if m.flash_ratio is not None and end < base.num_steps:
        params = replace(params, tail_steps=flash_tail_steps(base.num_steps, end, m.flash_ratio))
    return params


def uses_log_probs(algorithm: AlgorithmConfig) -> bool:
    """Whether the update trains the rollout's recorded SDE transitions (every rule but DiffusionNFT)."""
    return algorithm.name != "diffusionnft"


@dataclass
class FlowGRPOObjective:
    """The clipped surrogate over the window's transitions (flowgrpo, mixgrpo; grpo_guard when `old_means` is
    given). traj with W window steps; old_log_probs [N, W]; advantages [N]; ref_means, old_means [N, W, S, C]
    (read on the last stage; ref_means only when beta > 0); is_weights [N, W] fp32, the truncated importance
    weights of the rollout's transitions (`algorithm.is_cap`; None: off)."""

    traj: Trajectory
    old_log_probs: torch.Tensor
    advantages: torch.Tensor
    clip_range: float | tuple[float, float]
    beta: float = 0.0
    ref_means: torch.Tensor | None = None
    old_means: torch.Tensor | None = None
    is_weights: torch.Tensor | None = None

    @property
    def points(self) -> int:
        """J, the trained points of each sample (its window steps)."""
        return self.traj.log_probs.shape[1]

    def inputs(self, mb: MicroBatch) -> TransitionInputs:
        return transition_inputs(self.traj, mb.rows, mb.js)

    def loss(self, mb: MicroBatch, inputs: TransitionInputs, v_all: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if self.beta > 0 and self.ref_means is None:
            raise ValueError("beta > 0 needs the reference model's transition means")
        step = transition_output(self.traj, inputs, v_all)
        kl = kl_penalty(step.coeffs.mean, self.ref_means[mb.rows, mb.js], step.coeffs.std) if self.beta > 0 else None
        old = self.old_log_probs[mb.rows, mb.js]
        adv = self.advantages[mb.rows]
        w = None if self.is_weights is None else self.is_weights[mb.rows, mb.js]
        if self.old_means is None:
            out = flowgrpo_loss(step.log_prob, old, adv, self.clip_range, beta=self.beta, kl=kl, is_weights=w)
        else:
            out = grpo_guard_loss(step.log_prob, old, adv, step.coeffs.mean, self.old_means[mb.rows, mb.js],
                                  step.coeffs.scale, inputs.sigma_next - inputs.sigma, self.clip_range,
                                  beta=self.beta, kl=kl, is_weights=w)
        metrics = {k: float(v) for k, v in out.metrics.items()}
        metrics["loss"] = float(out.loss.detach())
        if kl is not None:
            metrics["kl"] = float(kl.detach().mean())
        return out.loss, metrics


@dataclass
class NftPoints:
    """DiffusionNFT's training points of a step: sigmas [N, J] (each sample's noise levels) and noise
    [N, J, S, C] fp32, drawn per sample from its own seed so they do not depend on how samples are split."""

    sigmas: torch.Tensor
    noise: torch.Tensor

    @classmethod
    def draw(cls, traj: Trajectory, count: int, grids: torch.Tensor | None = None) -> NftPoints:
        """`count` noise levels of each sample's grid (`training_sigmas`; `grids` [N, T' + 1], default the
        trajectory's sampling grids) and their noise, sample by sample from a generator seeded NFT_NOISE_SEED + its
        seed."""
        if traj.final_latents is None:
            raise ValueError("DiffusionNFT trains on the samples' clean latents; this engine's trajectory has none")
        return cls.of(traj.final_latents, traj.sigmas if grids is None else grids, traj.seeds.tolist(), count)

    @classmethod
    def of(cls, final_latents: torch.Tensor, grids: torch.Tensor, seeds: list[int], count: int) -> NftPoints:
        """`count` noise levels of each sample's sampling grid and noise of its clean latents' shape.
        final_latents [N, ...]; grids [N, T + 1] (decreasing to 0); seeds: N ints."""
        sigmas, noise = [], []
        for i, seed in enumerate(seeds):
            g = torch.Generator().manual_seed(NFT_NOISE_SEED + int(seed))
            sigmas.append(training_sigmas(grids[i: i + 1].cpu(), count, g)[0])
            noise.append(torch.randn((count, *final_latents.shape[1:]), generator=g))
        dev = final_latents.device
        return cls(sigmas=torch.stack(sigmas).to(dev), noise=torch.stack(noise).to(dev))


@dataclass
class NftInputs:
    """One micro-batch's forward-process points: batch (its forward rows, CFG negatives after the B conditional
    ones); x0, xt [B, S, C] fp32 (the clean latents and their noised points); sigma [B]."""

    batch: GuidedBatch
    x0: torch.Tensor
    xt: torch.Tensor
    sigma: torch.Tensor


def nft_inputs(traj: Trajectory, points: NftPoints, mb: MicroBatch) -> NftInputs:
    """The noised points of micro-batch `mb` (rows, js [B]): `x_t = (1 - t) x0 + t eps` at each row's noise level,
    conditioned as the rollout was (the trajectory's guidance scale and negative prompt: with true CFG the
    guided velocity is the policy, as the rollout sampled with it). An image-to-video trajectory's clean condition
    tokens (`clean_tokens`) are not noised: they enter at timestep 0, as the rollout fed them."""
    rows, js = mb.rows, mb.js
    x0 = traj.final_latents[rows].float()
    sigma = points.sigmas[rows, js]
    xt = noised_latents(x0, sigma, points.noise[rows, js])
    k = int(getattr(traj, "clean_tokens", 0))
    if k:  # image-to-video: the condition stays clean (timestep 0 in the forward, as the rollout fed it)
        xt[:, :k] = x0[:, :k]
    neg = traj.negative_prompt_embeds
    batch = guided_batch(xt, sigma, traj.prompt_embeds[rows], traj.prompt_embeds_mask[rows], traj.img_shape,
                         guidance_scale=traj.guidance_scale[rows],
                         negative_embeds=None if neg is None else neg[rows],
                         negative_mask=None if neg is None else traj.negative_prompt_embeds_mask[rows],
                         **conditioning(traj, rows))
    return NftInputs(batch=batch, x0=x0, xt=xt, sigma=sigma)


@dataclass
class NftObjective:
    """DiffusionNFT's loss over the step's noised points. traj (with final_latents); draws (`NftPoints`);
    reward_weight [N]
    (`optimality_probability`); old_velocity, ref_velocity [N, J, S, C] (last stage; ref only when kl_beta > 0)."""

    traj: Trajectory
    draws: NftPoints
    reward_weight: torch.Tensor
    old_velocity: torch.Tensor | None
    mix_beta: float
    adv_clip: float
    weight_min: float
    kl_beta: float = 0.0
    ref_velocity: torch.Tensor | None = None

    @property
    def points(self) -> int:
        """J, the trained points of each sample (its noise levels)."""
        return self.draws.sigmas.shape[1]

    def inputs(self, mb: MicroBatch) -> NftInputs:
        return nft_inputs(self.traj, self.draws, mb)

    def loss(self, mb: MicroBatch, inputs: NftInputs, v_all: torch.Tensor) -> tuple[torch.Tensor, dict]:
        # an image-to-video trajectory's clean condition tokens are no part of the loss (nothing generates them)
        k = int(getattr(self.traj, "clean_tokens", 0))
        ref = self.ref_velocity[mb.rows, mb.js, k:] if self.kl_beta > 0 else None
        out = nft_loss(inputs.batch.combine(v_all)[:, k:], self.old_velocity[mb.rows, mb.js, k:], inputs.x0[:, k:],
                       inputs.xt[:, k:], inputs.sigma, self.reward_weight[mb.rows], self.mix_beta, self.adv_clip,
                       self.weight_min, kl_beta=self.kl_beta, ref_velocity=ref)
        metrics = {k: float(v) for k, v in out.metrics.items()}
        metrics["loss"] = float(out.loss.detach())
        return out.loss, metrics


def old_policy_lags(algorithm: AlgorithmConfig, updates: int) -> bool:
    """Whether DiffusionNFT's old (sampling) policy lags the model after `updates` optimizer updates (its decay
    schedule is > 0 there): a trainer keeps a frozen fp32 copy of it for a run whose last update lags."""
    n = algorithm.nft
    return algorithm.name == "diffusionnft" and old_policy_decay(updates, n.decay_flat, n.decay_rate, n.decay_cap) > 0


def lagging_old_policy(copy: torch.nn.Module | None, algorithm: AlgorithmConfig,
                       updates: int) -> torch.nn.Module | None:
    """The old-policy `copy` when it differs from the model after `updates` optimizer updates, else None (the model
    itself is the old policy)."""
    return copy if copy is not None and old_policy_lags(algorithm, updates) else None


@torch.no_grad()
def blend_old_policy(copy: torch.nn.Module, model: torch.nn.Module, algorithm: AlgorithmConfig, updates: int) -> float:
    """After a step's updates: copy <- decay copy + (1 - decay) model, the decay from the schedule at `updates`
    optimizer updates done (same parameter order and shapes). Returns the decay."""
    n = algorithm.nft
    decay = old_policy_decay(updates, n.decay_flat, n.decay_rate, n.decay_cap)
    for o, p in zip(copy.parameters(), model.parameters(), strict=True):
        o.lerp_(p.detach().to(o.dtype), 1.0 - decay)
    return decay


def nft_reward_weight(algorithm: AlgorithmConfig, advantages: torch.Tensor) -> torch.Tensor:
    """[N] DiffusionNFT's optimality probabilities of the step's advantages [N]."""
    return optimality_probability(advantages, algorithm.adv_clip, algorithm.nft.adv_mode)
