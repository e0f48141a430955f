"""The trainer's update at pipeline parallel size 2 equals the pp=1 update on the same trajectory.

Every rank builds the real trainer on the tiny offline pipeline, samples the same trajectory (same weights,
same seeds), recomputes the old log-probs and runs one RL step's mini-batch updates with fixed advantages,
then syncs the weights into its rollout engine. At pp=2 (1F1B over micro-batches of one sample x one window
step), pp=2 x tp=2, and with a mini-batch's window steps fused into one forward, the recomputed log-probs,
the loss and the metrics must equal the pp=1 run (dp ranks fed the same trajectory, so their averaged
gradient is the single replica's), and EVERY rank's engine must end with the pp=1 run's updated weights:
the sync gathers both stages into every engine. With and without true CFG (negative rows, text padded to
the longer of prompt and negative prompt), and with the KL term. DiffusionNFT's update (ODE rollout, noised
points, the old policy's velocities in a forward-only pass) goes through the same schedules and matches too.
"""

from __future__ import annotations

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks

PROMPTS = ["a red cube", "a photo of a cat on a mat"]
GROUP = 2


def _config(pp: int, tp: int, cfg_scale: float, micro_batch_size: int | None, beta: float = 0.0, ulysses: int = 1,
            lora: bool = False):
    from megatron_omni.trainer.config import JobConfig

    cfg = JobConfig(prompts=PROMPTS, seed=3)
    cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.ulysses = pp, tp, ulysses
    cfg.rollout.height = cfg.rollout.width = 32
    cfg.rollout.num_steps = 4
    cfg.rollout.window_size = 2
    cfg.rollout.prompts_per_step = len(PROMPTS)
    cfg.rollout.group_size = GROUP
    if cfg_scale > 1:
        cfg.rollout.guidance_scale = cfg_scale
        cfg.rollout.negative_prompt = "blurry"
    cfg.optim.lr = 1e-3
    cfg.optim.mini_batches = 2
    cfg.optim.micro_batch_size = micro_batch_size
    cfg.optim.clip_grad = 0.05  # small enough that clipping acts: the grad norm must count each param once
    cfg.algorithm.clip_range = 0.2
    cfg.algorithm.beta = beta
    if lora:
        cfg.model.lora.rank, cfg.model.lora.alpha, cfg.model.lora.adaln = 4, 8.0, True
        cfg.optim.lr = 1e-2
        cfg.optim.clip_grad = 1e-4  # adapters' grads are small (B = 0 at the start): clipping must still act
        cfg.optim.distributed_optimizer = True  # the adapters' Adam state sharded over data parallel
    return cfg


def _one_step(rank: int, world_size: int, pipeline_dir: str, pp: int, tp: int, cfg_scale: float,
              micro_batch_size: int | None, beta: float, ulysses: int = 1, lora: bool = False) -> dict:
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    cfg = _config(pp, tp, cfg_scale, micro_batch_size, beta, ulysses, lora)
    cfg.validate(world_size)
    groups = build_parallel_groups(ParallelLayout(tp=tp, pp=pp, ulysses=ulysses))
    trainer = FlowGRPOTrainer(cfg, groups, pipeline_dir, RewardFunction("jpeg_compressibility"))
    n = len(PROMPTS) * GROUP
    traj = trainer.engine.generate(PROMPTS, trainer.sampling_params(), group_size=GROUP,
                                   seeds=[100 + i for i in range(n)])
    advantages = torch.linspace(-1.5, 1.5, n)
    old = trainer.old_log_probs(traj, step=0)
    metrics = trainer._update(traj, old, advantages, step=0, ref_means=trainer.reference_means(traj, step=0))
    before = {k: v.clone() for k, v in trainer.engine.transformer.state_dict().items()}
    trainer.sync_weights()
    after = trainer.engine.transformer.state_dict()
    # LoRA: the engine gains peft adapters (B starts at zero, so B's entries measure the update)
    moved = (max(float(v.abs().max()) for k, v in after.items() if "lora_B" in k) if lora
             else max(float((after[k] - before[k]).abs().max()) for k in after))
    return {"rollout": traj.log_probs, "old": old, "metrics": metrics,
            "weights": {k: v.clone() for k, v in after.items()}, "moved": moved}


