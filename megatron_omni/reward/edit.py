"""The edit reward of the tiny editing task ("write the word W on this image"): OCR of the output's text region
plus how well the output keeps the source outside that region.

The prompt is an edit record's prompt string (`model_providers.qwen_image_edit.data.EditRecord`), whose
metadata names the word (`word`) and the region it goes in (`box`: [x0, y0, x1, y1] as fractions of the image).
Per image: `ocr` = OCR similarity of the text read in the box to the word (`reward.text.ocr_similarity`, in
[0, 1]); `keep` = 1 - mean |output - source| over the pixels outside the box (both in [0, 1], the source resized
to the output's size; by default each channel's mean difference is removed first, `centred`: the source's
structure kept, a global colour shift not counted; `blur` compares blurred images). The reward is
`ocr_weight * ocr + (1 - ocr_weight) * keep`. A record without a word or a box, or a source that no longer
decodes, is the caller's error (RewardInputError), never a reward of 0.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image

from megatron_omni.reward.errors import RewardInputError
from megatron_omni.reward.scorers import Scorer
from megatron_omni.reward.text import ocr_similarity


def text_box(metadata: dict[str, Any], width: int, height: int) -> tuple[int, int, int, int]:
    """The metadata's `box` (fractions) in pixels of a `width` x `height` image; RewardInputError when absent or
    malformed."""
    box = metadata.get("box")
    if (not isinstance(box, list | tuple) or len(box) != 4 or not all(isinstance(v, int | float) for v in box)
            or not (0 <= box[0] < box[2] <= 1 and 0 <= box[1] < box[3] <= 1)):
        raise RewardInputError(f"edit metadata 'box' must be [x0, y0, x1, y1] fractions with x0 < x1, y0 < y1, "
                               f"got {box!r}")
    return (round(box[0] * width), round(box[1] * height), round(box[2] * width), round(box[3] * height))


def keep_outside(output: Image.Image, source: Image.Image, box: tuple[int, int, int, int], blur: float = 0.0,
                 centred: bool = False) -> float:
    """1 - mean |output - source| (pixels in [0, 1]) outside `box`, the source resized to the output's size; both
    Gaussian-blurred by `blur` pixels first when > 0 (compares colour and layout, not texture); `centred`: each
    channel's mean difference removed first (the source's structure kept, a global colour shift not counted)."""
    from PIL import ImageFilter

    out_im, src_im = output.convert("RGB"), source.convert("RGB").resize(output.size, Image.BICUBIC)
    if blur > 0:
        out_im, src_im = (im.filter(ImageFilter.GaussianBlur(blur)) for im in (out_im, src_im))
    out = np.asarray(out_im, dtype=np.float32) / 255.0
    src = np.asarray(src_im, dtype=np.float32) / 255.0
    outside = np.ones(out.shape[:2], dtype=bool)
    x0, y0, x1, y1 = box
    outside[y0:y1, x0:x1] = False
    if not outside.any():
        raise RewardInputError(f"the text box {box} covers the whole image: nothing to keep")
    diff = out[outside] - src[outside]  # [P, 3]
    if centred:
        diff = diff - diff.mean(axis=0, keepdims=True)
    return float(1.0 - np.abs(diff).mean())


class EditTextScorer(Scorer):
    """`ocr_weight * ocr(box) + (1 - ocr_weight) * keep(outside box)` per image (see the module docstring);
    `reader`/`reader_kwargs` are the OCR scorer's (`reward.ocr.OcrScorer`)."""

    name = "edit_text"

    def __init__(self, ocr_weight: float = 0.5, blur: float = 0.0, centred: bool = True, reader: str = "rapidocr",
                 **reader_kwargs: Any) -> None:
        from megatron_omni.reward.ocr import build_reader

        if not 0.0 <= ocr_weight <= 1.0:
            raise RewardInputError(f"ocr_weight must be in [0, 1], got {ocr_weight}")
        self.ocr_weight = float(ocr_weight)
        self.blur = float(blur)
        self.centred = bool(centred)
        self.reader = build_reader(reader, **reader_kwargs) if ocr_weight > 0 else None

    def parts(self, images: list[Image.Image], prompts: list[str]) -> tuple[list[float], list[float]]:
        """(ocr, keep) per image."""
        from model_providers.qwen_image_edit.data import EditDataError, EditRecord

        crops, keeps = [], []
        for image, prompt in zip(images, prompts, strict=True):
            try:
                record = EditRecord.parse(prompt)
                source = record.load_image()
            except EditDataError as exc:
                raise RewardInputError(f"edit_text: {exc}") from None
            word = record.metadata.get("word")
            if not isinstance(word, str) or not word.strip():
                raise RewardInputError(f"edit_text: record metadata has no 'word' to write: {record.metadata!r}")
            box = text_box(record.metadata, *image.size)
            keeps.append(keep_outside(image, source, box, self.blur, self.centred))
            crops.append((image.crop(box), word))
        ocr = [0.0] * len(images)
        if self.reader is not None:
            reads = self.reader.read([c for c, _ in crops])
            ocr = [ocr_similarity(r, w) for r, (_, w) in zip(reads, crops, strict=True)]
        return ocr, keeps

    def score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        ocr, keep = self.parts(images, prompts)
        w = self.ocr_weight
        return [w * o + (1 - w) * k for o, k in zip(ocr, keep)]

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
