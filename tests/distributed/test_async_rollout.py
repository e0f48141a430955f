"""Asynchronous RL, phase 1, on spawned gloo ranks (rank 0 trains, rank 1 rolls out; docs/async.md).

- one step ahead: the trainer asks for step k+1 before it trains on step k; every trajectory carries the version
  that sampled it, within `max_staleness`; each swap of new weights passes the probe check;
- no tearing: a rollout running while new weights arrive equals, bit for bit, the same request sampled with the
  old weights alone, and the next request equals an engine in the trainer's process loaded with the new ones;
- interrupt and regenerate: a step cancelled mid-way and asked again, also by a restarted service with a fresh
  engine and re-pushed weights, equals the uninterrupted trajectory bit for bit;
- liveness: a rollout rank that stops answering (SIGSTOP) or dies (SIGKILL) while a step is in flight is reported
  within the bound, naming the rank and the step.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from megatron_omni.bridge import DiffusersTarget, WeightSync
from megatron_omni.bridge.qwen_image import megatron_sources
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.placement import split_world
from megatron_omni.parallel.rank_pool import RankFailed, run_ranks
from megatron_omni.rollout.async_service import (
    AsyncSettings,
    RolloutClient,
    RolloutRankFailed,
    RolloutRankLost,
    behaviour_version,
    check_staleness,
    push_weights,
)
from megatron_omni.rollout.async_service.harness import (
    PARAMS,
    build_pair,
    flowgrpo_update,
    probe_means,
    rollout_service,
    step_rows,
    trainer_model,
)
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

SETTINGS = AsyncSettings(max_staleness=1, liveness_timeout_s=30.0, heartbeat_s=0.5)
FAULT_SETTINGS = AsyncSettings(max_staleness=1, liveness_timeout_s=3.0, heartbeat_s=0.5)
STALL_SETTINGS = replace(FAULT_SETTINGS, stall_timeout_s=2.0)
STUCK_S = 6.0  # how long the stalled engine hangs (then it finishes, after the trainer has given up)
GROUP = 2


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory) -> str:
    return str(make_tiny_pipeline(tmp_path_factory.mktemp("pipe") / "tiny-qwen-image", seed=0))


def _equal(a, b) -> bool:
    return all(torch.equal(getattr(a, k), getattr(b, k)) for k in ("latents", "next_latents", "log_probs", "images",
                                                                   "seeds", "policy_version"))


# ------------------------------------------------------------------------------------------ one step ahead
def _synchronous_reference(pair, pipeline: str, steps: int) -> tuple[list, dict]:
    """Today's colocated loop on the trainer rank: rollout, update, in-process sync, step after step."""
    model, opt, _ = trainer_model(pair, pipeline)
    engine = DiffusersRolloutEngine(pipeline)
    sync = WeightSync(pair.plan, sources=megatron_sources(model), target=DiffusersTarget(engine.transformer))
    trajs = []
    for k in range(steps):
        rows, seeds = step_rows(k, 2, GROUP)
        trajs.append(engine.generate(rows, PARAMS, group_size=1, seeds=seeds))
        flowgrpo_update(model, opt, trajs[-1], GROUP)
        sync.sync()
    return trajs, {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _one_step_ahead(rank: int, world_size: int, pipeline: str, steps: int, staleness: int) -> dict:
    pair = build_pair(pipeline, world_size, rollout_ranks=world_size - 1)
    if pair.role == "rollout":
        assert pair.trainer_groups is None  # the Megatron grid spans the trainer ranks only
        service, _ = rollout_service(pair, pipeline, SETTINGS)
        stats = service.serve()
        return {"stats": stats, "probe_diff": service.receiver.last_probe_diff}
    assert pair.trainer_groups.layout.dp == 1 and pair.trainer_groups.rank_lists["dp"] == [0]
    model, opt, sync = trainer_model(pair, pipeline)
    settings = replace(SETTINGS, max_staleness=staleness)
    client = RolloutClient(pair.groups, settings)
    rows, seeds = step_rows(0, 2, GROUP)
    client.request(0, behaviour_version(0, staleness), rows, seeds, PARAMS)
    versions, lags, trajs = [], [], []
    for k in range(steps):
        if k + 1 < steps and staleness > 0:  # step k+1 is asked for before step k trains
            rows, seeds = step_rows(k + 1, 2, GROUP)
            client.request(k + 1, behaviour_version(k + 1, staleness), rows, seeds, PARAMS)
        trajs.append(client.collect(k))
        lags.append(check_staleness(trajs[-1], k, staleness, k).tolist())
        versions.append(trajs[-1].policy_version.tolist())
        flowgrpo_update(model, opt, trajs[-1], GROUP)
        if k + 1 < steps:
            push_weights(k + 1, sync, probe_means(model, pair.hf_config), client)
            if staleness == 0:  # on-policy: step k+1 is asked for once the weights that sample it are pushed
                rows, seeds = step_rows(k + 1, 2, GROUP)
                client.request(k + 1, k + 1, rows, seeds, PARAMS)
    out = {"versions": versions, "lags": lags, "rollout": client.close()}
    if staleness == 0:
        ref_trajs, ref_weights = _synchronous_reference(pair, pipeline, steps)
        out["same_trajectories"] = [all(torch.equal(getattr(a, f), getattr(b, f)) for f in
                                        ("latents", "next_latents", "log_probs", "images"))
                                    for a, b in zip(trajs, ref_trajs)]
        out["same_weights"] = all(torch.equal(v, ref_weights[k]) for k, v in model.state_dict().items()
                                  if torch.is_tensor(v))
    return out


@pytest.mark.parametrize("world_size", [2, 3], ids=["one-rollout-rank", "two-rollout-ranks"])
def test_rollout_one_step_ahead_within_the_staleness_bound(tiny_pipeline: str, world_size: int) -> None:
    trainer, *rollouts = run_ranks(_one_step_ahead, world_size, tiny_pipeline, 3, 1, timeout_s=240)
    # step k is sampled with version max(0, k - 1): [0, 0, 1], every sample stamped (two ranks: two shares of 2)
    assert trainer["versions"] == [[0] * 4, [0] * 4, [1] * 4], trainer
    assert max(max(lag) for lag in trainer["lags"]) == 1
    for rollout in rollouts:
        assert rollout["stats"]["requests"] == 3 and rollout["stats"]["weights_received"] == 2
        assert rollout["stats"]["swaps"] == 1  # version 1 swapped in before step 2; version 2 never needed
        assert rollout["probe_diff"] is not None and rollout["probe_diff"] < 1e-4


def test_staleness_zero_equals_the_synchronous_colocated_loop(tiny_pipeline: str) -> None:
    trainer, rollout = run_ranks(_one_step_ahead, 2, tiny_pipeline, 3, 0, timeout_s=240)
    assert trainer["versions"] == [[0] * 4, [1] * 4, [2] * 4] and rollout["stats"]["swaps"] == 2
    assert trainer["same_trajectories"] == [True] * 3 and trainer["same_weights"], trainer


def _grid_after_the_rollout_rank(rank: int, world_size: int) -> dict:
    placement = split_world("disaggregated", world_size, [0])  # rank 0 rolls out, ranks 1-2 train at tp 2
    groups = build_parallel_groups(ParallelLayout(tp=2), ranks=placement.trainer_range)
    if groups is None:
        return {"role": placement.role(rank)}
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=groups.tp)
    return {"role": placement.role(rank), "tp": groups.rank_lists["tp"], "tp_rank": groups.coords["tp"],
            "sum": float(t)}


