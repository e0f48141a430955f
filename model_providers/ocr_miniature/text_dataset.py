"""The synthetic text-rendering dataset of the OCR miniature: short words drawn with an installed font.

Each sample is one word from a fixed vocabulary, drawn in DejaVu Sans Bold on a plain background with a
random position, size and colour pair (dark text on a light background: the contrast the OCR reader
needs). Sizes keep the cap height at 9-13 px on a 64 px image, above the ~5 px the reader resolves. The
prompt names the word in quotes, so the OCR reward reads its target from the prompt. Everything is drawn
from a `numpy.random.Generator`, so a seed reproduces a dataset exactly. A `TextLayout` narrows the
variety (how far from the centre, which sizes, fixed colours): how much varies decides how fast a tiny
model learns to write (measured in docs/recipes.md).
"""

from __future__ import annotations

from dataclasses import dataclass
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
# Words neither pretraining nor RL ever shows, written only with glyphs the RL words contain (`glyphs`): the
# held-out evaluation's unseen words, which RL can move through what it teaches about those glyphs. The
# HELD_OUT_WORDS (OK, HI and numbers: digits no RL word has) are reported apart, as transfer.
UNSEEN_WORDS: tuple[str, ...] = ("BAT", "SEA", "CUP", "FAN", "HEN", "JET", "LOG", "PIG")


def glyphs(words: tuple[str, ...] | list[str]) -> set[str]:
    """The characters the words are written with."""
    return {c for w in words for c in w}

FONT_SIZES = (13, 14, 15, 16, 17)  # DejaVu Sans Bold cap height is ~0.73 em: 9.5-12.4 px
MARGIN = 3


@dataclass(frozen=True)
class TextLayout:
    """How much the rendering varies. The default is the dataset the shipped pipeline learned (anywhere inside
    the margin, one of FONT_SIZES, a random colour pair); narrower layouts trade variety for learning speed.

    max_offset: None (anywhere inside the margin) or the most pixels the word's box moves from the centre,
    per axis (0: centred; kept inside the margin); offset_step: offsets are multiples of it (8: whole 8 px
    patches of the miniature's 64 image tokens, so a word's patches are the same wherever it lands);
    font_sizes: the sizes drawn from (those at which the word fits); colours: "random" (light background,
    dark ink) or "fixed" (black on white)."""

    max_offset: int | None = None
    font_sizes: tuple[int, ...] = FONT_SIZES
    colours: str = "random"
    offset_step: int = 1

    def __post_init__(self) -> None:
        if self.max_offset is not None and self.max_offset < 0:
            raise ValueError(f"TextLayout.max_offset must be None (anywhere) or >= 0 px, not {self.max_offset!r}")
        if self.offset_step < 1:
            raise ValueError(f"TextLayout.offset_step must be >= 1 px, not {self.offset_step!r}")
        if self.colours not in ("random", "fixed"):
            raise ValueError(f"TextLayout.colours must be 'random' or 'fixed', not {self.colours!r}")
        if not self.font_sizes or any(s < 8 for s in self.font_sizes):
            raise ValueError(f"TextLayout.font_sizes must be non-empty and >= 8 px (cap height >= ~5.8 px, the "
                             f"least the OCR reader resolves), not {self.font_sizes!r}")


VARIED = TextLayout()


def prompt_for(word: str) -> str:
    """The prompt that asks for `word` (the OCR reward's target is the quoted span)."""
    return f'text "{word}"'


@cache
def _font(size: int) -> ImageFont.FreeTypeFont:
    if not FONT_PATH.exists():
        raise FileNotFoundError(f"{FONT_PATH} is missing: install the Debian package fonts-dejavu-core")
    return ImageFont.truetype(str(FONT_PATH), size)


@cache
def _bbox(word: str, font_size: int) -> tuple[int, int, int, int]:
    """`word`'s ink box (left, top, right, bottom) at `font_size`: a dataset renders each word thousands of times."""
    return _font(font_size).getbbox(word)


def render_word(word: str, rng: np.random.Generator, size: int = 64, layout: TextLayout = VARIED) -> Image.Image:
    """`word` drawn at a size, position and colour pair drawn as `layout` says on a `size` x `size` RGB image.

    A size that would not fit (long words at big sizes) is not drawn from; a word that fits at none raises."""
    sizes = [s for s in layout.font_sizes if _bbox(word, s)[2] - _bbox(word, s)[0] <= size - 2 * MARGIN]
    if not sizes:
        raise ValueError(f"{word!r} does not fit a {size} px image at font sizes {layout.font_sizes}")
    font_size = sizes[int(rng.integers(len(sizes)))]
    font = _font(font_size)
    left, top, right, bottom = _bbox(word, font_size)
    w, h = right - left, bottom - top
    if layout.max_offset is None:
        x = int(rng.integers(MARGIN, size - MARGIN - w + 1)) - left
        y = int(rng.integers(MARGIN, size - MARGIN - h + 1)) - top
    else:
        k, step = layout.max_offset // layout.offset_step, layout.offset_step
        dx, dy = (step * int(v) for v in rng.integers(-k, k + 1, size=2)) if k else (0, 0)
        x = min(max((size - w) // 2 + dx, MARGIN), size - MARGIN - w) - left
        y = min(max((size - h) // 2 + dy, MARGIN), size - MARGIN - h) - top
    if layout.colours == "random":
        background = tuple(int(v) for v in rng.integers(190, 256, size=3))
        ink = tuple(int(v) for v in rng.integers(0, 90, size=3))
    else:
        background, ink = (255, 255, 255), (0, 0, 0)
    image = Image.new("RGB", (size, size), background)
    ImageDraw.Draw(image).text((x, y), word, font=font, fill=ink)
    return image


def render_dataset(words: tuple[str, ...] | list[str], count: int, seed: int, size: int = 64,
                   layout: TextLayout = VARIED) -> tuple[list[Image.Image], list[str]]:
    """`count` images cycling through `words` (each word equally often) and their words, from `seed`."""
    rng = np.random.default_rng(seed)
    chosen = [words[i % len(words)] for i in range(count)]
    return [render_word(w, rng, size, layout) for w in chosen], chosen


def images_to_tensor(images: list[Image.Image]) -> np.ndarray:
    """[N, 3, H, W] float32 in [-1, 1] (the VAE's input range)."""
    arr = np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) for im in images])
    return arr.transpose(0, 3, 1, 2) / 127.5 - 1.0
