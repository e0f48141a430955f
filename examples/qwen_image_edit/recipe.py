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