CASES = [
    pytest.param(2, 2, 1, 1, 1.0, 0.0, 1, id="pp2"),
    pytest.param(2, 2, 1, 1, 2.5, 0.0, 1, id="pp2-cfg"),
    # The same schedule code at pp=1 with context parallelism (image tokens gathered on the last stage).
    # Loss, log-probs, grads and the grad norm (over Megatron's tp x pp model-parallel group) match.
    pytest.param(2, 1, 1, 2, 2.5, 0.0, 1, id="cp2-cfg"),
    # With a KL term: the second mini-batch (after one optimizer step) has kl > 0 through the reference
    # model's own forward-only pass over the pipeline.
    pytest.param(4, 2, 2, 1, 2.5, 0.5, 1, id="pp2xtp2-cfg-kl"),
    # Both window steps of a mini-batch's 2 samples in one forward (4 transitions, each row its own
    # timestep) against one forward per window step.
    pytest.param(1, 1, 1, 1, 2.5, 0.5, 4, id="fused-window-cfg-kl"),
    # LoRA (adaLN too: a column-parallel linear that gathers its output; the distributed optimizer) at pp=2 x
    # tp=2 with the KL term taken with the adapters off, and at cp=2: the adapters, seeded per module, start
    # alike at any layout, their update equals pp=1's, and every engine gets every stage's adapters via peft.
    pytest.param(4, 2, 2, 1, 1.0, 0.5, 1, True, id="pp2xtp2-lora-kl"),
    pytest.param(2, 1, 1, 2, 2.5, 0.0, 1, True, id="cp2-lora-cfg"),
]


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory) -> str:
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    path = tmp_path_factory.mktemp("trainer_pp") / "tiny"
    make_tiny_pipeline(path, seed=0)
    return str(path)


@pytest.mark.parametrize("world_size,pp,tp,ulysses,cfg_scale,beta,micro_batch_size,lora",
                         [pytest.param(*c.values, *([False] if len(c.values) == 7 else []), id=c.id) for c in CASES])
def test_pipeline_update_equals_pp1(pipeline_dir: str, world_size: int, pp: int, tp: int, ulysses: int,
                                    cfg_scale: float, beta: float, micro_batch_size: int, lora: bool) -> None:
    ref = run_ranks(_one_step, world_size, pipeline_dir, 1, 1, cfg_scale, None, beta, 1, lora, timeout_s=400)
    got = run_ranks(_one_step, world_size, pipeline_dir, pp, tp, cfg_scale, micro_batch_size, beta, ulysses, lora,
                    timeout_s=400)
    base = ref[0]
    assert torch.equal(got[0]["rollout"], base["rollout"]), "both runs must train on the same trajectory"
    # The trainer's recompute agrees with the rollout's own log-probs, at pp=1 and pp=2 alike.
    assert float((base["old"] - base["rollout"]).abs().max()) < 1e-5
    assert base["moved"] > 1e-4, "the update did not change the weights"
    assert not beta or base["metrics"]["kl"] > 0
    for r, out in enumerate(got):
        torch.testing.assert_close(out["old"], base["old"], rtol=0, atol=1e-5, msg=f"rank {r} old log-probs")
        keys = ["loss", "policy_loss", "approx_kl", "clipfrac", "ratio_mean", "grad_norm"] + (["kl"] if beta else [])
        for k in keys:
            assert abs(out["metrics"][k] - base["metrics"][k]) <= 1e-5 * max(1.0, abs(base["metrics"][k])), (
                r, k, out["metrics"][k], base["metrics"][k])
        assert base["metrics"]["grad_norm"] > _config(1, 1, 1.0, None, lora=lora).optim.clip_grad, \
            "clipping must act"
        assert set(out["weights"]) == set(base["weights"]), f"rank {r}: the engines' modules differ"
        for name, w in base["weights"].items():
            torch.testing.assert_close(out["weights"][name], w, rtol=0, atol=1e-5,
                                       msg=f"rank {r}: engine weight {name} after the pp={pp} update")


def _split_rollout(rank: int, world_size: int, pipeline_dir: str, pp: int, tp: int, cfg_scale: float) -> dict:
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    cfg = _config(pp, tp, cfg_scale, None)
    groups = build_parallel_groups(ParallelLayout(tp=tp, pp=pp))
    reward_fn = RewardFunction("jpeg_compressibility")
    trainer = FlowGRPOTrainer(cfg, groups, pipeline_dir, reward_fn)
    n = len(PROMPTS) * GROUP
    seeds = [100 + i for i in range(n)]
    split, rewards, _ = trainer.rollout(PROMPTS, seeds)
    whole = trainer.engine.generate(PROMPTS, trainer.sampling_params(), group_size=GROUP, seeds=seeds)
    from megatron_omni.trainer.rewards import to_uint8_hwc

    whole_rewards = reward_fn.scorer([to_uint8_hwc(im) for im in whole.images],
                                     [p for p in PROMPTS for _ in range(GROUP)])
    return {"split": split, "whole": whole, "rewards": rewards, "whole_rewards": torch.tensor(whole_rewards)}


