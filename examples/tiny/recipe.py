"""CPU recipes on the tiny offline Qwen-Image pipelines (`make demo` runs `ocr_miniature`; `jpeg_demo` is the
entry point's default)."""

from __future__ import annotations

from pathlib import Path

from megatron_omni.trainer.config import JobConfig


def jpeg_demo() -> JobConfig:
    """FlowGRPO toward JPEG compressibility (a reward a tiny random model can learn in minutes)."""
    cfg = JobConfig(run_dir="runs/tiny-jpeg", steps=12, seed=0)
    cfg.rollout.height = cfg.rollout.width = 64
    cfg.rollout.num_steps = 6
    cfg.rollout.window_size = 2
    cfg.rollout.prompts_per_step = 4
    cfg.rollout.group_size = 4
    cfg.optim.lr = 3e-3
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.reward.scorer = "jpeg_compressibility"
    # Preemption-safe by default: a tiny checkpoint costs well under a second, so a lost job loses <= 4 steps.
    cfg.checkpoint.every = 4
    return cfg


def ocr_demo() -> JobConfig:
    """The same loop scored by the local OCR reader (prompts quote the text to render)."""
    cfg = jpeg_demo()
    cfg.run_dir = "runs/tiny-ocr"
    cfg.reward.scorer = "ocr"
    cfg.prompts = ['a sign that says "CAT"', 'a poster with the word "SUN"', 'the text "OK"', 'a label "HI"']
    return cfg


TEXT_PIPELINE = Path(__file__).resolve().parent / "text_pipeline"


def ocr_miniature() -> JobConfig:
    """The OCR miniature: FlowGRPO on the shipped tiny text-rendering pipeline (pretrained by
    tools/pretrain_tiny_text.py; its pretrain.json records how legible it is), scored by the local OCR reader.

    RL prompts are 24 of the 32 pretraining words; the held-out evaluation samples 8 of those and the 8
    words RL never sees with the ODE (more steps, same guidance) before and after. Run it with the reward
    server as its own process: `bash examples/tiny/ocr_miniature.sh` (TP=2: NPROC_PER_NODE=2 and
    --set parallel.tp=2)."""
    from model_providers.ocr_miniature.text_dataset import HELD_OUT_WORDS, RL_WORDS, prompt_for

    cfg = JobConfig(run_dir="runs/tiny-ocr-miniature", steps=24, seed=0)
    cfg.checkpoint.every = 8  # preemption-safe by default (a lost job loses <= 8 steps)
    cfg.model.pipeline = str(TEXT_PIPELINE)
    cfg.prompts = [prompt_for(w) for w in RL_WORDS]
    r = cfg.rollout
    r.height = r.width = 64
    r.num_steps = 10
    r.noise_level = 1.0
    r.window_size = 2
    r.guidance_scale = 3.0
    r.negative_prompt = " "
    r.prompts_per_step = 4
    r.group_size = 8  # a weak writer: more tries per word make a better one in the group likelier
    r.max_batch_size = 32
    cfg.reward.scorer = "ocr"
    # Measured: 1e-4 raises the held-out OCR similarity (0.247 -> 0.357 in 24 steps); 2e-4 gains less (0.320)
    # and 5e-4 destroys the model (Adam turns the small, noisy gradients into +-lr steps on every weight).
    cfg.optim.lr = 1e-4
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.algorithm.std_mode = "group"
    cfg.logging.image_every = 8
    cfg.eval.prompts = [prompt_for(w) for w in RL_WORDS[:8] + HELD_OUT_WORDS]
    # 8 seeds (128 images): with 2 the "before" figure alone moved from 0.258 to 0.398 when the seeds changed.
    cfg.eval.seeds_per_prompt = 8
    cfg.eval.num_steps = 20
    # The same prompts and seeds with the rollout's SDE sampler too (the reward RL optimises): both rise over the
    # recipe's 24 steps; in longer runs the ODE's falls back while the training reward keeps rising (recipes.md).
    cfg.eval.rollout_sampler = True
    return cfg


def ocr_miniature_lora() -> JobConfig:
    """The OCR miniature with LoRA (rank 32, alpha 64 on the attention and MLP linears of both streams, as
    flow_grpo's Qwen-Image recipe): only the adapters train, the engine receives them through peft after
    every step, checkpoints hold the adapters and the base's checksum (`convert.py lora-to-hf` exports them).
    `RECIPE=examples.tiny.recipe:ocr_miniature_lora bash examples/tiny/ocr_miniature.sh`."""
    cfg = ocr_miniature()
    cfg.run_dir = "runs/tiny-ocr-miniature-lora"
    cfg.model.lora.rank = 32
    cfg.model.lora.alpha = 64.0
    # Measured (docs/recipes.md): held-out OCR similarity 0.247 -> 0.330 in 24 steps at 3e-4 (full fine-tuning:
    # 0.357 at 1e-4); 1e-3 barely moves it (0.259) and 5e-3 destroys the model (0.000).
    cfg.optim.lr = 3e-4
    cfg.rollout.transformer = "engine"  # the adapter-only sync into the engine's own copy, proven every step
    return cfg
