"""Group-relative advantages against a NumPy reference (flow_grpo's per-prompt stat tracker)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_omni.algorithms.advantages import group_advantages


def numpy_reference(rewards: np.ndarray, groups: np.ndarray, global_std: bool, clip: float | None):
    adv = np.zeros_like(rewards, dtype=np.float64)
    zero = 0
    uniq = np.unique(groups)
    for gid in uniq:
        sel = groups == gid
        r = rewards[sel]
        std = np.std(rewards) if global_std else np.std(r)
        adv[sel] = (r - np.mean(r)) / (std + 1e-4)
        zero += int(np.all(r == r[0]))
    if clip is not None:
        adv = np.clip(adv, -clip, clip)
    return adv, zero / len(uniq)


@pytest.mark.parametrize("std_mode", ["global", "group"])
@pytest.mark.parametrize("clip", [5.0, None, 0.5])
def test_matches_numpy(std_mode: str, clip: float | None) -> None:
    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(6), 4)
    rng.shuffle(groups)
    rewards = rng.random(24)
    rewards[groups == 2] = 0.1  # a zero-std group (0.1 * 4 does not average back to exactly 0.1)
    rewards[groups == 4] = 1.0
    out = group_advantages(torch.tensor(rewards), torch.tensor(groups), std_mode=std_mode, clip=clip)
    ref, zero = numpy_reference(rewards, groups, std_mode == "global", clip)
    np.testing.assert_allclose(out.advantages.numpy(), ref, rtol=1e-6, atol=1e-6)
    assert out.zero_std_ratio == pytest.approx(zero) and zero == pytest.approx(2 / 6)
    assert out.advantages.dtype == torch.float32
    assert float(out.advantages[torch.tensor(groups == 2)].abs().max()) < 1e-9


def test_group_std_zero_group_gives_zero_advantage_not_blowup() -> None:
    rewards = torch.tensor([0.3, 0.3, 0.3, 0.0, 1.0, 0.5])
    out = group_advantages(rewards, torch.tensor([7, 7, 7, 9, 9, 9]), std_mode="group", clip=None)
    assert out.advantages[:3].abs().max() < 1e-6
    assert out.zero_std_ratio == 0.5
    assert out.group_ids.tolist() == [7, 9]


def test_clip_bounds() -> None:
    rewards = torch.tensor([0.0] * 15 + [1.0])
    out = group_advantages(rewards, torch.zeros(16, dtype=torch.long), std_mode="group", eps=1e-4, clip=2.0)
    assert float(out.advantages.max()) == 2.0


def test_bad_inputs_raise() -> None:
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="std_mode"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0, 0]), std_mode="batch")
    with pytest.raises(ValueError, match="integers"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0.0, 0.0]))
    with pytest.raises(ValueError, match=r"\[N\]"):
        group_advantages(torch.tensor([1.0, 2.0]), torch.tensor([0]))
