"""FLUX.1 recipes: the tiny CPU demo on the offline tiny FLUX.1 pipeline (guidance-distilled like FLUX.1-dev), and
FLUX.1-dev (12B) FlowGRPO on 1 and 2 nodes with DanceGRPO's FLUX hyper-parameters (examples/flux/train_flux.sh
launches them; `DRY_RUN=1` plans them). docs/families-flux.md has what the family supports and the figures."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def tiny() -> JobConfig:
    """FlowGRPO on the tiny offline FLUX.1 pipeline (`model.pipeline=tiny`, built into the run folder) toward JPEG
    compressibility: the distilled guidance scale 3.5 as the model's input (FluxPipeline's default), no true CFG,
    64 x 64 images (a 4 x 4 grid of packed 2 x 2 latent patches), 6 sampling steps, 8 RL steps of 32 images.

    Settings as the tiny SD3.5 recipe's (noise level 1.2, window 2, lr 3e-3, clip range 0.2); T5's text is padded to
    16 tokens. The measured rise per seed is in docs/families-flux.md; the e2e test runs seed 0."""
    cfg = JobConfig(run_dir="runs/flux-tiny", steps=8, seed=0)
    cfg.model.family = "flux"
    cfg.prompts = ["a red cat", "a bowl of fruit", "a city street at night", "a lighthouse on a cliff"]
    r = cfg.rollout
    r.height = r.width = 64
    r.num_steps = 6
    r.noise_level = 1.2
    r.window_size = 2
    r.distilled_guidance = 3.5
    r.max_sequence_length = 16
    r.prompts_per_step = 4
    r.group_size = 8
    cfg.reward.scorer = "jpeg_compressibility"
    cfg.optim.lr = 3e-3
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.checkpoint.every = 4  # preemption-safe by default: a tiny checkpoint costs well under a second
    return cfg


# FLUX.1-dev's layouts, planned with `--dry-run` (full fine-tuning of 12B: bf16 weights, fp32 grads, Adam states
# sharded by the distributed optimizer; full recompute; the diffusers engine's 12B + T5-XXL + CLIP-L + VAE resident
# beside them, 31.4 GiB): tp=4 is the smallest tp that fits an H800, so one recipe runs on H200 and H800: 71.8 GiB
# (1 node) / 63.3 GiB (2 nodes) of 79.6 (H800) / 140.4 (H200); tp=2 needs 88.1 GiB (H200 only, step 185 s vs 214 s).
# The peak is the rollout phase, so a micro-batch of 2 plans the same total: 1 is kept.
LAYOUTS: dict[int, dict] = {
    1: dict(tp=4, micro_batch_size=1),  # 8 trainer ranks (the reward on node 0's CPUs)
    2: dict(tp=4, micro_batch_size=1),  # 16 trainer ranks
}


def flux1_dev(nodes: int, reward: str = "pickscore") -> JobConfig:
    """FlowGRPO on FLUX.1-dev (12B, guidance-distilled: the guidance scale is the model's input, one forward per
    sampling step, no CFG rows) on `nodes` nodes of 8 GPUs (`LAYOUTS`), toward `reward` ("pickscore" or "ocr").
    Sources, DanceGRPO's FLUX launch (scripts/finetune/finetune_flux_grpo_8gpus.sh, its flags checked against a
    published copy): resolution 720 x 720, 16 sampling steps, timestep fraction 0.6 (here a window of 10 of the 16
    steps), group size 12, lr 1e-5, weight decay 1e-4, clip range 1e-4, advantage clip 5, grad clip 1.0, no KL term,
    full fine-tuning (no LoRA), the distilled guidance 3.5 (diffusers' FluxPipeline default), T5 length 512
    (FLUX.1-dev's `max_sequence_length`). The noise level 0.7 is flow_grpo's (its SDE's `noise_level`; DanceGRPO's
    eta 0.3 is a differently scaled SDE), the window's start range [0, 16) and 16 prompts per step with 2 optimizer
    updates per step are chosen (flow_grpo's 2 updates per epoch). DanceGRPO's reward is HPSv2, not served here:
    PickScore is the human- preference scorer we have. DanceGRPO also passes `--shift 3` to its own sigma schedule;
    here the sigmas are the folder's scheduler's (FLUX.1-dev's resolution-dependent dynamic shift), which the
    trainer recomputes exactly."""
    import os

    from examples.qwen_image.recipe import load_prompts

    if nodes not in LAYOUTS:
        raise ValueError(f"no FLUX.1-dev layout for {nodes} nodes: expected one of {sorted(LAYOUTS)}")
    if reward not in ("ocr", "pickscore"):
        raise ValueError(f"unknown FLUX.1-dev recipe reward {reward!r}: expected 'ocr' or 'pickscore'")
    shape = LAYOUTS[nodes]
    cfg = JobConfig(run_dir=f"runs/flux1-dev-{reward}-{nodes}nodes", steps=300, seed=42)
    cfg.model.family = "flux"
    cfg.model.preset = "flux1-dev"
    cfg.model.pipeline = os.environ.get("FLUX_PIPELINE") or "/models/FLUX.1-dev"
    cfg.model.params_dtype = "bf16"
    cfg.model.recompute = "full"
    cfg.parallel.tp = shape["tp"]
    cfg.prompts = load_prompts(os.environ.get("OCR_PROMPTS") or None)
    r = cfg.rollout
    r.height = r.width = 720
    r.num_steps = 16
    r.noise_level = 0.7
    r.window_size = 10
    r.window_range = [0, 16]
    r.distilled_guidance = 3.5
    r.max_sequence_length = 512
    r.prompts_per_step = 16
    r.group_size = 12
    r.dtype = "bf16"
    cfg.reward.scorer = reward
    a = cfg.algorithm
    a.clip_range = 1e-4
    a.beta = 0.0
    a.adv_clip = 5.0
    o = cfg.optim
    o.lr = 1e-5
    o.weight_decay = 1e-4
    o.clip_grad = 1.0
    o.mini_batches = 2
    o.micro_batch_size = shape["micro_batch_size"]
    o.distributed_optimizer = True
    o.ema_decay = 0.0
    cfg.checkpoint.every = 20
    cfg.logging.image_every = 20
    return cfg


def flux1_dev_1node() -> JobConfig:
    """FLUX.1-dev on 1 node (8 GPUs), PickScore (REWARD=ocr in train_flux.sh: `flux1_dev(1, "ocr")`)."""
    return flux1_dev(1)


def flux1_dev_2nodes() -> JobConfig:
    """FLUX.1-dev on 2 nodes (16 GPUs), PickScore."""
    return flux1_dev(2)


def flux1_dev_1node_ocr() -> JobConfig:
    """FLUX.1-dev on 1 node x OCR."""
    return flux1_dev(1, "ocr")


def flux1_dev_2nodes_ocr() -> JobConfig:
    """FLUX.1-dev on 2 nodes x OCR."""
    return flux1_dev(2, "ocr")
