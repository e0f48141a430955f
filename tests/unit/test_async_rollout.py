"""Asynchronous RL's pure parts (docs/async.md): the placement split and its errors, policy versions and the
staleness bound, the settings' checks, the double buffer's swap, and the engines the asynchronous rollout
refuses for now."""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from megatron_omni.parallel.placement import PlacementError, split_world
from megatron_omni.rollout.async_service import (
    AsyncSettings,
    DoubleBuffer,
    StalenessError,
    behaviour_version,
    check_async_engine,
    check_staleness,
    staleness_histogram,
    stamp_version,
)
from megatron_omni.rollout.base import Trajectory
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
from megatron_omni.rollout.probe import probe_trajectory
from megatron_omni.rollout.quantization import QuantizationSpec
from model_providers.qwen_image import provider
from model_providers.registry import get_family


# ------------------------------------------------------------------------------------------ placement
def test_colocated_placement_puts_both_sides_on_every_rank() -> None:
    p = split_world("colocated", 4)
    assert p.trainer_ranks == p.rollout_ranks == (0, 1, 2, 3)
    assert p.role(2) == "both" and not p.disaggregated


@pytest.mark.parametrize("rollout,trainer,expected", [
    (1, (0, 1, 2), (3,)),
    (3, (0,), (1, 2, 3)),
    ([3, 2], (0, 1), (2, 3)),
    ([0], (1, 2, 3), (0,)),
])
def test_disaggregated_placement_by_count_or_list(rollout, trainer, expected) -> None:
    p = split_world("disaggregated", 4, rollout)
    assert p.trainer_ranks == trainer and p.rollout_ranks == expected
    assert p.trainer_root == trainer[0] and list(p.trainer_range) == list(trainer)
    assert p.role(expected[0]) == "rollout" and p.role(trainer[0]) == "trainer"
    assert p.rollout_owners == expected and p.rollout_groups == tuple((r,) for r in expected)  # rollout tp 1


def test_rollout_groups_at_rollout_tp_2_one_owner_each() -> None:
    """rollout.tp 2 (vLLM-Omni's `Omni` engine with two workers): groups of 2 consecutive rollout ranks, the first
    of each its owner (the rank that serves and is pushed the weights); a count that is not a multiple is refused."""
    p = split_world("disaggregated", 5, 4, rollout_tp=2)
    assert p.rollout_groups == ((1, 2), (3, 4)) and p.rollout_owners == (1, 3)
    assert p.rollout_group_of(4) == (3, 4) and p.rollout_group_of(0) == ()
    assert split_world("colocated", 4).rollout_groups == ()
    with pytest.raises(PlacementError, match=r"placement.rollout_ranks=3 rollout ranks with rollout.tp=2: .* "
                                             r"a multiple of 2"):
        split_world("disaggregated", 4, 3, rollout_tp=2)


@pytest.mark.parametrize("mode,rollout,message", [
    ("split", None, "placement.mode='split'"),
    ("colocated", 2, "placement.rollout_ranks=2 with placement.mode='colocated'"),
    ("disaggregated", None, "placement.rollout_ranks is required"),
    ("disaggregated", 0, r"placement.rollout_ranks=0: a count must be in \[1, 3\]"),
    ("disaggregated", 4, r"placement.rollout_ranks=4: a count must be in \[1, 3\]"),
    ("disaggregated", True, "placement.rollout_ranks=True"),
    ("disaggregated", [1, 1], "listed twice"),
    ("disaggregated", [4], r"\[4\] are not ranks of a job of 4"),
    ("disaggregated", [0, 1, 2, 3], "at least one rank on each side"),
    ("disaggregated", [], "at least one rank on each side"),
    ("disaggregated", [1], r"trainer ranks \[0, 2, 3\], which are not contiguous"),
])
def test_placement_errors_name_the_key_and_value(mode, rollout, message) -> None:
    with pytest.raises(PlacementError, match=message):
        split_world(mode, 4, rollout)


