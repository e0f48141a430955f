"""The tiny editing task's data: "write the word W on this image" over small synthetic sources (plain signs of
one muted colour each), as edit records (`data.py`) whose metadata names the word and the text region the reward reads
(`reward/edit.py`). `examples/qwen_image_edit/tiny_data/` is this module's output (seed 0), shipped so a recipe
reads files like a user's data.

CLI: python -m model_providers.qwen_image_edit.tiny_task OUT_FOLDER
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
from PIL import Image

WORDS = ("CAT", "SUN", "OK", "HI")
BOX = (0.1, 0.3, 0.9, 0.7)  # where the word goes: a band across the middle (fractions of the image)


def source_image(seed: int, size: int = 64) -> Image.Image:
    """A `size` x `size` RGB source: a plain sign, one muted colour drawn from `seed` (what a random tiny decoder
    can come close to: its outputs are grey textures, so keeping a plain source means adding little texture)."""
    rng = np.random.default_rng(seed)
    colour = tuple(int(v) for v in rng.uniform(100, 160, 3))
    return Image.new("RGB", (size, size), colour)


def make_tiny_edit_data(folder: str | os.PathLike, words: tuple[str, ...] = WORDS, seed: int = 0) -> Path:
    """Write one source PNG per word and `edits.jsonl` (relative image paths) into `folder`; returns the JSONL."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, word in enumerate(words):
        name = f"source_{i}.png"
        source_image(seed * 1000 + i).save(out / name)
        lines.append(json.dumps({"image": name, "instruction": f'write "{word}" on the image',
                                 "metadata": {"word": word, "box": list(BOX)}}))
    path = out / "edits.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    print(make_tiny_edit_data(sys.argv[1]))
