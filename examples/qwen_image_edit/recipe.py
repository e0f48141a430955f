"""Qwen-Image-Edit recipes: the tiny editing task on CPU (`tiny`). docs/families-qwen-image-edit.md has the task,
the keys and the measured figures."""

from __future__ import annotations

from pathlib import Path

from megatron_omni.trainer.config import JobConfig

TINY_DATA = Path(__file__).resolve().parent / "tiny_data" / "edits.jsonl"


def edit_prompts(path: str | Path) -> list[str]:
    """The prompt strings of an edit data file (`model_providers.qwen_image_edit.data`: JSONL records, images
    beside it; a bad record stops the run here with its line number)."""
    from model_providers.qwen_image_edit.data import read_edit_records

    return [r.prompt for r in read_edit_records(path)]


def tiny() -> JobConfig:
    """FlowGRPO on the tiny offline edit pipeline (`model.pipeline=tiny`, built into the run folder): "write the
    word W on this image" over the shipped 64 x 64 sources (`tiny_data/`), scored by `edit_text` (OCR of the text
    band plus the source's structure kept outside it, half each). A random tiny model writes nothing legible, so
    what it learns in a few steps is the keep term: adding less texture to the plain source outside the band."""
    cfg = JobConfig(run_dir="runs/qwen-image-edit-tiny", steps=12, seed=0)
    cfg.model.family = "qwen_image_edit"
    cfg.prompts = edit_prompts(TINY_DATA)
    r = cfg.rollout
    r.height = r.width = 64
    r.num_steps = 6
    r.noise_level = 1.0
    r.window_size = 2
    r.prompts_per_step = 4
    r.group_size = 4
    cfg.reward.scorer = "edit_text"
    cfg.optim.lr = 1e-2
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.logging.image_every = 4
    cfg.checkpoint.every = 4
    return cfg


# Qwen-Image-Edit 20B (the Qwen-Image MMDiT: the `20b` preset; diffusers' QwenImageEditPlusPipeline folder).
DEFAULT_EDIT_PIPELINE = "/models/Qwen-Image-Edit-2511"
# Per cluster shape: trainer ranks, tensor parallel size, recompute, the distributed optimizer: the fastest layout
# the planner fits on H200 with 10% of it free, the source image's tokens counted (`edit_20b`). Dry-run figures
# (MFU 0.35): 1 node 121.0 GiB of 140.4, 575 s/step (no recompute: 136.1 GiB, selective: 133.6: over the 10%);
# 2 nodes 106.0 GiB, 200 s/step. On H800 (79.6 GiB) neither fits: the embedded engine's bf16 copy of the transformer,
# text encoder and VAE alone is 53.7 GiB per GPU. `2nodes_h800` samples with the vLLM-Omni engine instead, its
# transformer sharded at rollout tp=8 and asleep (released) while the trainer updates: 31.6 GiB of rollout weights,
# 66.6 GiB of 79.6 in all, 375 s/step, 0.085 images/s/GPU (GPU_KIND=H800 NNODES=2 DRY_RUN=1). On 1 node of H800 it
# does not fit with full fine-tuning (96.5 GiB at tp=6, rollout tp=6); `1node_h800` trains LoRA adapters (rank 32,
# alpha 64) on the frozen bf16 base with the vLLM-Omni engine at rollout tp=6: 46.4 GiB of 79.6, 905 s/step, 0.071
# images/s/GPU (GPU_KIND=H800 NNODES=1 DRY_RUN=1; the diffusers engine would plan 72.1 GiB, over the 10% kept free).
EDIT_LAYOUTS: dict[str, dict] = {
    "1node": dict(world=6, tp=6, recompute="full", distributed_optimizer=False),  # dp=1: nothing to shard
    "2nodes": dict(world=16, tp=8, recompute=None, distributed_optimizer=True),
    "2nodes_h800": dict(world=16, tp=8, recompute=None, distributed_optimizer=True, engine="vllm_omni", rollout_tp=8),
    "1node_h800": dict(world=6, tp=6, recompute="full", distributed_optimizer=False, engine="vllm_omni", rollout_tp=6,
                       lora=(32, 64.0)),
}


