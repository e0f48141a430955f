"""Write a complete, tiny Qwen-Image-Edit pipeline folder offline, deterministically from a seed: the layout
of diffusers' `QwenImageEditPlusPipeline` (transformer, vae, text_encoder, tokenizer, processor, scheduler),
built from the tiny Qwen-Image components (`model_providers.qwen_image.tiny_pipeline`) plus a Qwen2.5-VL
processor (`processor.py`) whose image processor matches the tiny text encoder's vision tower, and an
`edit_config.json` with small resize areas (`conditioning.EditAreas`) so a source image costs a few tokens.

CLI: python tools/make_tiny_pipeline.py --family qwen_image_edit --out /tmp/tiny-edit --seed 0
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from model_providers.qwen_image.tiny_pipeline import TinyPipelineConfig, build_components, write_tiny_pipeline
from model_providers.qwen_image_edit.conditioning import EditAreas
from model_providers.qwen_image_edit.processor import build_processor, standardise_folder


@dataclass(frozen=True)
class TinyEditConfig:
    """The tiny Qwen-Image components, the areas a source is resized to and the processor's pixel bounds."""

    base: TinyPipelineConfig = field(default_factory=TinyPipelineConfig)
    # 64 x 64 sources: 32^2 px (a 4 x 4-patch image) for the VL encoder, 64^2 px (4 x 4 latent tokens) for the VAE.
    areas: EditAreas = field(default_factory=lambda: EditAreas(condition_area=56 * 56, vae_area=64 * 64))
    min_pixels: int = 28 * 28
    max_pixels: int = 128 * 128


def make_tiny_edit_pipeline(out_dir: str | os.PathLike, seed: int = 0, config: TinyEditConfig | None = None,
                            overwrite: bool = False) -> Path:
    """Write the tiny edit pipeline folder to `out_dir` (atomically; FileExistsError unless `overwrite`)."""
    from diffusers import QwenImageEditPlusPipeline

    cfg = config or TinyEditConfig()

    def build():
        parts = build_components(cfg.base, seed)
        processor = build_processor(parts["tokenizer"], cfg.min_pixels, cfg.max_pixels)
        return QwenImageEditPlusPipeline(processor=processor, **parts)

    out = write_tiny_pipeline(out_dir, build, seed, asdict(cfg), overwrite)
    try:
        standardise_folder(out)
        cfg.areas.write(out)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    return out
