"""Policy versions and the staleness bound of asynchronous RL.

The policy version is the number of optimizer updates (RL steps) the weights have seen: version 0 is the initial
model, and the trainer holds version k while it trains on the trajectories of step k. With `async.max_staleness`
= s the rollout of step k is sampled with version max(0, k - s) (`behaviour_version`): s = 0 is the synchronous,
on-policy algorithm; s = 1 lets the rollout ranks generate step k+1 while the trainer updates on step k. Every
trajectory records the version that sampled it (`Trajectory.policy_version`) and the trainer refuses one older
than the bound (`check_staleness`) instead of training on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_omni.rollout.base import Trajectory


class StalenessError(RuntimeError):
    """A trajectory older than `async.max_staleness` reached the trainer: the message names the step, the oldest
    version, the trainer's version and the bound."""


@dataclass(frozen=True)
class AsyncSettings:
    """The asynchronous rollout's settings (the `async.*` keys; checked here, named as in the config).

    max_staleness: how many updates a trajectory's weights may lag the trainer's (0: on-policy);
    liveness_timeout_s: a rollout rank that sends nothing (no heartbeat, no result) for this long is reported lost;
    heartbeat_s: how often a rollout rank tells the trainer it is alive (well below the timeout);
    stall_timeout_s: a rollout rank that owes samples and finishes none for this long is reported lost even though
    it still answers (its engine is stuck: a hung collective, a deadlock), longer than one batch of samples takes.
    """

    max_staleness: int = 1
    liveness_timeout_s: float = 60.0
    heartbeat_s: float = 2.0
    stall_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(f"async.max_staleness={self.max_staleness!r}: expected an integer >= 0")
        if not self.liveness_timeout_s > 0:
            raise ValueError(f"async.liveness_timeout_s={self.liveness_timeout_s!r}: expected a number > 0")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"async.stall_timeout_s={self.stall_timeout_s!r}: expected a number > 0")
        if not 0 < self.heartbeat_s <= self.liveness_timeout_s / 3:
            raise ValueError(f"async.heartbeat_s={self.heartbeat_s!r}: expected a number in (0, liveness_timeout_s / 3"
                             f" = {self.liveness_timeout_s / 3:g}] (three heartbeats fit in the timeout)")


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version that samples RL step `step` (0-based) under the bound: max(0, step - max_staleness)."""
    if step < 0 or max_staleness < 0:
        raise ValueError(f"step {step} and max_staleness {max_staleness} must be >= 0")
    return max(0, step - max_staleness)


def stamp_version(traj: Trajectory, version: int) -> Trajectory:
    """`traj` with every sample's `policy_version` set to `version` (in place; returned for chaining)."""
    traj.policy_version = torch.full((len(traj),), int(version), dtype=torch.long)
    return traj


def staleness(traj: Trajectory, trainer_version: int) -> torch.Tensor:
    """[N] long: how many updates each sample's weights lag `trainer_version`; raises when a sample has no version
    or a version newer than the trainer's (the weights cannot come from the future)."""
    if traj.policy_version is None:
        raise StalenessError("the trajectory records no policy version (a synchronous rollout's); the asynchronous "
                             "trainer needs one per sample")
    lag = trainer_version - traj.policy_version.long()
    if len(lag) and int(lag.min()) < 0:
        raise StalenessError(f"a sample was drawn with policy version {int(traj.policy_version.max())}, newer than "
                             f"the trainer's {trainer_version}")
    return lag


def check_staleness(traj: Trajectory, trainer_version: int, max_staleness: int, step: int) -> torch.Tensor:
    """Refuse `traj` (StalenessError naming the step) when any sample lags the trainer by more than `max_staleness`
    updates; returns the lags [N] long."""
    lag = staleness(traj, trainer_version)
    if len(lag) and int(lag.max()) > max_staleness:
        raise StalenessError(f"step {step}: a trajectory sampled with policy version {int(traj.policy_version.min())} "
                             f"reached the trainer at version {trainer_version}: {int(lag.max())} updates old, more "
                             f"than async.max_staleness={max_staleness}")
    return lag


def staleness_histogram(lag: torch.Tensor, max_staleness: int) -> dict[str, float]:
    """The share of samples at each lag 0..max_staleness (metric keys `staleness_<k>`) and the mean lag."""
    n = max(1, lag.numel())
    out = {f"staleness_{k}": float((lag == k).sum()) / n for k in range(max_staleness + 1)}
    out["staleness_mean"] = float(lag.double().mean()) if lag.numel() else 0.0
    return out
