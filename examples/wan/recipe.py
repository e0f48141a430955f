"""Wan (video) recipes: the tiny video demo on CPU, and the published shapes the launch script plans and runs
(`examples/wan/train_wan.sh`). docs/video.md, "Training Wan", has the keys, the refusals and the figures."""

from __future__ import annotations

from megatron_omni.trainer.config import JobConfig


def wan_video_demo() -> JobConfig:
    """FlowGRPO on the tiny offline Wan pipeline (`model.pipeline=tiny`, built into the run folder) toward
    temporal consistency (`1 - mean |frame_{k+1} - frame_k|` over 5 of the 9 frames): 9-frame 32 x 32 clips, a
    patch grid of 3 x 2 x 2 tokens, 12 RL steps of 16 videos in well under a minute on 2 CPU cores."""
    cfg = JobConfig(run_dir="runs/wan-video-demo", steps=12, seed=0)
    cfg.model.family = "wan"
    cfg.prompts = ["a red cat", "waves on a beach", "a city street at night", "a spinning top"]
    r = cfg.rollout
    r.height = r.width = 32
    r.num_frames = 9  # 3 latent frames (Wan's VAE: 4k + 1 frames)
    r.num_steps = 6
    r.noise_level = 1.0
    r.window_size = 2
    r.max_sequence_length = 16  # Wan pads every prompt's text to this: short prompts, small cross-attention
    r.prompts_per_step = 4
    r.group_size = 4
    cfg.reward.scorer = "temporal_consistency"
    cfg.reward.video_frames = 5
    cfg.optim.lr = 1e-2
    cfg.optim.mini_batches = 2
    cfg.algorithm.clip_range = 0.2
    cfg.logging.image_every = 4
    cfg.logging.video_format = "gif"
    cfg.checkpoint.every = 4  # preemption-safe by default: a tiny checkpoint costs well under a second
    return cfg


# The published shapes the launch script trains (examples/wan/train_wan.sh SIZE=14b | 5b): the
# diffusers folder (WAN_PIPELINE, else the default below; a dry run without it plans with the preset), the
# preset, the clip (Wan2.1: 81 frames at 480 x 832, 16 fps; Wan2.2-TI2V-5B: 121 frames at 704 x 1280, 24 fps).
SIZES: dict[str, dict] = {
    "14b": dict(preset="wan2.1-t2v-14b", pipeline="/models/Wan2.1-T2V-14B-Diffusers", frames=81, height=480,
                width=832),
    "5b": dict(preset="wan2.2-ti2v-5b", pipeline="/models/Wan2.2-TI2V-5B-Diffusers", frames=121, height=704,
               width=1280),
    # Wan2.2-T2V-A14B: two experts of the 14B's shape (the low-noise one trained), 81 frames at 480 x 832
    "a14b": dict(preset="wan2.2-t2v-a14b", pipeline="/models/Wan2.2-T2V-A14B-Diffusers", frames=81, height=480,
                 width=832),
}


def low_noise_window_range(pipeline: str, num_steps: int, span: int = 10) -> list[int] | None:
    """The SDE window's range on a two-expert (A14B) folder: from its first low-noise step of the `num_steps` grid
    (the trained expert's: model_providers/wan/experts.py) over `span` steps; None when the folder is not at hand
    (a dry run plans without it) or has one transformer."""
    import json
    from pathlib import Path

    from megatron_omni.algorithms.schedule import static_shift_of, static_shift_sigmas
    from model_providers.wan.experts import read_two_experts

    root = Path(pipeline)
    if not (root / "model_index.json").is_file() or (experts := read_two_experts(root)) is None:
        return None
    shift = static_shift_of(json.loads((root / "scheduler" / "scheduler_config.json").read_text()))
    high = experts.high_noise(static_shift_sigmas(num_steps, shift)[:-1]).tolist()
    first = high.index(False) if False in high else num_steps
    if first >= num_steps - 1:
        raise ValueError(f"{pipeline}: no two low-noise steps in a {num_steps}-step grid at shift {shift}")
    return [first, min(first + span, num_steps)]