# ------------------------------------------------------------------------------------------ versions
def _trajectory(n: int) -> Trajectory:
    traj = probe_trajectory(provider.hf_config("tiny"))
    return Trajectory.concat([traj] * n)


def test_behaviour_version_is_the_staleness_bound() -> None:
    assert [behaviour_version(k, 0) for k in range(4)] == [0, 1, 2, 3]  # on-policy
    assert [behaviour_version(k, 1) for k in range(4)] == [0, 0, 1, 2]
    assert [behaviour_version(k, 2) for k in range(4)] == [0, 0, 0, 1]


def test_versions_survive_select_and_concat_and_staleness_is_refused() -> None:
    a, b = stamp_version(_trajectory(2), 3), stamp_version(_trajectory(3), 4)
    both = Trajectory.concat([a, b])
    assert both.policy_version.tolist() == [3, 3, 4, 4, 4]
    assert both.select([4, 0]).policy_version.tolist() == [4, 3]
    lag = check_staleness(both, 4, 1, step=4)
    assert lag.tolist() == [1, 1, 0, 0, 0]
    assert staleness_histogram(lag, 1) == {"staleness_0": 0.6, "staleness_1": 0.4, "staleness_mean": 0.4}
    with pytest.raises(StalenessError, match=r"step 5: .* version 3 .* at version 5: 2 updates old, more than "
                                             r"async.max_staleness=1"):
        check_staleness(both, 5, 1, step=5)
    with pytest.raises(StalenessError, match="newer than the trainer's 2"):
        check_staleness(both, 2, 1, step=2)
    with pytest.raises(StalenessError, match="records no policy version"):
        check_staleness(_trajectory(1), 0, 1, step=0)


@pytest.mark.parametrize("kwargs,message", [
    ({"max_staleness": -1}, "async.max_staleness=-1"),
    ({"max_staleness": 1.5}, "async.max_staleness=1.5"),
    ({"liveness_timeout_s": 0}, "async.liveness_timeout_s=0"),
    ({"liveness_timeout_s": 3.0, "heartbeat_s": 2.0}, "async.heartbeat_s=2.0"),
    ({"stall_timeout_s": 0}, "async.stall_timeout_s=0"),
])
def test_async_settings_errors_name_the_key(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncSettings(**kwargs)


# ------------------------------------------------------------------------------------------ double buffer
def test_double_buffer_writes_the_back_copy_and_swaps_without_copying() -> None:
    torch.manual_seed(0)
    module = QwenImageTransformer2DModel(**provider.hf_config("tiny"))
    name, live = next(iter(module.named_parameters()))
    before = live.detach().clone()
    buf = DoubleBuffer(module)
    new = torch.randn_like(before)
    assert buf.load_full([(name, new), ("not.a.parameter", new)]) == {name}
    assert torch.equal(live, before)  # the live weights are untouched until the swap
    back_storage = buf.parameters()[name].data_ptr()
    buf.swap()
    assert torch.equal(live, new) and live.data_ptr() == back_storage  # storage exchanged, not copied
    assert torch.equal(buf.parameters()[name], before)
    with pytest.raises(ValueError, match="has shape"):
        buf.load_full([(name, torch.zeros(1))])


def test_the_quantized_engine_is_double_buffered(tiny_pipeline_dir: str) -> None:
    """An FP8 engine passes the asynchronous engine check; its back buffer holds the plain weights (the quantizers'
    scales are not parameters), so the bridge's target covers the same tensors as the unquantized engine's."""
    plain = DiffusersRolloutEngine(tiny_pipeline_dir)
    spec = QuantizationSpec("fp8", get_family("qwen_image").quantized_linears)
    quantized = DiffusersRolloutEngine(tiny_pipeline_dir, quantization=spec)
    for engine in (plain, quantized):
        check_async_engine(engine)
    buffers = [DoubleBuffer(e.weight_sink().target.module) for e in (plain, quantized)]
    assert set(buffers[0].parameters()) == set(buffers[1].parameters())


