"""Asynchronous RL, phase 1 (docs/async.md): the building blocks the trainer's asynchronous loop will use.

- `versions`: policy versions, the staleness bound (`async.max_staleness`) and its histogram;
- `channel`: the messages between the trainer root and a rollout rank over gloo pairs, with a bounded wait;
- `weights`: the rollout side's double-buffered weights (received while sampling, swapped between requests, probe
  checked on every swap) and the trainer side's push through the bridge;
- `service`: the rollout rank's request loop; `client`: the trainer root's requests, results and liveness;
- `harness`: a disaggregated pair on a tiny pipeline for the tests and the benchmark (imported by them only).

The placement (which ranks train, which roll out) and its process groups are `parallel.placement`'s.
"""

from megatron_omni.rollout.async_service.client import RolloutClient, RolloutRankFailed, RolloutRankLost
from megatron_omni.rollout.async_service.service import RolloutService
from megatron_omni.rollout.async_service.versions import (
    AsyncSettings,
    StalenessError,
    behaviour_version,
    check_staleness,
    staleness_histogram,
    stamp_version,
)
from megatron_omni.rollout.async_service.weights import DoubleBuffer, WeightReceiver, check_async_engine, push_weights

__all__ = [
    "AsyncSettings", "DoubleBuffer", "RolloutClient", "RolloutRankFailed", "RolloutRankLost", "RolloutService",
    "StalenessError", "WeightReceiver", "behaviour_version", "check_async_engine", "check_staleness", "push_weights",
    "stamp_version", "staleness_histogram",
]
