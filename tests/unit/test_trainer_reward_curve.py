"""reward_curve.png: the training reward per step, and the held-out evaluations (ODE, rollout sampler) drawn
on the same axes when the run recorded them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from megatron_omni.trainer.metrics import save_reward_curve

HISTORY = [{"step": s, "reward_mean": 0.2 + 0.01 * s, "reward_std": 0.1} for s in range(12)]


def _pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def test_evaluations_are_drawn_with_the_training_reward(tmp_path: Path) -> None:
    ode = [{"step": 0, "reward_mean": 0.25}, {"step": 6, "reward_mean": 0.4}, {"step": 12, "reward_mean": 0.3}]
    both = [{**e, "rollout_sampler_reward_mean": e["reward_mean"] - 0.05} for e in ode]
    for name, evals in (("train", None), ("ode", ode), ("both", both)):
        save_reward_curve(HISTORY, tmp_path / f"{name}.png", evals)
    train, with_ode, with_both = (_pixels(tmp_path / f"{n}.png") for n in ("train", "ode", "both"))
    assert train.shape == with_ode.shape == with_both.shape
    assert np.abs(train - with_ode).sum() > 0 and np.abs(with_ode - with_both).sum() > 0
    save_reward_curve(HISTORY, tmp_path / "empty.png", [])  # no evaluations recorded: the training curve alone
    assert np.array_equal(_pixels(tmp_path / "empty.png"), train)
    assert not list(tmp_path.glob("*.tmp*"))
