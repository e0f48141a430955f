"""The planner's disaggregated prediction (`planner.disaggregated`): the step is the slower side and never slower
than the same split run in sequence, the rollout side scales with its GPUs, a balanced split ties the colocated job
while a lopsided one loses to it, a split can fit where the colocated job cannot, a rollout GPU holds no training
state, an empty side is refused, and `--dry-run` prints the plan (and refuses, after it, what the trainer cannot
run yet)."""

from __future__ import annotations

import pytest

from megatron_omni.parallel.layout import LayoutError, ParallelLayout
from megatron_omni.planner import Precision, RolloutSpec, plan
from megatron_omni.planner.disaggregated import plan_disaggregated
from megatron_omni.planner.memory import GIB, RECOMPUTE_MODES, rollout_parameter_count

PP2 = ParallelLayout(tp=1, pp=2)


@pytest.mark.parametrize("layout,trainer,rollout", [(PP2, 4, 4), (ParallelLayout(tp=3), 6, 2),
                                                    (ParallelLayout(tp=3), 12, 4), (ParallelLayout(tp=2), 2, 6)])
def test_step_is_the_slower_side_and_beats_the_same_split_in_sequence(layout, trainer: int, rollout: int) -> None:
    d = plan_disaggregated("20b", layout, trainer, rollout, "H200", recompute="full")
    t = d.trainer.time
    assert d.train_s == pytest.approx(t.old_logprob_s + t.train_s + d.push_s)
    assert d.step_s == max(d.rollout_s, d.train_s) and d.bound == ("rollout" if d.rollout_s >= d.train_s else "trainer")
    assert d.step_s < d.rollout_s + d.train_s  # overlapping two non-empty phases
    assert d.images_per_s_per_gpu == pytest.approx(512 / (d.step_s * (trainer + rollout)))
    assert d.staleness == 1 and d.push_s > 0


def test_rollout_side_scales_with_its_gpus_and_the_trainer_side_does_not() -> None:
    two, four = (plan_disaggregated("20b", PP2, 4, r, "H200", recompute="full") for r in (2, 4))
    assert two.rollout_s == pytest.approx(2 * four.rollout_s, rel=1e-9)  # rollout tp 1: compute only, split by R
    assert two.train_s == pytest.approx(four.train_s, rel=1e-9)  # both inside one node: the same push
    # The rollout side equals the colocated plan's rollout on R GPUs (the same engine, its own GPUs).
    assert four.rollout_s == pytest.approx(plan("20b", ParallelLayout(tp=1, pp=4), 4, "H200").time.rollout_s)


def test_a_balanced_split_ties_the_colocated_job_and_a_lopsided_one_loses() -> None:
    """The overlap hides the shorter side, but the colocated job already uses every GPU for both phases: at
    balance the two tie (within what the smaller trainer saves or pays in communication); a rollout-bound split
    leaves its trainer GPUs idle most of the step."""
    balanced = plan_disaggregated("20b", PP2, 4, 4, "H200", recompute="full")
    assert abs(balanced.rollout_s - balanced.train_s) < 0.25 * balanced.step_s
    colocated = balanced.colocated
    assert colocated is not None and balanced.colocated_error is None and colocated.gpus == 8
    ratio = balanced.images_per_s_per_gpu / colocated.time.images_per_s_per_gpu
    assert 0.97 < ratio < 1.03, ratio  # 1.002 at tp1 pp2, full recompute
    lopsided = plan_disaggregated("20b", ParallelLayout(tp=3), 6, 2, "H200", recompute="full")
    assert lopsided.bound == "rollout" and lopsided.rollout_s > 2 * lopsided.train_s
    assert lopsided.images_per_s_per_gpu < 0.6 * lopsided.colocated.time.images_per_s_per_gpu
    assert lopsided.images_per_s_per_gpu < balanced.images_per_s_per_gpu


def test_a_split_fits_where_the_colocated_job_does_not() -> None:
    """Without the engine's weights beside the training state the trainer fits without recompute; the colocated job
    on the same 8 GPUs with the same layout does not fit under any recompute mode."""
    d = plan_disaggregated("20b", PP2, 4, 4, "H200", recompute="none")
    assert d.fits and d.trainer.memory.rollout_weights == 0
    for mode in RECOMPUTE_MODES:
        assert not plan("20b", PP2, 8, "H200", recompute=mode).memory.fits, mode


