"""SD3.5 recipes: the tiny CPU demo on the offline tiny SD3.5 pipeline, and flow_grpo's published SD3.5-Medium
recipes (OCR, PickScore) on SD3.5-Medium and -Large (examples/sd3/train_sd35.sh launches them; `DRY_RUN=1` plans
them). docs/families-sd3.md has what the family supports and the figures."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def tiny() -> JobConfig:
    """FlowGRPO on the tiny offline SD3.5 pipeline (`model.pipeline=tiny`, built into the run folder) toward JPEG
    compressibility, with SD3.5's true CFG (4.5, an empty negative prompt, as flow_grpo samples): 64 x 64 images
    (a 4 x 4 patch grid), 6 sampling steps, 8 RL steps of 32 images in well under a minute on 2 CPU cores.

    The tiny model's noise level is Qwen-Image's 1.2 (at flow_grpo's SD3.5 0.7 the tiny random model explored too
    little to learn in 8 steps). Measured rise (mean reward of the last two steps minus the first two), seeds
    0 / 1 / 2: +0.049 / -0.154 / +0.056: a random tiny model learns at two of three seeds (seed 1's weights drift
    toward larger JPEGs whatever the reward's sign); the e2e test runs seed 0."""
    cfg = JobConfig(run_dir="runs/sd3-tiny", steps=8, seed=0)
    cfg.model.family = "sd3"
    cfg.prompts = ["a red cat", "a bowl of fruit", "a city street at night", "a lighthouse on a cliff"]
    r = cfg.rollout
    r.height = r.width = 64
    r.num_steps = 6
    r.noise_level = 1.2
    r.window_size = 2
    r.guidance_scale = 4.5
    r.negative_prompt = ""
    r.max_sequence_length = 16  # T5's padded length (the text is CLIP's 77 tokens plus these)
    r.prompts_per_step = 4
    r.group_size = 8
    cfg.reward.scorer = "jpeg_compressibility"
    cfg.optim.lr = 3e-3
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.checkpoint.every = 4  # preemption-safe by default: a tiny checkpoint costs well under a second
    return cfg



# The published SD3.5 shapes: the diffusers folder (SD35_PIPELINE, else the default below), the preset and the
# micro-batch ((image, window step) samples per forward; tp=1 x dp, LoRA, no recompute). The micro-batch is the
# largest the planner (`--dry-run`) fits on an H800 with over 10% of it free, so the same recipe runs on H200 and
# H800: SD3.5-M on 1 node (6 trainer ranks, GPUs 6,7 for the reward) 67.0 GiB of 79.6 (H800) / 140.4 (H200) at 8;
# SD3.5-L on 2 nodes (16 ranks) 68.5 GiB at 2 (3 would leave 0.1 GiB).
SIZES: dict[str, dict] = {
    "medium": dict(preset="sd35-medium", pipeline="/models/stable-diffusion-3.5-medium", micro_batch_size=8),
    "large": dict(preset="sd35-large", pipeline="/models/stable-diffusion-3.5-large", micro_batch_size=2),
}


def sd35(size: str, reward: str) -> JobConfig:
    """flow_grpo's SD3.5 recipe (`reward` "ocr" or "pickscore") on a published shape (`SIZES`). Each setting's
    source, flow_grpo's config/base.py (base) and config/grpo.py (`general_ocr_sd3`, `pickscore_sd3`):

    - resolution 512, 10 sampling steps, guidance 4.5 (true CFG, plain): grpo.py, both recipes;
    - noise level 0.7, SDE window 2 in [0, 10): base (`sample.noise_level`, `sde_window_size/range`);
    - group size 24 (`num_image_per_prompt`), 48 prompt groups per epoch, 2 optimizer updates per epoch
      (`gradient_accumulation_steps = num_batches_per_epoch // 2`): grpo.py; here 48 prompts x 24 per RL step,
      `optim.mini_batches=2`;
    - clip range 1e-4, lr 3e-4, AdamW (0.9, 0.999, weight decay 1e-4, eps 1e-8), grad clip 1.0, advantage clip 5:
      base;
    - KL beta 0.04 (OCR) / 0.01 (PickScore), global std: grpo.py (its EMA of the LoRA weights is off here: our
      EMA keeps a full copy, refused with LoRA);
    - LoRA (base `use_lora=True`): rank 32, alpha 64 as flow_grpo's scripts/train_sd3.py LoraConfig (recalled, not
      re-read in this session); T5 length 128 likewise from its prompt encoding.
    The trainer samples and trains in bf16 (flow_grpo: `mixed_precision="fp16"` by default); the VAE decodes in fp32,
    as flow_grpo's train_sd3.py keeps it (`rollout.vae_dtype=fp32`; the dry run counts its fp32 bytes)."""
    import os

    from examples.qwen_image.recipe import load_prompts

    if reward not in ("ocr", "pickscore"):
        raise ValueError(f"unknown SD3.5 recipe reward {reward!r}: expected 'ocr' or 'pickscore'")
    shape = SIZES[size]
    cfg = JobConfig(run_dir=f"runs/sd35-{size}-{reward}", steps=1000, seed=42)
    cfg.model.family = "sd3"
    cfg.model.preset = shape["preset"]
    cfg.model.pipeline = os.environ.get("SD35_PIPELINE") or shape["pipeline"]
    cfg.model.backend = "local"  # LoRA adapts Megatron-Core's local linears (the TE spec's are not adapted yet)
    cfg.model.params_dtype = "bf16"
    cfg.model.lora.rank = 32
    cfg.model.lora.alpha = 64.0
    cfg.prompts = load_prompts(os.environ.get("OCR_PROMPTS") or None)
    r = cfg.rollout
    r.height = r.width = 512
    r.num_steps = 10
    r.noise_level = 0.7
    r.window_size = 2
    r.window_range = [0, 10]
    r.guidance_scale = 4.5
    r.negative_prompt = ""
    r.max_sequence_length = 128
    r.prompts_per_step = 48
    r.group_size = 24
    r.dtype = "bf16"
    # flow_grpo decodes with an fp32 VAE under its half-precision transformer (scripts/train_sd3.py moves
    # `pipeline.vae` to the device in torch.float32)
    r.vae_dtype = "fp32"
    cfg.reward.scorer = reward
    a = cfg.algorithm
    a.clip_range = 1e-4
    a.beta = 0.04 if reward == "ocr" else 0.01
    a.adv_clip = 5.0
    o = cfg.optim
    o.lr = 3e-4
    o.weight_decay = 1e-4
    o.clip_grad = 1.0
    o.mini_batches = 2
    o.micro_batch_size = shape["micro_batch_size"]
    # flow_grpo's train.ema=True averages its LoRA parameters; our EMA keeps a full copy and is refused with LoRA
    o.ema_decay = 0.0
    cfg.checkpoint.every = 20
    cfg.logging.image_every = 20
    return cfg


def sd35_medium_ocr() -> JobConfig:
    """SD3.5-Medium (2.5B) x OCR, flow_grpo's `general_ocr_sd3`."""
    return sd35("medium", "ocr")


def sd35_medium_pickscore() -> JobConfig:
    """SD3.5-Medium (2.5B) x PickScore, flow_grpo's `pickscore_sd3`."""
    return sd35("medium", "pickscore")


def sd35_large_ocr() -> JobConfig:
    """SD3.5-Large (8B) x OCR with flow_grpo's SD3.5-M hyper-parameters (flow_grpo publishes no SD3.5-L run)."""
    return sd35("large", "ocr")


def sd35_large_pickscore() -> JobConfig:
    """SD3.5-Large (8B) x PickScore with flow_grpo's SD3.5-M hyper-parameters."""
    return sd35("large", "pickscore")
