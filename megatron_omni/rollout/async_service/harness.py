"""A trainer rank and rollout ranks of a disaggregated placement over a tiny pipeline folder, built on each rank
inside `parallel.rank_pool.run_ranks`, for the asynchronous-RL tests and `benchmarks/async_step.py` (as
`rank_pool` serves both): the placement's groups, the trainer's Megatron model loaded from the pipeline's
transformer (tp 1), the bridge's full-mode plan into a diffusers engine, the rollout service with its
double-buffered receiver, and a real FlowGRPO update (Megatron forward through the diffusers interface, group
advantages, the clipped loss, Adam) standing in for the trainer's until phase 2 (docs/async.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from diffusers import QwenImageTransformer2DModel

from megatron_omni.algorithms.advantages import group_advantages
from megatron_omni.algorithms.loss import flowgrpo_loss
from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.bridge import DistributedTransport, WeightSync
from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.placement import Placement, PlacementGroups, build_placement_groups, split_world
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.rollout.async_service import AsyncSettings, RolloutService, WeightReceiver
from megatron_omni.rollout.base import SamplingParams, Trajectory
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
from megatron_omni.rollout.probe import probe_trajectory
from model_providers.qwen_image import provider

PROMPTS = ["a red cube", "a photo of a cat", "a city at night", "a bowl of fruit"]
PARAMS = SamplingParams(height=32, width=32, num_steps=4, window_size=2, noise_level=1.0)


@dataclass
class Pair:
    placement: Placement
    groups: PlacementGroups
    trainer_groups: Any  # ParallelGroups on the trainer ranks, None on the rollout ranks
    hf_config: dict[str, Any]
    plan: Any
    transport: DistributedTransport

    @property
    def role(self) -> str:
        return self.placement.role(self.groups.rank)


def build_pair(pipeline: str, world_size: int, rollout_ranks: int = 1) -> Pair:
    """Collective on every rank: the disaggregated placement (the last `rollout_ranks` ranks roll out), its groups,
    the trainer's Megatron groups over the trainer ranks, the bridge's plan and transport."""
    placement = split_world("disaggregated", world_size, rollout_ranks)
    groups = build_placement_groups(placement)
    trainer_groups = build_parallel_groups(ParallelLayout(tp=1), ranks=placement.trainer_range)
    hf_config = json.loads((Path(pipeline) / "transformer" / "config.json").read_text())
    hf_config = {k: v for k, v in hf_config.items() if not k.startswith("_")}
    plan = qwen_image_plan(hf_config, trainer_tp=1, rollout_kind="diffusers", rollout_tp=1, mode="full")
    transport = DistributedTransport(sources=[placement.trainer_root], rollout_ranks=placement.rollout_owners,
                                     dtype=torch.float32, groups=groups.weights)
    return Pair(placement, groups, trainer_groups, hf_config, plan, transport)


def trainer_model(pair: Pair, pipeline: str,
                  lr: float = 1e-3) -> tuple[torch.nn.Module, torch.optim.Optimizer, WeightSync]:
    """The trainer's Megatron model (tp 1) with the pipeline's transformer weights, its Adam, and the bridge's sync
    of its weights to the rollout ranks."""
    seed_everything(0)
    model = provider.build_model(provider.transformer_config(pair.hf_config, tp=1), pair.trainer_groups)
    ref = QwenImageTransformer2DModel.from_pretrained(Path(pipeline) / "transformer", local_files_only=True)
    provider.load_hf_state_dict(model, ref.state_dict())
    sync = WeightSync(pair.plan, sources=megatron_sources(model), target=None, transport=pair.transport)
    return model, torch.optim.Adam(model.parameters(), lr=lr), sync


@torch.no_grad()
def probe_means(model: torch.nn.Module, hf_config: dict[str, Any]) -> torch.Tensor:
    """The trainer model's transition means [1, 1, 4, C] of the fixed probe batch (what each swap is checked
    against)."""
    return recompute_log_probs(probe_trajectory(hf_config), DiffusersForward(model), return_means=True).means


def rollout_service(pair: Pair, pipeline: str, settings: AsyncSettings,
                    max_batch_size: int = 8) -> tuple[RolloutService, DiffusersRolloutEngine]:
    """The rollout rank's service over an embedded diffusers engine, its weights double-buffered."""
    engine = DiffusersRolloutEngine(pipeline, max_batch_size=max_batch_size)
    receiver = WeightReceiver(engine, pair.plan, pair.transport, torch.float32, pair.groups.rank,
                              wait_timeout_s=settings.liveness_timeout_s)
    return RolloutService(engine, pair.groups, receiver, settings), engine


def reward(images: torch.Tensor) -> torch.Tensor:
    """[N, 3, H, W] -> [N]: how red the image is (cheap and learnable; the benchmark times the phases)."""
    return images[:, 0].mean(dim=(1, 2)) - images[:, 1:].mean(dim=(1, 2, 3))


def flowgrpo_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, traj: Trajectory,
                    group_size: int) -> dict[str, float]:
    """One FlowGRPO update on `traj`: group advantages of `reward`, log-probs recomputed by the Megatron model,
    the clipped loss, Adam."""
    rewards = reward(traj.images)
    gids = torch.arange(len(traj)) // group_size
    adv = group_advantages(rewards, gids, std_mode="group", clip=5.0).advantages
    optimizer.zero_grad(set_to_none=True)
    with torch.enable_grad():
        lp = recompute_log_probs(traj, DiffusersForward(model)).log_probs
        out = flowgrpo_loss(lp, traj.log_probs, adv, clip_range=1e-3)
        out.loss.backward()
    optimizer.step()
    return {"loss": float(out.loss.detach()), "reward": float(rewards.mean())}


def step_rows(step: int, prompts_per_step: int, group_size: int) -> tuple[list[str], list[int]]:
    """The prompts (each repeated `group_size` times) and per-sample seeds of RL step `step`."""
    prompts = [PROMPTS[(step * prompts_per_step + i) % len(PROMPTS)] for i in range(prompts_per_step)]
    rows = [p for p in prompts for _ in range(group_size)]
    return rows, [1000 * step + i for i in range(len(rows))]