@pytest.mark.parametrize("world_size,pp,tp,cfg_scale", [(2, 1, 2, 2.5), (4, 2, 2, 1.0)])
def test_rollout_split_over_the_replica_equals_one_rank_rollout(pipeline_dir: str, world_size: int, pp: int,
                                                                tp: int, cfg_scale: float) -> None:
    """The ranks of a model replica each roll out a share of the samples and gather them: every rank ends
    with the trajectory (and rewards) one rank would have generated alone, text padding included."""
    for r, out in enumerate(run_ranks(_split_rollout, world_size, pipeline_dir, pp, tp, cfg_scale, timeout_s=400)):
        split, whole = out["split"], out["whole"]
        assert split.prompts == whole.prompts and torch.equal(split.seeds, whole.seeds), r
        for name in ("latents", "next_latents", "log_probs", "images", "sigmas", "window_start"):
            torch.testing.assert_close(getattr(split, name), getattr(whole, name), rtol=0, atol=1e-5,
                                       msg=f"rank {r}: {name}")
        mask = whole.prompt_embeds_mask
        assert torch.equal(split.prompt_embeds_mask[:, : mask.shape[1]], mask) and not split.prompt_embeds_mask[
            :, mask.shape[1]:].any()
        torch.testing.assert_close(out["rewards"], out["whole_rewards"], rtol=0, atol=1e-6)


def _nft_step(rank: int, world_size: int, pipeline_dir: str, pp: int, cfg_scale: float, beta: float,
              micro_batch_size: int | None) -> dict:
    """One DiffusionNFT update through the trainer's own path: the step's ODE rollout, its noised points and the
    old policy's (and with beta > 0 the reference's) velocities through the pipeline, the mini-batch updates, the
    sync into the engine."""
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    cfg = _config(pp, 1, cfg_scale, micro_batch_size, beta)
    cfg.algorithm.name = "diffusionnft"
    cfg.algorithm.nft.mix_beta, cfg.algorithm.nft.timestep_fraction = 0.5, 0.75  # 3 of the 4 noise levels
    cfg.validate(world_size)
    trainer = FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout(pp=pp)), pipeline_dir,
                              RewardFunction("jpeg_compressibility"))
    n = len(PROMPTS) * GROUP
    traj = trainer.engine.generate(PROMPTS, trainer.sampling_params(step=0), group_size=GROUP,
                                   seeds=[100 + i for i in range(n)])
    times: dict = {}
    objective = trainer.nft_objective(traj, torch.linspace(-1.5, 1.5, n), 0, times, None)
    old_v = trainer.pipeline.from_last_stage(objective.old_velocity)
    metrics = trainer.run_updates(objective, step=0)
    before = {k: v.clone() for k, v in trainer.engine.transformer.state_dict().items()}
    trainer.sync_weights()
    after = trainer.engine.transformer.state_dict()
    return {"final": traj.final_latents, "window": traj.log_probs.shape[1], "old_v": old_v, "metrics": metrics,
            "weights": {k: v.clone() for k, v in after.items()},
            "moved": max(float((after[k] - before[k]).abs().max()) for k in after)}


@pytest.mark.parametrize("cfg_scale,beta,micro_batch_size", [pytest.param(2.5, 0.5, 1, id="nft-pp2-cfg-kl")])
def test_diffusionnft_update_at_pp2_equals_pp1(pipeline_dir: str, cfg_scale: float, beta: float,
                                                micro_batch_size: int) -> None:
    """DiffusionNFT trains through the same Megatron-Core schedules: at pp=2 (1F1B over micro-batches of one
    noised point) the old policy's velocities, the loss, its metrics and every engine's weights after the
    update equal the pp=1 run's (2 ranks of data parallel fed the same samples); its rollout is the ODE."""
    ref = run_ranks(_nft_step, 2, pipeline_dir, 1, cfg_scale, beta, None, timeout_s=400)
    got = run_ranks(_nft_step, 2, pipeline_dir, 2, cfg_scale, beta, micro_batch_size, timeout_s=400)
    base = ref[0]
    assert base["window"] == 0, "an ODE rollout records no SDE transitions"
    assert base["moved"] > 1e-4 and base["metrics"]["kl_loss"] > 0
    for r, out in enumerate(got):
        assert torch.equal(out["final"], base["final"]), "both runs must train on the same samples"
        torch.testing.assert_close(out["old_v"], base["old_v"], rtol=0, atol=1e-5, msg=f"rank {r} old velocities")
        for k in ("loss", "policy_loss", "positive_loss", "negative_loss", "old_deviate", "kl_loss", "grad_norm"):
            assert abs(out["metrics"][k] - base["metrics"][k]) <= 1e-5 * max(1.0, abs(base["metrics"][k])), (
                r, k, out["metrics"][k], base["metrics"][k])
        for name, w in base["weights"].items():
            torch.testing.assert_close(out["weights"][name], w, rtol=0, atol=1e-5,
                                       msg=f"rank {r}: engine weight {name} after the pp=2 update")
