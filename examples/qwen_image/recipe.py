"""Qwen-Image 20B against the OCR reward: the reference FlowGRPO set-up (flow_grpo / VeRL-Omni) as recipes,
with one trainer layout per cluster shape.

    python -m megatron_omni.train --recipe examples.qwen_image.recipe:ocr_20b_2nodes \\
        --set model.pipeline=/models/Qwen-Image --set reward.url=http://node0:8000

Reference set-up: 512x512, 10 sampling steps, SDE noise 1.2 on a window of 2 steps starting in [0, 5),
32 prompts x 16 samples per step in 2 mini-batches, AdamW lr 3e-5 (0.9, 0.999, wd 1e-4), grad clip 1.0,
ratio clip 1e-5, no CFG (`ocr_20b_cfg_*`: true CFG 4.0 with the empty negative prompt, as Qwen-Image
samples by default).

Inputs come from the environment so that one launch script serves every cluster:
- `QWEN_IMAGE_PIPELINE`: the diffusers Qwen-Image folder (default /models/Qwen-Image; `--set
  model.pipeline=...` overrides it too). A dry run without the folder plans with the `20b` preset.
- `OCR_PROMPTS`: a text file, one prompt per line, each quoting the text to render ('A sign that says
  "OPEN"', flow_grpo's dataset/ocr/train.txt format); unset: the small built-in list below.

Layouts (trainer ranks on H200; figures from `--dry-run`, reasons in docs/parallelism.md). Trainer and
rollout are bf16; a vLLM-Omni engine at rollout tp=1 sits on every rank (each rank rolls out its share of the
images; it sleeps during the update, and the bridge gathers the trainer's tp shards into it in full mode), and
by default the optimizer state is not sharded, so the layout is the fastest one the planner finds that leaves
10% of the GPU free: TP inside the node x DP, no recompute.
- 1 node x 8 with 2 GPUs for the reward: 6 trainer ranks, tp=6 (dp=1): 117 GiB, 0.653 images/s/GPU predicted
  over all 8 GPUs (tp=3 would need 174 GiB);
- 2 nodes x 8: 16 ranks, tp=8 x dp=2: 102 GiB, 0.818 (tp=4: 145 GiB; rollout tp=8, direct sync: 0.611);
- 4 nodes x 8: 32 ranks, tp=8 x dp=4: 102 GiB, 0.815.
"""

from __future__ import annotations

import os

from megatron_omni.trainer.config import ConfigError, JobConfig
from megatron_omni.trainer.config_checks import read_prompts_file

DEFAULT_PIPELINE = "/models/Qwen-Image"

# A small built-in OCR prompt set (the flow_grpo OCR data set has ~20k such prompts: pass it via OCR_PROMPTS).
OCR_PROMPTS = [
    'A storefront sign that says "OPEN"',
    'A coffee cup with the word "Morning" printed on it',
    'A road sign reading "STOP"',
    'A neon sign that says "Night Market"',
    'A chalkboard menu with "Soup of the Day" written on it',
    'A book cover titled "The Silent River"',
    'A T-shirt printed with "Hello World"',
    'A wooden plaque engraved with "Welcome Home"',
    'A movie poster with the title "Last Light"',
    'A bakery window with "Fresh Bread" painted on it',
    'A street banner that says "Summer Festival 2025"',
    'A license plate reading "QWEN 20B"',
    'A birthday cake with "Happy Birthday Anna" written in icing',
    'A laptop sticker that says "Ship It"',
    'A train station board showing "Platform 9"',
    'A museum entrance sign reading "Modern Art"',
]

# Per cluster shape: trainer ranks, parallel sizes and recompute (chosen from the planner's figures).
LAYOUTS: dict[str, dict] = {
    "1node": dict(world=6, tp=6, rollout_tp=1, recompute=None),
    "2nodes": dict(world=16, tp=8, rollout_tp=1, recompute=None),
    "4nodes": dict(world=32, tp=8, rollout_tp=1, recompute=None),
}


def load_prompts(path: str | None) -> list[str]:
    """Prompts from a file (one per line, blank lines skipped), or the built-in list when `path` is None."""
    if path is None:
        return list(OCR_PROMPTS)
    return read_prompts_file(path, "OCR_PROMPTS")


