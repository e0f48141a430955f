"""BAGEL recipes: FlowGRPO on BAGEL's text-to-image generation with vLLM-Omni's own engine serving its BAGEL pipeline
(with our SDE window) as the rollout (`model.family=bagel`, `rollout.vllm_omni_process=engine`; docs/families-bagel.md
has what the family's RL covers and the figures)."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def tiny() -> JobConfig:
    """FlowGRPO on the tiny offline BAGEL (`model.pipeline=tiny`: the preset's seeded folder in the published
    layout, written into the run folder, served by vLLM-Omni's engine from a worker process on our CPU platform)
    toward JPEG compressibility, on CPU: 32 x 32 images (a 2 x 2
    latent-token grid), BAGEL's schedule with 4 steps (shift 3.0), a 2-step SDE window at noise 1.0, BAGEL's
    text CFG at 4.0 (its default scale; the unconditional branch is the empty text cache), 8 RL steps of 8 images
    (2 prompts x 4). Prompts are token ids (the tiny BAGEL has no tokenizer)."""
    cfg = JobConfig(run_dir="runs/bagel-tiny", steps=8, seed=0)
    cfg.model.family = "bagel"
    cfg.model.preset = "tiny"
    cfg.prompts = ["17 42 99 7", "5 6", "20 21 22 23", "60 61 62"]
    r = cfg.rollout
    r.engine = "vllm_omni"
    r.vllm_omni_process = "engine"
    r.height = r.width = 32
    r.num_steps = 4
    r.noise_level = 1.0
    r.window_size = 2
    r.guidance_scale = 4.0
    r.prompts_per_step = 2
    r.group_size = 4
    cfg.reward.scorer = "jpeg_compressibility"
    cfg.optim.lr = 3e-3
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.checkpoint.every = 4
    return cfg


# Prompts of the 7B recipe: text through BAGEL's tokenizer (the folder's Qwen2 files), each asking for words in the
# image (an OCR reward compares the rendered text with the quoted words).
OCR_PROMPTS = [
    'A storefront sign that reads "OPEN LATE"',
    'A coffee cup with the word "Monday" printed on it',
    'A chalkboard menu that says "Soup of the day"',
    'A neon sign reading "Hello World"',
    'A book cover titled "The Quiet Sea"',
    'A street sign that says "Main St"',
    'A birthday cake with "Happy 30th" written in icing',
    'A poster announcing "Jazz Night"',
]


def bagel_7b(gpu: str = "H200") -> JobConfig:
    """FlowGRPO on BAGEL-7B-MoT (`model.pipeline`: the published folder, `BAGEL_PIPELINE` or /models/BAGEL-7B-MoT)
    on one node of 8 `gpu`s toward OCR: 1024 x 1024 (BAGEL's resolution), 10
    sampling steps with a 2-step window at noise 0.7 over steps [0, 5), BAGEL's text CFG 4.0, 64 images per step
    (8 prompts x 8), bf16 weights with the distributed optimizer, the generation expert trained (the understanding
    expert frozen). The tp is the smallest the MoT planner fits on `gpu` for this workload (`planner.mot`: tp 1 on
    H200, tp 4 on H800); `DRY_RUN=1 bash examples/bagel/train_bagel.sh` prints the plan."""
    import os

    from megatron_omni.planner.mot import plan_mot

    cfg = JobConfig(run_dir=f"runs/bagel-7b-mot-{gpu.lower()}", steps=300, seed=42)
    cfg.model.family = "bagel"
    cfg.model.preset = "7b-mot"
    cfg.model.pipeline = os.environ.get("BAGEL_PIPELINE") or "/models/BAGEL-7B-MoT"
    cfg.model.params_dtype = "bf16"
    cfg.prompts = list(OCR_PROMPTS)
    r = cfg.rollout
    r.engine = "vllm_omni"
    r.vllm_omni_process = "engine"  # vLLM-Omni's engine, its worker on the rank's GPU, asleep while the rank trains
    r.dtype = "bf16"
    r.height = r.width = 1024
    r.num_steps = 10
    r.noise_level = 0.7
    r.window_size = 2
    r.window_range = [0, 5]
    r.guidance_scale = 4.0
    r.prompts_per_step = 8
    r.group_size = 8
    cfg.reward.scorer = "ocr"
    o = cfg.optim
    o.lr = 1e-5
    o.mini_batches = 2
    o.clip_grad = 1.0
    o.distributed_optimizer = True
    cfg.algorithm.clip_range = 1e-4
    cfg.checkpoint.every = 10
    fitting = [p for p in plan_mot("7b-mot", gpu, 8, r.height, r.width, samples=r.prompts_per_step * r.group_size,
                                   num_steps=r.num_steps, window=r.window_size) if p.fits]
    if not fitting:
        raise ValueError(f"BAGEL-7B-MoT RL does not fit one node of 8 x {gpu} at any tp")
    cfg.parallel.tp = fitting[0].tp
    return cfg


def bagel_7b_h200() -> JobConfig:
    """`bagel_7b` on one node of 8 H200s."""
    return bagel_7b("H200")


def bagel_7b_h800() -> JobConfig:
    """`bagel_7b` on one node of 8 H800s."""
    return bagel_7b("H800")
