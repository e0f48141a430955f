"""The tiny edit task's reward (`edit_text`, real OCR) and the edit sample panels: a word written in the band
is read, a plain output keeps its source, bad records are refused, never scored 0."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from megatron_omni.reward.errors import RewardInputError
from megatron_omni.reward.registry import build_scorer
from model_providers.qwen_image_edit.data import EditRecord
from model_providers.qwen_image_edit.panels import source_output_panels
from model_providers.qwen_image_edit.tiny_task import BOX, source_image


@pytest.fixture(scope="module")
def scorer():
    s = build_scorer("edit_text")
    yield s
    s.close()


def _record(tmp_path, word: str = "CAT", **meta) -> tuple[EditRecord, Image.Image]:
    src = source_image(0, size=128)
    src.save(tmp_path / "s.png")
    return EditRecord(str(tmp_path / "s.png"), f'write "{word}"', {"word": word, "box": list(BOX), **meta}), src


def test_written_word_scores_ocr_and_plain_output_keeps_the_source(scorer, tmp_path) -> None:
    record, src = _record(tmp_path)
    written = src.copy()
    ImageDraw.Draw(written).text((28, 44), "CAT", fill=(0, 0, 0), font=ImageFont.load_default(size=36))
    noisy = Image.effect_noise((128, 128), 60).convert("RGB")
    (ocr_w, ocr_p, ocr_n), (keep_w, keep_p, keep_n) = scorer.parts([written, src, noisy], [record.prompt] * 3)
    assert ocr_w == 1.0 and ocr_p == 0.0 and keep_w == keep_p == 1.0  # the text stays inside the band
    assert keep_n < 0.9
    assert scorer.score([written], [record.prompt], [{}]) == [1.0]


def test_records_without_word_or_box_are_refused(scorer, tmp_path) -> None:
    record, src = _record(tmp_path, box=[0.5, 0.1, 0.2, 0.9])
    with pytest.raises(RewardInputError, match="'box' must be"):
        scorer.score([src], [record.prompt], [{}])
    with pytest.raises(RewardInputError, match="edit_text"):
        scorer.score([src], ["a plain prompt"], [{}])


def test_panels_put_the_source_beside_the_output(tmp_path) -> None:
    record, src = _record(tmp_path)
    out = torch.rand(1, 3, 64, 64)
    panels, captions = source_output_panels([record.prompt], out)
    assert panels.shape == (1, 3, 64, 128) and captions == [record.instruction]
    assert torch.equal(panels[0, :, :, 64:], out[0])
    assert torch.allclose(panels[0, :, 10, 10], torch.tensor(src.getpixel((0, 0)), dtype=torch.float32) / 255)