def ocr_20b() -> JobConfig:
    """The reference recipe, non-CFG, without a cluster layout (tp=1: choose one with --set or a *_node* recipe)."""
    cfg = JobConfig(run_dir="runs/qwen-image-20b-ocr", steps=1000, seed=42)
    cfg.prompts = load_prompts(os.environ.get("OCR_PROMPTS") or None)
    cfg.model.pipeline = os.environ.get("QWEN_IMAGE_PIPELINE") or DEFAULT_PIPELINE
    cfg.model.preset = "20b"
    # TransformerEngine's linears on the cluster; MODEL_BACKEND=local where TE is not installed (the launch
    # scripts' dry run on a laptop sets it: the planner's figures do not depend on the layer spec).
    cfg.model.backend = os.environ.get("MODEL_BACKEND") or "te"
    # Megatron-LM's mixed precision (bf16 weights and activations, fp32 main weights, grads and Adam state);
    # vLLM-Omni samples in bf16 and sleeps during the update (the SDE math and log-probs stay fp32).
    cfg.model.params_dtype = "bf16"
    r = cfg.rollout
    r.height = r.width = 512
    r.num_steps = 10
    r.noise_level = 1.2
    r.sde_type = "sde"
    r.window_size = 2
    r.window_range = [0, 5]
    r.guidance_scale = 1.0
    r.prompts_per_step = 32
    r.group_size = 16
    r.max_batch_size = 16
    r.engine = "vllm_omni"
    r.dtype = "bf16"
    cfg.reward.scorer = "ocr"
    cfg.reward.timeout_s = 600.0  # 512 images per step through one OCR server
    cfg.algorithm.clip_range = 1e-5
    cfg.algorithm.adv_clip = 5.0
    cfg.algorithm.std_mode = "global"
    cfg.algorithm.beta = 0.0
    o = cfg.optim
    o.lr = 3e-5
    o.weight_decay = 1e-4
    o.adam_beta1, o.adam_beta2 = 0.9, 0.999
    o.clip_grad = 1.0
    o.mini_batches = 2
    o.micro_batch_size = 1  # (image, window step) samples per forward: activations stay small
    cfg.checkpoint.every = 20  # preemption-safe by default; SIGTERM also checkpoints (exit 5)
    cfg.checkpoint.keep = 2
    cfg.logging.image_every = 10
    return cfg


def ocr_20b_cfg() -> JobConfig:
    """The CFG variant: true CFG 4.0 against the empty negative prompt (two forwards per sampling step)."""
    cfg = ocr_20b()
    cfg.run_dir = "runs/qwen-image-20b-ocr-cfg"
    cfg.rollout.guidance_scale = 4.0
    cfg.rollout.negative_prompt = " "
    return cfg


def with_layout(cfg: JobConfig, cluster: str) -> JobConfig:
    """Apply the layout of `cluster` ('1node', '2nodes', '4nodes') to `cfg`."""
    if cluster not in LAYOUTS:
        raise ConfigError(f"unknown cluster shape {cluster!r}; known: {sorted(LAYOUTS)}")
    lay = LAYOUTS[cluster]
    cfg.parallel.tp = lay["tp"]
    cfg.rollout.tp = lay["rollout_tp"]
    cfg.model.recompute = lay["recompute"]
    cfg.run_dir = f"{cfg.run_dir}-{cluster}"
    return cfg


def ocr_20b_1node() -> JobConfig:
    """1 node x 8 GPUs, 2 of them for the reward: 6 trainer ranks at tp=6."""
    return with_layout(ocr_20b(), "1node")


def ocr_20b_2nodes() -> JobConfig:
    """2 nodes x 8 GPUs: 16 trainer ranks at tp=8 x dp=2."""
    return with_layout(ocr_20b(), "2nodes")


def ocr_20b_4nodes() -> JobConfig:
    """4 nodes x 8 GPUs: 32 trainer ranks at tp=8 x dp=4."""
    return with_layout(ocr_20b(), "4nodes")


def ocr_20b_cfg_1node() -> JobConfig:
    """CFG variant on 1 node x 8 (6 trainer ranks, tp=6)."""
    return with_layout(ocr_20b_cfg(), "1node")


def ocr_20b_cfg_2nodes() -> JobConfig:
    """CFG variant on 2 nodes x 8 (tp=8 x dp=2)."""
    return with_layout(ocr_20b_cfg(), "2nodes")


def ocr_20b_cfg_4nodes() -> JobConfig:
    """CFG variant on 4 nodes x 8 (tp=8 x dp=4)."""
    return with_layout(ocr_20b_cfg(), "4nodes")
