"""The trainer's FlowGRPO update on a hand-made batch equals the algorithm-level reference.

The batch is written by hand (random latents, a fixed SDE window, old log-probs set to give chosen
ratios inside and outside the clip range, advantages of both signs). The reference computes the log-probs
independently: `algorithms.transition.transition_step` on the diffusers transformer that the trainer's Megatron
model was loaded from, then `algorithms.loss.flowgrpo_loss` over all samples and window steps, and its
gradient by autograd through diffusers. The trainer's first update (one mini-batch, no clipping) must
report the same loss and leave the same gradient in Megatron's grad buffers (mapped to Megatron's layout
by the provider's weight loader: it only permutes and concatenates, so it maps gradients as well).

World size 1 in this process (gloo).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from megatron_omni.algorithms.loss import flowgrpo_loss
from megatron_omni.algorithms.transition import transition_step
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.rollout.base import Trajectory
from megatron_omni.trainer.config import JobConfig
from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
from megatron_omni.trainer.rewards import RewardFunction
from model_providers.qwen_image import provider

CLIP = 0.2
# ratio = exp(logp_new - logp_old) chosen per (sample, window step): inside and outside [0.8, 1.2].
RATIOS = torch.tensor([[1.0, 1.1], [0.5, 0.95], [1.5, 1.05], [0.9, 0.7]])
ADVANTAGES = torch.tensor([1.0, -1.5, 0.7, -0.4])


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory):
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    platform.init_distributed(rank=0, world_size=1)
    root = tmp_path_factory.mktemp("trainer_loss")
    make_tiny_pipeline(root / "pipeline", seed=0)
    cfg = JobConfig(run_dir=str(root / "run"), steps=1, seed=0)
    cfg.rollout.num_steps = 6
    cfg.optim.mini_batches = 1
    cfg.optim.clip_grad = 0.0  # the gradient left in the buffers is the raw one
    cfg.algorithm.clip_range = CLIP
    reward = RewardFunction("jpeg_compressibility", None, 60.0)
    groups = build_parallel_groups(ParallelLayout())
    yield FlowGRPOTrainer(cfg, groups, root / "pipeline", reward)
    reward.close()
    platform.destroy_distributed()


def _hand_made_batch(trainer: FlowGRPOTrainer) -> Trajectory:
    """4 samples, window of 2 transitions at steps 1 and 2 of a 4-step grid, 64x64 images."""
    hf = dict(trainer.engine.transformer.config)
    n, w, grid = 4, 2, (1, 4, 4)
    s, c, length = grid[1] * grid[2], hf["in_channels"], 6
    g = torch.Generator().manual_seed(11)
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0]).expand(n, 5).clone()
    latents = torch.randn(n, w, s, c, generator=g)
    mask = torch.ones(n, length, dtype=torch.long)
    mask[1, 4:] = 0  # padded text on one sample
    return Trajectory(
        prompts=["a", "b", "c", "d"], group_ids=torch.tensor([0, 0, 1, 1]), seeds=torch.arange(n),
        prompt_embeds=torch.randn(n, length, hf["joint_attention_dim"], generator=g), prompt_embeds_mask=mask,
        negative_prompt_embeds=None, negative_prompt_embeds_mask=None, guidance_scale=torch.ones(n),
        latents=latents, next_latents=latents + 0.3 * torch.randn(n, w, s, c, generator=g),
        log_probs=torch.zeros(n, w), sigmas=sigmas, window_start=torch.ones(n, dtype=torch.long),
        images=torch.zeros(n, 3, 64, 64), img_shape=grid, noise_level=1.2, sde_type="sde",
    )


def _reference(trainer: FlowGRPOTrainer, traj: Trajectory, old: torch.Tensor) -> tuple[float, dict]:
    """flowgrpo_loss of transition_step log-probs on the diffusers transformer; its grads in Megatron layout."""
    ref = copy.deepcopy(trainer.engine.transformer).float().train()
    for p in ref.parameters():
        p.requires_grad_(True)
        p.grad = None
    rows = torch.arange(len(traj))
    lp = torch.stack([transition_step(traj, ref, rows, j).log_prob for j in range(traj.window_size)], dim=1)
    out = flowgrpo_loss(lp, old, ADVANTAGES, CLIP)
    out.loss.backward()
    grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)) for k, p in ref.named_parameters()}
    as_megatron = provider.build_model(trainer.model.config, trainer.groups)
    provider.load_hf_state_dict(as_megatron, grads)
    return float(out.policy_loss), {k: v.detach().clone() for k, v in as_megatron.state_dict().items()
                                    if torch.is_tensor(v)}


def test_first_update_equals_algorithm_reference(trainer: FlowGRPOTrainer) -> None:
    traj = _hand_made_batch(trainer)
    with torch.no_grad():
        rows = torch.arange(len(traj))
        current = torch.stack([transition_step(traj, trainer.engine.transformer, rows, j).log_prob
                               for j in range(traj.window_size)], dim=1)
    old = current - RATIOS.log()  # so that exp(logp_new - logp_old) = RATIOS
    ref_loss, ref_grads = _reference(trainer, traj, old)
    # The hand-made ratios exercise both branches of the clipped objective.
    clipped = (RATIOS - 1).abs() > CLIP
    assert clipped.any() and (~clipped).any()

    metrics = trainer._update(traj, old, ADVANTAGES, step=0)
    assert math.isclose(metrics["policy_loss"], ref_loss, rel_tol=1e-5, abs_tol=1e-7), (metrics, ref_loss)
    assert metrics["clipfrac"] == pytest.approx(float(clipped.float().mean()), abs=1e-6)

    total_ref = torch.cat([g.flatten() for g in ref_grads.values()]).norm()
    assert total_ref > 0
    params = dict(trainer.model.named_parameters())
    for name, g_ref in ref_grads.items():
        g = params[name].main_grad
        err = float((g - g_ref).norm() / total_ref)
        assert err < 1e-5, f"{name}: gradient differs from the reference by {err:.2e} of the total norm"
        rel = float((g - g_ref).norm() / g_ref.norm().clamp_min(1e-12))
        assert g_ref.norm() < 1e-3 * total_ref or rel < 1e-3, f"{name}: relative gradient error {rel:.2e}"


def test_non_finite_gradients_skip_the_update_and_stop_the_run(trainer: FlowGRPOTrainer) -> None:
    """A NaN advantage makes every gradient NaN: the update is skipped (weights untouched, counted in the
    metrics), and `optim.max_bad_steps` such updates in a row stop the run with an error."""
    traj = _hand_made_batch(trainer)
    bad = ADVANTAGES.clone()
    bad[2] = float("nan")
    old = torch.zeros(len(traj), traj.window_size)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if torch.is_tensor(v)}
    saved = trainer.guard.max_bad_steps
    trainer.guard.max_bad_steps = 2
    try:
        metrics = trainer._update(traj, old, bad, step=1)
        assert metrics["skipped_updates"] == 1.0
        assert math.isnan(metrics["grad_norm"])
        after = trainer.model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()), "a skipped update changed weights"
        with pytest.raises(FloatingPointError, match=r"2 updates in a row had NaN/inf .* \(optim.max_bad_steps\)"):
            trainer._update(traj, old, bad, step=2)
    finally:
        trainer.guard.max_bad_steps = saved
        trainer.guard.bad_steps = 0
