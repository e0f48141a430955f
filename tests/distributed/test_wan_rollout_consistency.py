"""Trainer and rollout agree on the log-probs of video trajectories: the embedded Wan engine samples SDE
trajectories from the tiny offline Wan pipeline, and the Megatron Wan model (same weights) recomputes every
recorded transition through the trainer's own path, `trainer.pipeline_step.PipelineStep` (Megatron-Core's
schedules, the last stage gathering the video tokens over CP, the shared transition math), at TP=2, CP=2
(Ulysses), CP=2 (ring) and PP=2: max |dlogp| <= 1e-6 (fp32). A slightly changed model must show up.

One task call on two ranks; both ranks sample the same trajectory (same seeds)."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.rollout.base import SamplingParams
from model_providers.wan import provider
from model_providers.wan.tiny_pipeline import make_tiny_pipeline

PROMPTS = ["a red cat", 'a sign that says "GO"']
PARAMS = SamplingParams(height=32, width=32, num_frames=9, num_steps=4, noise_level=1.0, window_size=2,
                        window_range=(0, 3), max_sequence_length=16)  # patch grid (3, 2, 2): 12 tokens
LAYOUTS = {"tp2": ParallelLayout(tp=2), "cp2-ulysses": ParallelLayout(ulysses=2),
           "cp2-ring": ParallelLayout(ring=2), "pp2": ParallelLayout(pp=2)}


def _dlogp(rank: int, world_size: int, pipeline: str) -> dict[str, dict[str, float]]:
    from megatron_omni.rollout.diffusers_engines.wan import WanRolloutEngine
    from megatron_omni.trainer.pipeline_step import PipelineStep, plan_micro_batches

    engine = WanRolloutEngine(pipeline, max_batch_size=4)
    traj = engine.generate(PROMPTS, PARAMS, group_size=2, seeds=[21, 22, 23, 24])
    out = {}
    for name, layout in LAYOUTS.items():
        groups = build_parallel_groups(layout)
        seed_everything(0, tp_rank=groups.tp.rank())
        cfg = provider.transformer_config(engine.transformer_config(), tp=layout.tp, pp=layout.pp,
                                          ulysses=layout.ulysses, ring=layout.ring, batch_p2p_comm=False)
        model = provider.build_model(cfg, groups)
        provider.load_hf_state_dict(model, engine.transformer.state_dict())
        model.eval()
        step = PipelineStep(cfg, groups)
        micro = plan_micro_batches(torch.arange(len(traj)), traj.window_size, 2)
        rec = step.transitions(model, traj, micro).log_probs
        res = {"max": float((rec - traj.log_probs).abs().max())}
        with torch.no_grad():
            for p in model.parameters():  # a slightly different model must show up
                p.mul_(1.01)
        res["perturbed"] = float((step.transitions(model, traj, micro).log_probs - traj.log_probs).abs().mean())
        out[name] = res
    return out


@pytest.fixture(scope="module")
def tiny_wan(tmp_path_factory) -> str:
    return str(make_tiny_pipeline(tmp_path_factory.mktemp("wan") / "tiny-wan", seed=0))


def test_megatron_recomputes_video_rollout_log_probs(tiny_wan: str) -> None:
    results = run_ranks(_dlogp, 2, tiny_wan, timeout_s=600)
    for r in results:
        for name, res in r.items():
            print(f"{name}: max |dlogp| {res['max']:.2e}, perturbed model {res['perturbed']:.2e}")
            assert res["max"] <= 1e-6, (name, res)
            assert res["perturbed"] > 1e-4, (name, res)