def test_the_megatron_grid_spans_the_trainer_ranks_only() -> None:
    rollout, first, second = run_ranks(_grid_after_the_rollout_rank, 3, timeout_s=120)
    assert rollout == {"role": "rollout"}
    assert first == {"role": "trainer", "tp": [1, 2], "tp_rank": 0, "sum": 3.0}
    assert second == {"role": "trainer", "tp": [1, 2], "tp_rank": 1, "sum": 3.0}


# ------------------------------------------------------------------------------------------ tearing and regeneration
def _swap_and_regenerate(rank: int, world_size: int, pipeline: str) -> dict:
    pair = build_pair(pipeline, world_size)
    rows, seeds = step_rows(0, 4, GROUP)  # 8 samples, 2 per forward: the push lands mid-rollout
    if pair.role == "rollout":
        out = {}
        for life in ("first", "restarted"):  # the second service is a restart: fresh engine, weights pushed again
            service, _ = rollout_service(pair, pipeline, SETTINGS, max_batch_size=2)
            out[life] = service.serve()
        return out
    model, opt, sync = trainer_model(pair, pipeline)
    client = RolloutClient(pair.groups, SETTINGS)
    out = {}
    client.request(0, 0, rows, seeds, PARAMS)
    old = client.collect(0)
    client.request(1, 0, rows, seeds, PARAMS)  # the same work, with a push while it runs
    client.wait_progress(1, 1)
    flowgrpo_update(model, opt, old, GROUP)
    push_weights(1, sync, probe_means(model, pair.hf_config), client)
    out["pushed_while_running"] = 1 in client.in_flight() and not client.result_seconds(1)
    during = client.collect(1)
    client.request(2, 1, rows, seeds, PARAMS)
    new = client.collect(2)
    # the new weights in the trainer's own engine, through the in-process bridge
    local = DiffusersRolloutEngine(pipeline, max_batch_size=2)
    WeightSync(pair.plan, sources=megatron_sources(model), target=DiffusersTarget(local.transformer)).sync()
    expected_new = local.generate(rows, PARAMS, group_size=1, seeds=seeds)
    out["during_equals_old"] = _equal(during, old)
    out["new_equals_local"] = all(torch.equal(getattr(new, k), getattr(expected_new, k))
                                  for k in ("latents", "next_latents", "log_probs", "images"))
    out["new_differs"] = not torch.equal(new.images, old.images)
    out["versions"] = (int(during.policy_version.max()), int(new.policy_version.min()))
    # interrupt step 3 after its first sample, then ask for it again
    client.request(3, 1, rows, seeds, PARAMS)
    client.wait_progress(3, 1)
    out["done_at_cancel"] = client.cancel(3)
    client.request(3, 1, rows, seeds, PARAMS)
    out["regenerated_equal"] = _equal(client.collect(3), new)
    client.close()
    # a restarted service: fresh engine at version 0, the trainer's version 1 pushed again; interrupted again
    client = RolloutClient(pair.groups, SETTINGS)
    push_weights(1, sync, probe_means(model, pair.hf_config), client)
    client.request(3, 1, rows, seeds, PARAMS)
    client.wait_progress(3, 2)
    client.cancel(3)
    client.request(3, 1, rows, seeds, PARAMS)
    out["restarted_equal"] = _equal(client.collect(3), new)
    client.close()
    return out