def test_a_rollout_gpu_holds_the_engine_and_its_back_buffer_but_no_training_state() -> None:
    prec = Precision()
    shard = prec.rollout_param_bytes * rollout_parameter_count("20b", 1)
    seen = set()
    for layout, trainer, mode, distributed in [(PP2, 4, "full", True), (ParallelLayout(tp=3), 6, "none", False),
                                               (ParallelLayout(tp=2), 4, "selective", True)]:
        d = plan_disaggregated("20b", layout, trainer, 4, "H200", recompute=mode,
                               precision=Precision(distributed_optimizer=distributed))
        r = d.rollout_memory
        assert r.back_buffer == shard and r.weights == shard + prec.rollout_param_bytes * RolloutSpec().extra_params
        assert r.total == r.weights + r.back_buffer + r.activations + r.reserve
        # The trainer side is exactly the plan of T ranks with the engine elsewhere (no engine weights on it).
        alone = plan("20b", layout, trainer, "H200", recompute=mode, rollout=RolloutSpec(colocated=False, gpus=4),
                     precision=Precision(distributed_optimizer=distributed))
        assert d.trainer.memory == alone.memory and d.trainer.memory.optimizer_states > 0
        seen.add(r.total)
    assert len(seen) == 1  # the trainer's layout, recompute and optimizer never reach a rollout GPU
    assert 90 * GIB < seen.pop() < 100 * GIB  # 20B at rollout tp 1: two transformer copies + encoder + VAE


def test_the_push_across_nodes_is_slower_than_inside_one() -> None:
    inside = plan_disaggregated("20b", ParallelLayout(tp=3), 6, 2, "H200")
    across = plan_disaggregated("20b", ParallelLayout(tp=3), 12, 4, "H200")
    assert across.push_s > 5 * inside.push_s  # network vs NVLink, the same bytes


@pytest.mark.parametrize("trainer,rollout,named", [(4, 0, "rollout GPUs"), (0, 4, "trainer GPUs"),
                                                   (4, -1, "rollout GPUs")])
def test_an_empty_side_is_refused(trainer: int, rollout: int, named: str) -> None:
    with pytest.raises(LayoutError, match=f"{named}.*at least one on each side"):
        plan_disaggregated("20b", PP2, trainer, rollout, "H200")


def _disaggregated_config(engine: str = "diffusers"):
    from megatron_omni.trainer.config import JobConfig

    cfg = JobConfig()
    cfg.placement.mode, cfg.placement.rollout_ranks, cfg.async_.max_staleness = "disaggregated", 1, 1
    cfg.rollout.engine = engine
    return cfg


def test_dry_run_prints_the_disaggregated_plan(capsys: pytest.CaptureFixture) -> None:
    from megatron_omni.trainer.dry_run import dry_run

    cfg = _disaggregated_config()
    cfg.validate(2)
    assert dry_run(cfg, 2, "H200") == 0
    out = capsys.readouterr().out
    for part in ("world size 2 = 1 trainer ranks + 1 rollout ranks (disaggregated)", "disaggregated: 1 trainer + 1 "
                 "rollout GPUs, staleness 1", "rollout GPU memory", "no optimizer state", "colocated on 2 GPUs",
                 "assumption: disaggregated model", "dry run OK: the disaggregated layout"):
        assert part in out, out[-3000:]
    assert "not runnable yet" not in out


def test_dry_run_plans_then_refuses_what_the_trainer_cannot_run_yet(capsys: pytest.CaptureFixture) -> None:
    from megatron_omni.trainer.config import ConfigError
    from megatron_omni.trainer.dry_run import dry_run

    cfg = _disaggregated_config(engine="vllm_omni")
    cfg.validate(2)  # the rollout ranks own vLLM-Omni Omni engines (docs/async.md)
    cfg.algorithm.name = "diffusionnft"  # its lagging old policy is not on the rollout ranks (docs/async.md)
    with pytest.raises(ConfigError, match="algorithm.name='diffusionnft' is not supported"):
        cfg.validate(2)  # a launch refuses it before any work
    cfg.validate(2, planning=True)
    with pytest.raises(ConfigError, match=r"algorithm.name='diffusionnft' is not supported .* a launch refuses it"):
        dry_run(cfg, 2, "H200")
    out = capsys.readouterr().out
    assert "disaggregated: 1 trainer + 1 rollout GPUs" in out
    assert "not runnable yet: algorithm.name='diffusionnft'" in out
