"""The synthetic text-rendering dataset of the OCR miniature: short words drawn with an installed font.

Each sample is one word from a fixed vocabulary, drawn in DejaVu Sans Bold on a plain background with a
random position, size and colour pair (dark text on a light background: the contrast the OCR reader
needs). Sizes keep the cap height at 9-13 px on a 64 px image, above the ~5 px the reader resolves. The
prompt names the word in quotes, so the OCR reward reads its target from the prompt. Everything is drawn
from a `numpy.random.Generator`, so a seed reproduces a dataset exactly.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

FONT_PATH = Path("/usr/share/fonts/truetype/dejavu/DejaVuSans-Bold.ttf")

# Pretraining words: upper-case words and numbers of 2-4 characters.
VOCABULARY: tuple[str, ...] = (
    "CAT", "DOG", "SUN", "SKY", "RED", "BOX", "CAR", "MAP", "FOX", "OWL", "ICE", "KEY", "PEN", "TOP", "VAN",
    "HAT", "BUS", "EGG", "ART", "JAM", "YES", "NO", "GO", "UP", "OK", "HI", "42", "77", "123", "365", "808",
    "2024",
)
# RL trains on these; evaluation also holds out the rest (seen in pretraining, never in RL prompts).
RL_WORDS: tuple[str, ...] = VOCABULARY[:24]
HELD_OUT_WORDS: tuple[str, ...] = VOCABULARY[24:]

FONT_SIZES = (13, 14, 15, 16, 17)  # DejaVu Sans Bold cap height is ~0.73 em: 9.5-12.4 px
MARGIN = 3


def prompt_for(word: str) -> str:
    """The prompt that asks for `word` (the OCR reward's target is the quoted span)."""
    return f'text "{word}"'


@cache
def _font(size: int) -> ImageFont.FreeTypeFont:
    if not FONT_PATH.exists():
        raise FileNotFoundError(f"{FONT_PATH} is missing: install the Debian package fonts-dejavu-core")
    return ImageFont.truetype(str(FONT_PATH), size)


def render_word(word: str, rng: np.random.Generator, size: int = 64) -> Image.Image:
    """`word` drawn at a random size, position and colour pair on a `size` x `size` RGB image.

    The largest font that fits is used when the drawn size would not fit (long words at big sizes)."""
    sizes = [s for s in FONT_SIZES if _font(s).getbbox(word)[2] - _font(s).getbbox(word)[0] <= size - 2 * MARGIN]
    if not sizes:
        raise ValueError(f"{word!r} does not fit a {size} px image at the smallest font size {FONT_SIZES[0]}")
    font = _font(sizes[int(rng.integers(len(sizes)))])
    left, top, right, bottom = font.getbbox(word)
    w, h = right - left, bottom - top
    x = int(rng.integers(MARGIN, size - MARGIN - w + 1)) - left
    y = int(rng.integers(MARGIN, size - MARGIN - h + 1)) - top
    background = tuple(int(v) for v in rng.integers(190, 256, size=3))
    ink = tuple(int(v) for v in rng.integers(0, 90, size=3))
    image = Image.new("RGB", (size, size), background)
    ImageDraw.Draw(image).text((x, y), word, font=font, fill=ink)
    return image


def render_dataset(words: tuple[str, ...] | list[str], count: int, seed: int,
                   size: int = 64) -> tuple[list[Image.Image], list[str]]:
    """`count` images cycling through `words` (each word equally often) and their words, from `seed`."""
    rng = np.random.default_rng(seed)
    chosen = [words[i % len(words)] for i in range(count)]
    return [render_word(w, rng, size) for w in chosen], chosen


def images_to_tensor(images: list[Image.Image]) -> np.ndarray:
    """[N, 3, H, W] float32 in [-1, 1] (the VAE's input range)."""
    arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) for im in images])
    return arr.transpose(0, 3, 1, 2) / 127.5 - 1.0
