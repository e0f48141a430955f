"""What `algorithm.name` changes in BAGEL's trainer (`trainer.bagel`), as `trainer.objectives` does for the DiT
families.

| name | rollout | trained points | loss |
|---|---|---|---|
| flowgrpo, grpo_guard | SDE window drawn per sample | the window's transitions | `trainer.bagel._update`'s |
| mixgrpo | one window per RL step, sliding (`window_start_at`) | the same | FlowGRPO's |
| diffusionnft | the ODE over BAGEL's schedule | noised points of each clean sample | `algorithms.nft.nft_loss` |

DiffusionNFT's points are those of the DiT families (`trainer.objectives.NftPoints`: noise levels drawn from the
sample's sampling grid, here BAGEL's shifted schedule, and noise, both from the sample's seed); the velocity at a
point is our `BagelMoT`'s guided velocity (`trainer.bagel.velocity`: the prompt's text KV, BAGEL's text CFG where
the rollout applied it, `t` in the CFG interval, and its image CFG), so the policy the loss trains is the one the
ODE rollout sampled with.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_omni.algorithms.grpo_guard import grpo_guard_loss
from megatron_omni.algorithms.loss import flowgrpo_loss
from megatron_omni.algorithms.mixgrpo import window_start_at
from megatron_omni.algorithms.nft import NftLoss, nft_loss, noised_latents
from megatron_omni.rollout.vllm_omni.bagel import BagelSampling, BagelTrajectory, flow_schedule
from megatron_omni.trainer.config import AlgorithmConfig
from megatron_omni.trainer.objectives import NftPoints


def window_policy_loss(new: torch.Tensor, means: torch.Tensor, stds: torch.Tensor, traj: BagelTrajectory,
                       old: torch.Tensor, adv: torch.Tensor, clip_range: float | tuple[float, float], beta: float,
                       kl: torch.Tensor | None, old_means: torch.Tensor | None = None) -> Any:
    """The policy-gradient loss over `traj`'s window transitions: log-probs `new` [N, W], transition means
    [N, W, n, p] and noise coefficients `stds` [N, W] under the model; old log-probs [N, W], advantages [N], the KL
    per transition [N, W] or None. FlowGRPO's clipped surrogate (MixGRPO's too), or with `old_means` [N, W, n, p]
    (the recompute's) GRPO-Guard's normalised ratio, one row per (sample, window step), each with its own
    transition scale and step. The same at pp 1 and on the last stage of pp > 1 (`trainer.bagel_pipeline`)."""
    if old_means is None:
        return flowgrpo_loss(new, old, adv, clip_range, beta, kl)
    w = new.shape[1]
    dt = (traj.sigmas_next - traj.sigmas).float().to(new.device)
    scale = stds * torch.sqrt(-dt)  # the sde step's std of x_{i+1} (`algorithms.sde`; guard: sde only)
    return grpo_guard_loss(new.flatten(), old.flatten(), adv.repeat_interleave(w), means.flatten(0, 1),
                           old_means.flatten(0, 1), scale.flatten(), dt.flatten(), clip_range, beta,
                           None if kl is None else kl.flatten())


def step_sampling(algorithm: AlgorithmConfig, sampling: BagelSampling, step: int) -> BagelSampling:
    """The sampler of RL step `step` (0-based) under `algorithm`: MixGRPO fixes every sample's window start at
    `window_start_at(step, ...)` inside the window range; DiffusionNFT samples with the ODE (noise 0, nothing
    recorded); the others as given."""
    if algorithm.name == "diffusionnft":
        return dataclasses.replace(sampling, noise_level=0.0)
    if algorithm.name != "mixgrpo":
        return sampling
    m = algorithm.mixgrpo
    start = window_start_at(step, sampling.window_size, sampling.window_bounds(), m.steps_per_move, m.shift,
                            m.roll_back)
    return dataclasses.replace(sampling, window_start=start)


def nft_points(traj: BagelTrajectory, sampling: BagelSampling, count: int) -> NftPoints:
    """Each sample's `count` training points: noise levels of BAGEL's schedule (`flow_schedule`, the grid the
    rollout stepped over, without its final 0) and noise [N, count, n, p], from the sample's seed."""
    grid = flow_schedule(sampling.num_timesteps, sampling.timestep_shift)
    return NftPoints.of(traj.final_latents, grid.expand(len(traj), -1), traj.seeds, count)


def noised_points(traj: BagelTrajectory, points: NftPoints, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x0, x_t) [B, J, n, p] fp32 of samples `rows`: their clean latents and the forward process
    `x_t = (1 - t) x0 + t eps` at their points."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    j = points.sigmas.shape[1]
    x0 = traj.final_latents[idx][:, None].expand(-1, j, -1, -1).float()
    xt = noised_latents(x0.flatten(0, 1), points.sigmas[idx].flatten(), points.noise[idx].flatten(0, 1))
    return x0, xt.view(x0.shape)


def nft_point_inputs(points: NftPoints, xt: torch.Tensor, sampling: BagelSampling, rows: Sequence[int]
                     ) -> list[tuple[torch.Tensor, torch.Tensor, list[float]]]:
    """Samples `rows`' noised points as velocity inputs, in the order of `rows`: x_t [J, n, p] (`noised_points`),
    t [J] and the text CFG scale each is guided with (`sampling.cfg_text_scale` where t lies in the CFG interval, as
    the rollout applied it; 1 elsewhere). The pipelined update's `trainer.bagel_pipeline.Points`."""
    lo, hi = sampling.cfg_interval
    return [(xt[b], points.sigmas[i].float(), [sampling.cfg_text_scale if lo < float(t) <= hi else 1.0
                                               for t in points.sigmas[i]])
            for b, i in enumerate(rows)]


def nft_velocities(model: Any, traj: BagelTrajectory, points: NftPoints, xt: torch.Tensor, markers: torch.Tensor,
                   sampling: BagelSampling, rows: Sequence[int], text_grad: bool = False) -> torch.Tensor:
    """[B, J, n, p] fp32: our `BagelMoT`'s (pp 1) guided velocity at the noised points xt [B, J, n, p]
    (`noised_points`) of samples `rows`, conditioned as the rollout was (the prompt's text KV; text CFG as
    `nft_point_inputs` gives it; the trajectory's image CFG and renorm). Differentiable where grad is on; the
    prompt's pass under autograd only with `text_grad` (`model.bagel_experts=both`)."""
    from megatron_omni.trainer.bagel import velocity

    out = []
    for (x, ts, scales), i in zip(nft_point_inputs(points, xt, sampling, rows), rows, strict=True):
        ids = traj.prompt_ids[i]
        with contextlib.nullcontext() if text_grad else torch.no_grad():
            _, kv, _ = model.stage_text(ids)
        out.append(torch.stack([velocity(model, kv, ids.shape[0], markers, x[j], traj.grid, float(ts[j]), scale,
                                         traj.cfg_renorm_min, traj.cfg_img_scale)
                                for j, scale in enumerate(scales)]))
    return torch.stack(out)


@dataclass
class BagelNftStep:
    """One RL step's DiffusionNFT data: the points (`nft_points`), the old policy's velocities there and, with
    `algorithm.beta > 0`, the reference's (both [N, J, n, p] fp32, no grad; at pp > 1 on the last stage only, where
    the loss is computed, None before it), the reward weights [N] (`algorithms.nft.optimality_probability` of the
    advantages) and the step's sampler."""

    points: NftPoints
    sampling: BagelSampling
    old_velocity: torch.Tensor | None
    reward_weight: torch.Tensor
    algorithm: AlgorithmConfig
    ref_velocity: torch.Tensor | None = None

    def loss(self, model: Any, traj: BagelTrajectory, markers: torch.Tensor, rows: torch.Tensor,
             text_grad: bool = False) -> NftLoss:
        """`nft_loss` over the points of samples `rows` (a mini-batch), the current velocities through `model`
        (pp 1)."""
        _, xt = noised_points(traj, self.points, rows.tolist())
        v = nft_velocities(model, traj, self.points, xt, markers, self.sampling, rows.tolist(), text_grad)
        return self.loss_of(v, traj, rows)

    def point_inputs(self, traj: BagelTrajectory, rows: torch.Tensor
                     ) -> list[tuple[torch.Tensor, torch.Tensor, list[float]]]:
        """Samples `rows`' points as the pipelined update takes them (`nft_point_inputs`)."""
        return nft_point_inputs(self.points, noised_points(traj, self.points, rows.tolist())[1], self.sampling,
                                rows.tolist())

    def loss_of(self, v: torch.Tensor, traj: BagelTrajectory, rows: torch.Tensor) -> NftLoss:
        """`nft_loss` over the points of samples `rows` given their current velocities v [B, J, n, p] (pp 1's, or
        the last stage's at pp > 1)."""
        a, idx = self.algorithm, rows.tolist()
        x0, xt = noised_points(traj, self.points, idx)
        j = v.shape[1]
        ref = None if self.ref_velocity is None else self.ref_velocity[rows].flatten(0, 1)
        weight = self.reward_weight[rows].repeat_interleave(j)
        return nft_loss(v.flatten(0, 1), self.old_velocity[rows].flatten(0, 1), x0.flatten(0, 1),
                        xt.flatten(0, 1), self.points.sigmas[rows].flatten(), weight,
                        a.nft.mix_beta, a.adv_clip, a.nft.weight_min, kl_beta=a.beta, ref_velocity=ref)
