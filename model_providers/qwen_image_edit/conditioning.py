"""How Qwen-Image-Edit (diffusers' `QwenImageEditPlusPipeline`) lays a source image into the transformer's
image stream, as data the rollout engine and the trainer share.

Each source image is resized twice, keeping its aspect ratio: to about `condition_area` pixels for the
Qwen2.5-VL text encoder (which reads image + instruction) and to about `vae_area` pixels for the VAE, whose
normalised latents, packed into 2 x 2 patches, follow the generated latent's tokens in the image stream:
`[generated | source 1 | source 2 | ...]`. `img_shapes` per row is `[(1, h, w), (1, h_1, w_1), ...]` in
patches; the transformer gives source k frame position k on the RoPE frame axis (its rows and columns
centred like the generated image's) and the text starts after the largest grid (`models.dit.embeddings.
qwen_stream_rope_angles`). The velocity of the generated tokens is the first `h * w` of the output.

diffusers' defaults are 384^2 (condition) and 1024^2 (VAE); a pipeline folder may carry an `edit_config.json`
with smaller areas (the tiny CPU pipeline does: 1024^2 source latents would be 4096 tokens).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

CONDITION_AREA = 384 * 384
VAE_AREA = 1024 * 1024
EDIT_CONFIG = "edit_config.json"


def calculate_dimensions(target_area: int, ratio: float) -> tuple[int, int]:
    """(width, height), multiples of 32, of about `target_area` pixels at aspect `ratio` = width / height
    (diffusers' `pipeline_qwenimage_edit_plus.calculate_dimensions`)."""
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


@dataclass(frozen=True)
class EditAreas:
    """The pixel areas a source image is resized to: for the text encoder and for the VAE."""

    condition_area: int = CONDITION_AREA
    vae_area: int = VAE_AREA

    def __post_init__(self) -> None:
        if self.condition_area < 32 * 32 or self.vae_area < 32 * 32:
            raise ValueError(f"edit areas must be at least 32 x 32 pixels, got {self}")

    @classmethod
    def of_folder(cls, folder: str | os.PathLike) -> EditAreas:
        """The areas of a pipeline folder: its `edit_config.json` when present, else diffusers' defaults."""
        path = Path(folder) / EDIT_CONFIG
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
            return cls(int(data["condition_area"]), int(data["vae_area"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: expected {{'condition_area': int, 'vae_area': int}} ({exc})") from None

    def write(self, folder: str | os.PathLike) -> None:
        """Record these areas in `folder`'s `edit_config.json`."""
        (Path(folder) / EDIT_CONFIG).write_text(json.dumps(vars(self), indent=2) + "\n")

    def condition_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the text encoder sees a `width` x `height` source at."""
        return calculate_dimensions(self.condition_area, width / height)

    def vae_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) the VAE encodes a `width` x `height` source at."""
        return calculate_dimensions(self.vae_area, width / height)


def condition_grid(vae_width: int, vae_height: int, vae_scale_factor: int) -> tuple[int, int, int]:
    """The (1, h, w) patch grid of a source encoded at `vae_width` x `vae_height` (2 x 2 patches of latents)."""
    return (1, vae_height // vae_scale_factor // 2, vae_width // vae_scale_factor // 2)


def img_shapes_row(grid: tuple[int, int, int], cond_grids: tuple[tuple[int, int, int], ...]) -> list:
    """One row of the transformer's `img_shapes`: the generated grid, then each source's."""
    return [tuple(grid), *(tuple(g) for g in cond_grids)]
