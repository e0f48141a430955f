"""`algorithm.name` in the one trainer, on the tiny offline pipeline (real engine, real Megatron model, real
optimizer), step by step:

- MixGRPO: every sample of a step shares the schedule's window start, which slides step by step; with Flash the
  grid after the window is shorter (fewer evaluations) and the trained transitions are still the window's.
- GRPO-Guard: a step trains with the old transition means (its metrics carry the ratio bias).
- DiffusionNFT with a lagging old policy: after each step the old copy is `decay old + (1 - decay) new`; the
  next step's rollout samples with the old copy's weights (the engine's own transformer gets them and then the
  trained ones back); the copy survives a checkpoint round trip bit for bit.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from megatron_omni.parallel.rank_pool import run_ranks
from tests.unit.tiny_trainer import tiny_trainer


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _mixgrpo_and_guard(rank: int, world_size: int, pipeline_dir: str) -> dict:
    out: dict = {"windows": [], "grid": [], "forwards": []}
    mix = tiny_trainer(pipeline_dir, "algorithm.name=mixgrpo", "rollout.window_range=[0, 4]",
                       "algorithm.mixgrpo.steps_per_move=1", "algorithm.mixgrpo.flash_ratio=0.5")
    for step in range(3):
        before = mix.engine.stats["forwards"]
        result = mix.train_step(step)
        out["windows"].append(result.trajectory.window_start.tolist())
        out["grid"].append(result.trajectory.sigmas.shape[1] - 1)
        out["forwards"].append(mix.engine.stats["forwards"] - before)
        out["mix_loss_finite"] = math.isfinite(result.metrics["loss"])
    guard = tiny_trainer(pipeline_dir, "algorithm.name=grpo_guard")
    metrics = guard.train_step(0).metrics
    out["guard"] = {k: metrics[k] for k in ("loss", "ratio_mean_bias", "clipfrac")}
    return out


def test_mixgrpo_slides_one_window_per_step_and_grpo_guard_trains(tiny_pipeline_dir: str) -> None:
    (out,) = run_ranks(_mixgrpo_and_guard, 1, tiny_pipeline_dir, timeout_s=400)
    assert out["windows"] == [[0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2]]
    # 4 steps, window 2: Flash re-spaces the 2 steps after a window ending at 2 into 1; a window ending at the
    # grid's end leaves nothing to compress. One forward per step for the step's 4 samples (CFG off).
    assert out["grid"] == [3, 4, 4] and out["forwards"] == [3, 4, 4]
    assert out["mix_loss_finite"]
    assert all(math.isfinite(v) for v in out["guard"].values()) and out["guard"]["ratio_mean_bias"] == 0.0


def _nft_lagging(rank: int, world_size: int, pipeline_dir: str, ckpt_dir: str) -> dict:
    from megatron_omni.trainer.checkpointing import load_checkpoint, save_checkpoint

    overrides = ("algorithm.name=diffusionnft", "rollout.noise_level=0", "rollout.transformer=engine",
                 "algorithm.nft.decay_rate=0.5", "algorithm.nft.decay_cap=0.5", "algorithm.nft.timestep_fraction=0.5")
    trainer = tiny_trainer(pipeline_dir, *overrides)
    out: dict = {"copy": trainer.nft_old is not None and not trainer.shares_model}
    initial = _params(trainer.model)
    m0 = trainer.train_step(0).metrics
    trained = _params(trainer.model)
    expected = {k: 0.5 * initial[k] + 0.5 * trained[k] for k in trained}
    out["decay0"], out["blend_error"] = m0["old_policy_decay"], _max_diff(_params(trainer.nft_old), expected)
    out["window"], out["dlogp_nan"] = None, math.isnan(m0["train_rollout_dlogp"])
    old = torch.nn.ParameterList([p.detach().clone() for p in trainer.nft_old.parameters()])  # its weights now
    result = trainer.train_step(1)
    out["window"] = result.trajectory.log_probs.shape[1]
    prompts, seeds = result.prompts, result.trajectory.seeds.tolist()
    params = trainer.sampling_params(1)
    with trainer._holding(old, sync_in=True, sync_out=True):
        with_old = trainer.engine.generate(prompts, params, group_size=1, seeds=seeds).images
    with_new = trainer.engine.generate(prompts, params, group_size=1, seeds=seeds).images
    out["rollout_vs_old"] = float((result.images - with_old).abs().max())
    out["rollout_vs_new"] = float((result.images - with_new).abs().max())
    save_checkpoint(Path(ckpt_dir), 2, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 2}, keep=1,
                    copies=trainer.extra_copies)
    fresh = tiny_trainer(pipeline_dir, *overrides)
    load_checkpoint(ckpt_dir + "/checkpoints/step_000002", fresh.model, fresh.optimizer, fresh.scheduler,
                    copies=fresh.extra_copies)
    out["resumed_old"] = _max_diff(_params(fresh.nft_old), _params(trainer.nft_old))
    out["resumed_lagging"] = fresh.lagging_old_policy() is fresh.nft_old
    return out


def test_diffusionnft_samples_with_its_lagging_old_policy(tiny_pipeline_dir: str, tmp_path) -> None:
    (out,) = run_ranks(_nft_lagging, 1, tiny_pipeline_dir, str(tmp_path), timeout_s=400)
    assert out["copy"] and out["window"] == 0 and out["dlogp_nan"]
    assert out["decay0"] == 0.5 and out["blend_error"] < 1e-6
    assert out["rollout_vs_old"] < 1e-5 < out["rollout_vs_new"], out
    assert out["resumed_old"] == 0.0 and out["resumed_lagging"]