def edit_20b(cluster: str) -> JobConfig:
    """FlowGRPO on Qwen-Image-Edit 20B toward the edit_text reward (OCR of the text band + the source kept outside
    it) with the Qwen-Image 20B reference hyper-parameters (`examples.qwen_image.recipe.ocr_20b`: 512 x 512, 10 steps,
    noise level 1.2 on a window of 2 in [0, 5), 32 prompts x 16, AdamW lr 3e-5, clip range 1e-5; no published edit
    RL recipe gives others), on the cluster shape `cluster` ("1node": 6 trainer ranks at tp=6, GPUs 6,7 for the
    reward; "2nodes": 16 at tp=8 x dp=2).

    The source image costs what QwenImageEditPlusPipeline makes it cost: its latents at about 1024^2 pixels (4096
    tokens for a square source) follow the 1024 generated tokens in the image stream, and Qwen2.5-VL reads it at
    about 384^2 pixels (196 vision tokens in the text stream); the planner counts both (`planner.arch.edit_tokens`):
    5120 image tokens per forward instead of Qwen-Image's 1024, so the 1-node layout recomputes every block and the
    2-node one shards the optimizer (the Qwen-Image layouts do neither).
    The embedded diffusers engine samples on H200; `2nodes_h800` samples with the vLLM-Omni edit pipeline at rollout
    tp=8, `1node_h800` (6 trainer ranks at tp=6) trains LoRA adapters and samples with it at rollout tp=6 (see
    EDIT_LAYOUTS). No CFG (guidance 1), as Qwen-Image's reference recipe; `rollout.guidance_scale=4
    rollout.negative_prompt=" "` runs the edit pipeline's true CFG (twice the transformer rows).

    Inputs from the environment: `QWEN_IMAGE_EDIT_PIPELINE` (the folder; default /models/Qwen-Image-Edit-2511; a dry
    run without it plans the `20b` preset at diffusers' resize areas) and `EDIT_DATA` (image + instruction JSONL
    records, `model_providers.qwen_image_edit.data`; default: the shipped tiny records)."""
    import os

    if cluster not in EDIT_LAYOUTS:
        raise ValueError(f"unknown cluster shape {cluster!r}; known: {sorted(EDIT_LAYOUTS)}")
    lay = EDIT_LAYOUTS[cluster]
    cfg = JobConfig(run_dir=f"runs/qwen-image-edit-20b-{cluster}", steps=1000, seed=42)
    cfg.model.family = "qwen_image_edit"
    cfg.model.pipeline = os.environ.get("QWEN_IMAGE_EDIT_PIPELINE") or DEFAULT_EDIT_PIPELINE
    cfg.model.preset = "20b"
    cfg.model.backend = os.environ.get("MODEL_BACKEND") or "te"
    cfg.model.params_dtype = "bf16"
    cfg.model.recompute = lay["recompute"]
    cfg.prompts = edit_prompts(os.environ.get("EDIT_DATA") or TINY_DATA)
    r = cfg.rollout
    r.height = r.width = 512
    r.num_steps = 10
    r.noise_level = 1.2
    r.window_size = 2
    r.window_range = [0, 5]
    r.prompts_per_step = 32
    r.group_size = 16
    r.max_batch_size = 16
    r.engine = lay.get("engine", "diffusers")
    r.tp = lay.get("rollout_tp", 1)
    r.dtype = "bf16"
    cfg.parallel.tp = lay["tp"]
    cfg.reward.scorer = "edit_text"
    cfg.reward.timeout_s = 600.0
    a = cfg.algorithm
    a.clip_range = 1e-5
    a.adv_clip = 5.0
    a.std_mode = "global"
    a.beta = 0.0
    o = cfg.optim
    o.lr = 3e-5
    o.weight_decay = 1e-4
    o.clip_grad = 1.0
    o.mini_batches = 2
    o.micro_batch_size = 1
    o.distributed_optimizer = lay["distributed_optimizer"]
    cfg.checkpoint.every = 20
    cfg.checkpoint.keep = 2
    cfg.logging.image_every = 10
    if "lora" in lay:
        # LoRA adapts Megatron-Core's local linears (not the TE spec's); flow_grpo's LoRA settings (the SD3.5 recipe's:
        # rank 32, alpha 64, lr 3e-4), as no published edit RL recipe gives others
        cfg.model.lora.rank, cfg.model.lora.alpha = lay["lora"]
        cfg.model.backend = "local"
        o.lr = 3e-4
    return cfg


def edit_20b_1node() -> JobConfig:
    """Qwen-Image-Edit 20B on 1 node x 8 GPUs, 2 of them for the reward: 6 trainer ranks at tp=6."""
    return edit_20b("1node")


def edit_20b_2nodes() -> JobConfig:
    """Qwen-Image-Edit 20B on 2 nodes x 8 GPUs: 16 trainer ranks at tp=8 x dp=2."""
    return edit_20b("2nodes")


def edit_20b_2nodes_h800() -> JobConfig:
    """Qwen-Image-Edit 20B on 2 nodes x 8 H800: 16 trainer ranks at tp=8 x dp=2, the vLLM-Omni engine at rollout
    tp=8 (the embedded engine's resident bf16 copy does not fit an H800)."""
    return edit_20b("2nodes_h800")


def edit_20b_1node_h800() -> JobConfig:
    """Qwen-Image-Edit 20B on 1 node x 8 H800, 2 GPUs for the reward: 6 trainer ranks at tp=6 training LoRA adapters
    (rank 32, alpha 64; full fine-tuning does not fit), the vLLM-Omni engine at rollout tp=6."""
    return edit_20b("1node_h800")
