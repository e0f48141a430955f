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

from tests.distributed.harness import run_ranks

PROMPTS = ["a red cube", "a photo of a cat on a mat"]
GROUP = 2
BETA = 0.5


def _trainer(pipeline_dir: str, beta: float):
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.config import JobConfig
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    cfg = JobConfig(prompts=PROMPTS, seed=5)
    cfg.rollout.height = cfg.rollout.width = 32
    cfg.rollout.num_steps = 4
    cfg.rollout.window_size = 2
    cfg.rollout.prompts_per_step = len(PROMPTS)
    cfg.rollout.group_size = GROUP
    cfg.optim.lr = 1e-2
    cfg.optim.mini_batches = 1  # the step's loss is computed before its only optimizer step
    cfg.algorithm.clip_range = 0.2
    cfg.algorithm.beta = beta
    cfg.validate(1)
    return FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout()), pipeline_dir,
                           RewardFunction("jpeg_compressibility"))


def _algorithm_level(trainer, traj, old, advantages, step: int) -> dict[str, float]:
    """The step's loss and kl from the algorithm-level functions, on the pp=1 diffusers-interface path."""
    from megatron_omni.algorithms.loss import flowgrpo_loss, kl_penalty
    from megatron_omni.models.dit.diffusers_interface import DiffusersForward
    from megatron_omni.rollout.logprob import transition_step

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
    with_kl, without = _trainer(pipeline_dir, BETA), _trainer(pipeline_dir, 0.0)
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


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory) -> str:
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    path = tmp_path_factory.mktemp("trainer_kl") / "tiny"
    make_tiny_pipeline(path, seed=0)
    return str(path)


def test_kl_to_frozen_reference(pipeline_dir: str) -> None:
    (out,) = run_ranks(_kl_run, 1, pipeline_dir, timeout_s=400)
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
