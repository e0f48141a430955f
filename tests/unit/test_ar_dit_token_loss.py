"""GRPO token loss and the joint AR-DiT objective against direct per-token references."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.algorithms.loss import flowgrpo_loss
from megatron_omni.algorithms.token_loss import grpo_token_loss, joint_loss


def _inputs():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(3, 4, generator=g) * 0.3 - 2).requires_grad_()
    old = lp.detach() + torch.randn(3, 4, generator=g) * 0.3
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    return lp, old, adv, mask


def _reference(lp, old, adv, mask, eps, agg):
    rows = []
    for i in range(lp.shape[0]):
        terms = []
        for t in range(lp.shape[1]):
            if mask[i, t]:
                r = torch.exp(lp[i, t] - old[i, t])
                terms.append(torch.maximum(-adv[i] * r, -adv[i] * r.clamp(1 - eps, 1 + eps)))
        rows.append(terms)
    if agg == "token_mean":
        flat = [x for row in rows for x in row]
        return sum(flat) / len(flat)
    return sum(sum(row) / len(row) for row in rows) / len(rows)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_matches_per_token_reference_with_grads(agg: str) -> None:
    lp, old, adv, mask = _inputs()
    out = grpo_token_loss(lp, old, adv, mask, 0.2, agg)
    (g,) = torch.autograd.grad(out.loss, lp)
    lp2 = lp.detach().clone().requires_grad_()
    ref = _reference(lp2, old, adv, mask, 0.2, agg)
    (g_ref,) = torch.autograd.grad(ref, lp2)
    assert torch.allclose(out.loss, ref, atol=1e-6) and torch.allclose(g, g_ref, atol=1e-6)
    assert bool((g[~mask] == 0).all()), "padding got a gradient"
    assert 0 < float(out.metrics["clipfrac"]) < 1


def test_padding_values_are_ignored() -> None:
    lp, old, adv, mask = _inputs()
    a = grpo_token_loss(lp, old, adv, mask).loss
    old2 = old.clone()
    old2[~mask] = -torch.inf
    assert torch.equal(grpo_token_loss(lp, old2, adv, mask).loss, a)


def test_joint_loss_is_the_weighted_sum_of_both_clipped_parts() -> None:
    lp, old, adv, mask = _inputs()
    tok = grpo_token_loss(lp, old, adv, mask)
    wl = torch.randn(3, 2, generator=torch.Generator().manual_seed(4)) * 1e-3
    win = flowgrpo_loss(wl, torch.zeros(3, 2), adv, 1e-4)
    total, metrics = joint_loss(tok, win, 0.3, 2.0)
    assert torch.allclose(total, 0.3 * tok.loss + 2.0 * win.loss)
    assert "token/clipfrac" in metrics and "window/clipfrac" in metrics
    only_tokens, m2 = joint_loss(tok, None, 1.0, 0.0)
    assert torch.equal(only_tokens, tok.loss) and not any(k.startswith("window/") for k in m2)


def test_bad_input_is_refused() -> None:
    lp, old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="at least one plan token"):
        grpo_token_loss(lp, old, adv, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="advantages"):
        grpo_token_loss(lp, old, adv[:2], mask)
    with pytest.raises(ValueError, match="aggregation"):
        grpo_token_loss(lp, old, adv, mask, aggregation="sum")
    with pytest.raises(ValueError, match="weights"):
        joint_loss(None, None, 0.0, 0.0)
    with pytest.raises(ValueError, match="no loss"):
        joint_loss(None, None, 1.0, 0.0)