def test_swap_without_tearing_and_bit_identical_regeneration(tiny_pipeline: str) -> None:
    trainer, rollout = run_ranks(_swap_and_regenerate, 2, tiny_pipeline, timeout_s=300)
    assert trainer["pushed_while_running"], trainer
    assert trainer["during_equals_old"], "a rollout running during a weight push saw some of the new weights"
    assert trainer["new_equals_local"] and trainer["new_differs"], trainer
    assert trainer["versions"] == (0, 1)
    assert all(0 < n < 8 for n in trainer["done_at_cancel"].values()), trainer  # cancelled mid-step
    assert trainer["regenerated_equal"] and trainer["restarted_equal"], trainer
    assert rollout["first"]["interrupted"] == 1 and rollout["restarted"]["interrupted"] == 1


# ------------------------------------------------------------------------------------------ liveness
def _collect_until_lost(client: RolloutClient, step: int, t0: float | None = None) -> dict:
    """Collect `step` expecting `RolloutRankLost`: its message, rank, step and the seconds until it was raised,
    counted from `t0` (default: now) ({"error": None} when the step came back instead)."""
    t0 = time.monotonic() if t0 is None else t0
    try:
        client.collect(step)
        return {"error": None}
    except RolloutRankLost as e:
        return {"error": str(e), "rank": e.rank, "step": e.step, "seconds": time.monotonic() - t0}


