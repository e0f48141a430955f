"""Held-out evaluation records: seen/unseen split, the saved result round-trips, the before/after grid refuses
evaluations of different prompts or seeds; evaluation with the rollout's own sampler samples what a rollout of
those seeds samples."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megatron_omni.rollout.base import SamplingParams
from megatron_omni.trainer.evaluation import EvalResult, eval_samples, evaluate, save_before_after_grid


def _result(rewards: list[float], seed: int = 0) -> EvalResult:
    prompts, seeds = eval_samples(['"A"', '"B"', '"C"'], 2, seed=seed)
    images = torch.rand(len(prompts), 3, 8, 8, generator=torch.Generator().manual_seed(seed))
    return EvalResult(prompts=prompts, seeds=seeds, images=images, rewards=torch.tensor(rewards))


def test_samples_are_fixed_per_prompt_and_seed() -> None:
    prompts, seeds = eval_samples(['"A"', '"B"'], 3, seed=5)
    assert prompts == ['"A"'] * 3 + ['"B"'] * 3
    assert seeds == eval_samples(['"A"', '"B"'], 3, seed=5)[1]
    assert len(set(seeds[:3])) == 3 and seeds[:3] == seeds[3:]  # the same noise for every prompt


def test_summary_splits_seen_and_unseen() -> None:
    # Each prompt has its own mean (A 0.75, B 0.1, C 0.4; all 2.5 / 6), so a mean that ignored its subset, or a
    # split that swapped seen and unseen, gives other numbers.
    r = _result([1.0, 0.5, 0.0, 0.2, 0.3, 0.5])
    s = r.summary(seen={'"A"', '"Z"'})
    assert s["reward_mean"] == pytest.approx(2.5 / 6)
    assert s["seen_reward_mean"] == pytest.approx(0.75)
    assert s["unseen_reward_mean"] == pytest.approx((0.0 + 0.2 + 0.3 + 0.5) / 4)
    s = r.summary(seen={'"C"'})
    assert s["seen_reward_mean"] == pytest.approx(0.4) and s["unseen_reward_mean"] == pytest.approx(1.7 / 4)
    assert math.isnan(r.summary(seen={'"A"', '"B"', '"C"'})["unseen_reward_mean"])
    assert r.mean({'"A"'}) == pytest.approx(0.75) and r.mean({'"B"'}) == pytest.approx(0.1)
    assert r.mean({'"B"', '"C"'}) == pytest.approx(0.25) and math.isnan(r.mean({'"Z"'}))


def test_saved_result_round_trips(tmp_path: Path) -> None:
    r = _result([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    r.save(tmp_path / "e.npz")
    back = EvalResult.load(tmp_path / "e.npz")
    assert back.prompts == r.prompts and back.seeds == r.seeds
    assert torch.equal(back.rewards, r.rewards)
    quantised = (r.images * 255).round() / 255
    assert torch.allclose(back.images, quantised, atol=1e-7)
    assert not list(tmp_path.glob("*.tmp*"))


def test_before_after_grid(tmp_path: Path) -> None:
    before, after = _result([0.0] * 6), _result([1.0] * 6)
    save_before_after_grid(before, after, tmp_path / "grid.png")
    assert (tmp_path / "grid.png").stat().st_size > 0
    # The title's figure is the summary's held-out reward_mean (transfer prompts apart), the one eval.jsonl and
    # the console print: one figure per run.
    before, after = _result([0.1, 0.2, 0.3, 0.4, 0.9, 0.9]), _result([0.5, 0.6, 0.7, 0.8, 0.0, 0.0])
    title = save_before_after_grid(before, after, tmp_path / "grid.png", transfer={'"C"'})
    b, a = (r.summary(seen=set(), transfer={'"C"'})["reward_mean"] for r in (before, after))
    assert f"over 4 samples: before {b:.3f} -> after {a:.3f}" in title, title
    with pytest.raises(ValueError, match="different prompts or seeds"):
        save_before_after_grid(before, _result([1.0] * 6, seed=1), tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_grid_shows_the_first_seeds_of_each_prompt(tmp_path: Path) -> None:
    """Many seeds per prompt are all scored but the picture stays readable: `per_prompt` of each are drawn."""
    from PIL import Image

    before, after = _result([0.0] * 6), _result([1.0] * 6)
    save_before_after_grid(before, after, tmp_path / "all.png", columns=2, per_prompt=2)
    save_before_after_grid(before, after, tmp_path / "one.png", columns=2, per_prompt=1)
    tall, short = (Image.open(tmp_path / f).size[1] for f in ("all.png", "one.png"))
    assert short < tall, (short, tall)  # 3 pairs in 2 rows vs 6 pairs in 3 rows
    with pytest.raises(ValueError, match="per_prompt"):
        save_before_after_grid(before, after, tmp_path / "bad.png", per_prompt=0)


def test_rollout_sampler_evaluation_samples_the_rollout(tiny_pipeline_dir: str) -> None:
    """`ode=False` scores the images a rollout of the same seeds draws (SDE window and all), which differ from
    the ODE's; without a stochastic window there is nothing but the ODE, and that is refused."""
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
    from megatron_omni.trainer.rewards import RewardFunction

    engine = DiffusersRolloutEngine(tiny_pipeline_dir, max_batch_size=4)
    reward_fn = RewardFunction("jpeg_compressibility")
    params = SamplingParams(height=64, width=64, num_steps=4, noise_level=1.0, window_size=2, window_range=(0, 2))
    prompts, seeds = eval_samples(['"A"', '"B"'], 2, seed=3)
    sde = evaluate(engine, reward_fn, prompts, seeds, params, ode=False)
    ode = evaluate(engine, reward_fn, prompts, seeds, params)
    rollout = engine.generate(prompts, params, group_size=1, seeds=seeds)
    assert torch.equal(sde.images, rollout.images.cpu())
    assert torch.equal(ode.images, engine.generate(prompts, params.ode(), group_size=1, seeds=seeds).images.cpu())
    assert (sde.images - ode.images).abs().max() > 1e-3
    assert sde.rewards.shape == ode.rewards.shape == (4,) and not torch.equal(sde.rewards, ode.rewards)
    with pytest.raises(ValueError, match="stochastic"):
        evaluate(engine, reward_fn, prompts, seeds, params.ode(), ode=False)
    reward_fn.close()
