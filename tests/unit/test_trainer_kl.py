"""The KL term to a frozen reference (algorithm.beta > 0) in the trainer.

On the tiny offline pipeline, with fixed advantages on a real trajectory: at step 0 the policy equals the
frozen reference, so `kl` is exactly 0 and the update is bit-identical to a beta = 0 trainer's (the KL
gradient vanishes at equality). At step 1 (weights moved) the trainer's loss and `kl` equal the
algorithm-level reference (`algorithms.loss.kl_penalty` + `flowgrpo_loss` on transitions recomputed
through the diffusers interface from the policy and the reference model), kl > 0, and the update differs
from the beta = 0 one. The reference model never changes and is not trained.
"""

from __future__ import annotations

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks
from tests.unit.tiny_trainer import GROUP, PROMPTS, tiny_trainer

BETA = 0.5


def _algorithm_level(trainer, traj, old, advantages, step: int) -> dict[str, float]:
    """The step's loss and kl from the algorithm-level functions, on the pp=1 diffusers-interface path."""
    from megatron_omni.algorithms.loss import flowgrpo_loss, kl_penalty
    from megatron_omni.algorithms.transition import transition_step
    from megatron_omni.models.dit.diffusers_interface import DiffusersForward

    policy, reference = DiffusersForward(trainer.model), DiffusersForward(trainer.reference)
    losses, kls = [], []
    with torch.no_grad():
        for mini in trainer.micro_batches(*traj.log_probs.shape, step):
            for mb in mini:
                cur = transition_step(traj, policy, mb.rows, mb.js)
                ref = transition_step(traj, reference, mb.rows, mb.js)
                kl = kl_penalty(cur.coeffs.mean, ref.coeffs.mean, cur.coeffs.std)
                out = flowgrpo_loss(cur.log_prob, old[mb.rows, mb.js], advantages[mb.rows],
                                    trainer.cfg.algorithm.clip_range, beta=BETA, kl=kl)
                losses.append(float(out.loss))
                kls.append(float(kl.mean()))
    return {"loss": sum(losses) / len(losses), "kl": sum(kls) / len(kls)}


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _kl_run(rank: int, world_size: int, pipeline_dir: str) -> dict:
    with_kl, without = tiny_trainer(pipeline_dir, f"algorithm.beta={BETA}"), tiny_trainer(pipeline_dir)
    assert without.reference is None
    n = len(PROMPTS) * GROUP
    traj = with_kl.engine.generate(PROMPTS, with_kl.sampling_params(), group_size=GROUP,
                                   seeds=[7 + i for i in range(n)])
    advantages = torch.linspace(-1.0, 1.0, n)
    ref_weights = _weights(with_kl.reference)
    out: dict = {"frozen": all(not p.requires_grad for p in with_kl.reference.parameters())}
    for step in (0, 1):
        if step == 1:
            old = with_kl.old_log_probs(traj, step)
            out["expected"] = _algorithm_level(with_kl, traj, old, advantages, step)
        m_kl = with_kl._update(traj, with_kl.old_log_probs(traj, step), advantages, step,
                              with_kl.reference_means(traj, step))
        m_0 = without._update(traj, without.old_log_probs(traj, step), advantages, step)
        a, b = _weights(with_kl.model), _weights(without.model)
        out[step] = {"metrics": m_kl, "metrics_beta0": m_0,
                     "max_weight_diff": max(float((a[k] - b[k]).abs().max()) for k in a)}
    out["reference_unchanged"] = all(torch.equal(v, with_kl.reference.state_dict()[k]) for k, v in ref_weights.items())
    out["reference_moved_from_policy"] = max(float((v - _weights(with_kl.model)[k]).abs().max())
                                             for k, v in ref_weights.items())
    return out


def test_kl_to_frozen_reference(tiny_pipeline_dir: str) -> None:
    (out,) = run_ranks(_kl_run, 1, tiny_pipeline_dir, timeout_s=400)
    assert out["frozen"] and out["reference_unchanged"] and out["reference_moved_from_policy"] > 0
    s0, s1 = out[0], out[1]
    # Step 0: the policy is the reference.
    assert s0["metrics"]["kl"] == 0.0
    assert s0["metrics"]["loss"] == s0["metrics_beta0"]["loss"]
    assert s0["max_weight_diff"] == 0.0, "at kl = 0 the KL term has no gradient: the updates must be identical"
    # Step 1: weights moved; the loss is the algorithm-level policy loss + beta * kl.
    exp = out["expected"]
    assert exp["kl"] > 0 and s1["metrics"]["kl"] > 0
    assert s1["metrics"]["kl"] == pytest.approx(exp["kl"], rel=1e-5, abs=1e-9)
    assert s1["metrics"]["loss"] == pytest.approx(exp["loss"], rel=1e-5, abs=1e-8)
    assert s1["metrics"]["loss"] == pytest.approx(s1["metrics"]["policy_loss"] + BETA * s1["metrics"]["kl"], rel=1e-6)
    assert s1["max_weight_diff"] > 1e-6, "with kl > 0 the update must differ from beta = 0"