def _rollout_fault(rank: int, world_size: int, pipeline: str, fault: str, report: str) -> dict:
    pair = build_pair(pipeline, world_size)
    pids = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    rows, seeds = step_rows(0, 4, GROUP)
    if pair.role == "rollout":
        service, engine = rollout_service(pair, pipeline, FAULT_SETTINGS, max_batch_size=2)
        if fault == "stall":  # the engine hangs for a while; the rank's own threads keep answering meanwhile
            generate = engine.generate

            def stuck(*args, **kwargs):
                time.sleep(STUCK_S)
                return generate(*args, **kwargs)

            engine.generate = stuck
        if fault == "sender":  # the result does not pickle: the sender thread fails, not the engine
            produce = engine.generate

            def unpicklable(*args, **kwargs):
                traj = produce(*args, **kwargs)
                traj.unsendable = lambda: None
                return traj

            engine.generate = unpicklable
        try:
            service.serve()
        except Exception as e:  # noqa: BLE001 - the trainer gave up on this rank: its channels are closed
            return {"rollout_error": type(e).__name__}
        return {"rollout_error": None}
    # an engine's or sender's error comes back with its cause however long a loaded machine delays it: those faults
    # wait with the 30 s bound (the 3 s one, the lost-rank cases', once expired before the rank's report was sent)
    client = RolloutClient(pair.groups, STALL_SETTINGS if fault == "stall"
                           else SETTINGS if fault in ("error", "sender") else FAULT_SETTINGS)
    if fault == "stall":  # the stall clock starts with the request: a loaded machine may reach collect() late
        sent = time.monotonic()
        client.request(0, 0, rows, seeds, PARAMS)
        out = _collect_until_lost(client, 0, sent)
        client.abandon()
        return out
    if fault in ("error", "sender"):  # the engine refuses the request (texts longer than text_length), or the
        # result cannot be sent: the error comes back with its traceback
        client.request(0, 0, rows, seeds, replace(PARAMS, text_length=1) if fault == "error" else PARAMS)
        try:
            client.collect(0)
            return {"error": None}
        except RolloutRankFailed as e:
            client.abandon()
            return {"error": str(e), "rank": e.rank, "step": e.step}
    if fault == "probe":  # version 1 announced with the probe means of version 0: the swap must refuse it
        model, opt, sync = trainer_model(pair, pipeline)
        stale = probe_means(model, pair.hf_config)
        client.request(0, 0, rows, seeds, PARAMS)
        flowgrpo_update(model, opt, client.collect(0), GROUP)
        push_weights(1, sync, stale, client)
        client.request(1, 1, rows, seeds, PARAMS)
        try:
            client.collect(1)
            return {"error": None}
        except RolloutRankFailed as e:
            client.abandon()
            return {"error": str(e), "rank": e.rank, "step": e.step}
    client.request(0, 0, rows, seeds, PARAMS)
    client.wait_progress(0, 1)
    os.kill(pids[1], signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    out = _collect_until_lost(client, 0)
    with open(report + ".tmp", "w") as f:  # before the pool notices a killed rank and ends this one
        json.dump(out, f)
    os.replace(report + ".tmp", report)
    if fault == "stop":
        os.kill(pids[1], signal.SIGCONT)
        client.abandon()
    return out


@pytest.mark.parametrize("fault,message,raised", [
    ("error", "more than text_length=1", "ValueError"),  # the engine's own traceback
    ("probe", "probe after the swap to policy version 1 on rollout rank 1", "ProbeMismatch"),
    ("sender", "the sender thread of rollout rank 1 failed sending Result", "AttributeError"),
])
def test_a_rollout_rank_error_reaches_the_trainer(tiny_pipeline: str, tmp_path, fault: str, message: str,
                                                  raised: str) -> None:
    trainer, rollout = run_ranks(_rollout_fault, 2, tiny_pipeline, fault, str(tmp_path / "report"), timeout_s=120)
    step = 1 if fault == "probe" else 0
    assert trainer["rank"] == 1 and trainer["step"] == step, trainer
    assert f"rollout rank 1 failed serving step {step}" in trainer["error"] and message in trainer["error"], trainer
    if fault == "sender":  # the cause, not a lost rank
        assert "Can't pickle local object" in trainer["error"], trainer
    assert rollout == {"rollout_error": raised}


def test_a_stuck_engine_is_reported_within_the_stall_bound(tiny_pipeline: str, tmp_path) -> None:
    """The rollout rank's engine hangs while its control and heartbeat threads keep answering: the liveness bound
    never fires, the stall bound does (no sample finished for `stall_timeout_s`), naming the rank and the step."""
    trainer, rollout = run_ranks(_rollout_fault, 2, tiny_pipeline, "stall", str(tmp_path / "report"),
                                 timeout_s=120)
    assert trainer["rank"] == 1 and trainer["step"] == 0, trainer
    assert "rollout rank 1 lost while step 0 was in flight: it answers but finished no sample" in trainer["error"]
    bound = STALL_SETTINGS.stall_timeout_s
    # after the bound, and before the stuck engine comes back (2 s of slack for a loaded machine's thread wake-ups)
    assert bound < trainer["seconds"] < bound + 2 * STALL_SETTINGS.heartbeat_s + 2.0, trainer
    assert trainer["seconds"] < STUCK_S, trainer
    assert rollout == {"rollout_error": None}  # the engine came back later and the rank stopped when told


@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_lost_rollout_rank_is_reported_within_the_bound(tiny_pipeline: str, tmp_path, fault: str) -> None:
    report = str(tmp_path / "report.json")
    if fault == "kill":
        with pytest.raises(RankFailed, match="rank 1 exited"):
            run_ranks(_rollout_fault, 2, tiny_pipeline, fault, report, timeout_s=120, fresh=True)
    else:
        run_ranks(_rollout_fault, 2, tiny_pipeline, fault, report, timeout_s=120)
    with open(report) as f:
        out = json.load(f)
    assert out["error"] is not None and out["rank"] == 1 and out["step"] == 0, out
    assert "rollout rank 1" in out["error"] and "step 0" in out["error"], out
    bound = FAULT_SETTINGS.liveness_timeout_s
    if fault == "kill":
        # a dead process closes its connection: reported at once, before the liveness bound could fire
        assert out["seconds"] < bound, out
        assert "connection closed" in out["error"], out
    else:
        assert bound - 1.0 < out["seconds"] < bound + 3.0, out
        assert "no message" in out["error"], out



def _optimizer_world_gathers(rank: int, world_size: int, pipeline: str) -> dict[bool, int]:
    """How many whole-job all_gather_object calls megatron-core's optimizer build makes (the rollout ranks of a
    disaggregated job join that many: `trainer.async_loop.MEGATRON_OPTIMIZER_WORLD_GATHERS`), with and without the
    distributed optimizer. The real collective runs; the wrapper only counts."""
    from megatron_omni.trainer.training_state import OptimizerSettings, build_ddp_and_optimizer
    from model_providers.qwen_image import provider

    hf_config = json.loads(open(os.path.join(pipeline, "transformer", "config.json")).read())
    hf_config = {k: v for k, v in hf_config.items() if not k.startswith("_")}
    groups = build_parallel_groups(ParallelLayout())
    real = dist.all_gather_object
    counts = {}
    for distributed in (False, True):
        config = provider.transformer_config(hf_config, tp=1)
        model = provider.build_model(config, groups)
        calls = 0

        def counting(out, obj, group=None):
            nonlocal calls
            calls += group is None or group is dist.group.WORLD
            return real(out, obj, group=group)

        dist.all_gather_object = counting
        try:
            build_ddp_and_optimizer(model, config, groups.mcore,
                                    OptimizerSettings(lr=1e-3, distributed_optimizer=distributed))
        finally:
            dist.all_gather_object = real
        counts[distributed] = calls
    return counts


def test_the_rollout_ranks_join_as_many_optimizer_gathers_as_megatron_core_makes(tiny_pipeline: str) -> None:
    """The rollout ranks mirror the optimizer build's whole-job gathers (megatron-core passes no group); a
    megatron-core whose count differs would hang a disaggregated job until the gloo timeout, so this fails first."""
    from megatron_omni.trainer.async_loop import MEGATRON_OPTIMIZER_WORLD_GATHERS

    counts, = run_ranks(_optimizer_world_gathers, 1, tiny_pipeline, timeout_s=120)
    assert counts == {False: MEGATRON_OPTIMIZER_WORLD_GATHERS, True: MEGATRON_OPTIMIZER_WORLD_GATHERS}, counts