def wan_video(size: str) -> JobConfig:
    """FlowGRPO on a published Wan shape (`SIZES`) toward text legible in every frame and a steady video
    (`video_ocr+0.5*temporal_consistency` on 8 frames per clip), bf16 with full recompute. The Ulysses degree is
    the planner's (`planner.video.choose_cp`: the smallest that fits this clip at the job's world size,
    WORLD_SIZE, which torchrun and the launch script's dry run set): long clips need context parallelism."""
    import os

    from examples.qwen_image.recipe import load_prompts
    from megatron_omni.parallel.layout import LayoutError
    from megatron_omni.trainer.dry_run import planner_cp

    shape = SIZES[size]
    cfg = JobConfig(run_dir=f"runs/wan-{size}-video-ocr", steps=500, seed=42)
    cfg.model.family = "wan"
    cfg.model.preset = shape["preset"]
    cfg.model.pipeline = os.environ.get("WAN_PIPELINE") or shape["pipeline"]
    cfg.model.backend = os.environ.get("MODEL_BACKEND") or "te"
    cfg.model.params_dtype = "bf16"
    cfg.model.recompute = "full"
    cfg.prompts = load_prompts(os.environ.get("OCR_PROMPTS") or None)
    r = cfg.rollout
    r.num_frames, r.height, r.width = shape["frames"], shape["height"], shape["width"]
    r.num_steps = 20
    r.noise_level = 1.0
    r.window_size = 2
    r.window_range = [0, 10]
    r.max_sequence_length = 512  # Wan's own text length
    r.prompts_per_step = 8
    r.group_size = 8
    r.max_batch_size = 1  # one clip per rollout forward
    r.dtype = "bf16"
    cfg.reward.scorer = "video_ocr+0.5*temporal_consistency"
    cfg.reward.video_frames = 8
    cfg.reward.timeout_s = 900.0
    cfg.algorithm.clip_range = 1e-4
    o = cfg.optim
    o.lr = 1e-5
    o.mini_batches = 2
    o.micro_batch_size = 1
    cfg.checkpoint.every = 10
    cfg.logging.image_every = 10
    cfg.logging.video_format = "mp4"
    # Adam's state sharded over dp x cp (Megatron's distributed optimizer): 14B's would be 160 GiB per GPU unsharded
    o.distributed_optimizer = True
    if size == "5b":
        # Wan2.2-TI2V-5B as published: image-to-video from (image, instruction) records when I2V_RECORDS names a
        # JSONL of them (model_providers/qwen_image_edit/data.py's format; each clip's first latent frame is its
        # image), else text-to-video; true CFG at WanPipeline's default 5.0 (its default negative prompt "", the
        # UMT5 tokenizer's end-of-sequence token), which the planner counts as a second row per clip
        records = os.environ.get("I2V_RECORDS")
        if records:
            from model_providers.qwen_image_edit.data import read_edit_records

            cfg.prompts = [rec.prompt for rec in read_edit_records(records)]
        r.guidance_scale = 5.0
        r.negative_prompt = ""
    if size == "a14b":
        # the trained expert is the low-noise one: the window starts at its first step (the engine refuses earlier)
        r.window_range = low_noise_window_range(cfg.model.pipeline, r.num_steps) or r.window_range
        # Wan2.2-T2V-A14B's published guidance pair (its t2v_A14B config's `sample_guide_scale = (3.0, 4.0)`, low and
        # high noise; diffusers' WanPipeline takes them as guidance_scale_2 and guidance_scale), WanPipeline's default
        # negative prompt "": two rows per clip, which the planner's Ulysses choice below counts
        r.guidance_scale, r.guidance_scale_2, r.negative_prompt = 4.0, 3.0, ""
        # the rollout holds both experts (64 GiB in bf16 with umT5-XXL and the VAE): at tp 1 no Ulysses degree fits
        # the 81 x 480 x 832 clip in an H200 (161 GiB at 8), so the trained expert is split over tp 2
        cfg.parallel.tp = 2
    try:
        chosen = planner_cp(cfg, int(os.environ.get("WORLD_SIZE", "1")), os.environ.get("GPU_KIND") or "H200")
        cfg.parallel.ulysses = chosen.layout.ulysses
    except LayoutError:
        pass  # no Ulysses degree fits this GPU at the recipe's tp: the dry run says so, with what it tried (exit 3)
    return cfg


def wan_14b() -> JobConfig:
    """Wan2.1-T2V-14B: 81-frame 480p clips."""
    return wan_video("14b")


def wan_a14b() -> JobConfig:
    """Wan2.2-T2V-A14B (two experts; the low-noise `transformer_2` trained, the SDE window in its steps): 81-frame
    480p clips, true CFG 4.0 / 3.0 (high- / low-noise expert's steps)."""
    return wan_video("a14b")


def wan_5b() -> JobConfig:
    """Wan2.2-TI2V-5B (expanded timesteps; its 48-channel VAE compresses 4 x 16 x 16): 121-frame 720p clips,
    image-to-video from I2V_RECORDS (else text-to-video), true CFG 5.0."""
    return wan_video("5b")
