"""Edit data records: a JSONL file with images beside it reads into records whose prompt strings round-trip,
and every kind of bad record is refused with the file and line number."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from model_providers.qwen_image_edit.data import EditDataError, EditRecord, read_edit_records


def _write(tmp_path, lines: list[str]):
    Image.new("RGB", (40, 30), (10, 200, 30)).save(tmp_path / "a.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    path = tmp_path / "edits.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"image": "a.png", "instruction": "write CAT", "metadata": {"word": "CAT"}})


def test_records_read_and_round_trip(tmp_path) -> None:
    path = _write(tmp_path, [GOOD, "", json.dumps({"image": str(tmp_path / "a.png"), "instruction": "blur it"})])
    first, second = read_edit_records(path)
    assert first.image == str((tmp_path / "a.png").resolve()) and first.metadata == {"word": "CAT"}
    assert second.metadata == {}
    assert EditRecord.parse(first.prompt) == first
    assert first.load_image().size == (40, 30)


def test_records_with_several_images_read_and_round_trip(tmp_path) -> None:
    """`images` lists several sources (QwenImageEditPlusPipeline's "Picture 1", "Picture 2"); one source keeps the
    `image` form of the prompt string."""
    path = _write(tmp_path, [json.dumps({"images": ["a.png", str(tmp_path / "a.png")], "instruction": "merge"})])
    (record,) = read_edit_records(path)
    assert record.images == (str((tmp_path / "a.png").resolve()),) * 2 and record.image == record.images[0]
    assert json.loads(record.prompt)["images"] == list(record.images)
    assert EditRecord.parse(record.prompt) == record
    assert [im.size for im in record.load_images()] == [(40, 30), (40, 30)]
    one = EditRecord(record.image, "x")
    assert one.images == (record.image,) and "images" not in json.loads(one.prompt)


@pytest.mark.parametrize("line,message", [
    ("{not json", "not a JSON object"),
    (json.dumps({"image": "missing.png", "instruction": "x"}), "is not a file"),
    (json.dumps({"image": "broken.png", "instruction": "x"}), "does not decode"),
    (json.dumps({"image": "a.png", "instruction": " "}), "'instruction' must be a non-empty string"),
    (json.dumps({"image": "a.png", "instruction": "x", "metadata": [1]}), "'metadata' must be a JSON object"),
    (json.dumps({"image": "a.png", "instruction": "x", "mask": "m.png"}), "unknown keys"),
    (json.dumps({"image": "a.png", "images": ["a.png"], "instruction": "x"}), "exactly one of 'image'"),
    (json.dumps({"images": [], "instruction": "x"}), "'images' must be a non-empty list"),
    (json.dumps({"images": ["a.png", 3], "instruction": "x"}), r"'images\[1\]' must be a non-empty string"),
    (json.dumps({"images": ["a.png", "missing.png"], "instruction": "x"}), "is not a file"),
    (json.dumps({"images": ["a.png", "broken.png"], "instruction": "x"}), "does not decode"),
])
def test_bad_records_are_refused_with_their_line(tmp_path, line: str, message: str) -> None:
    path = _write(tmp_path, [GOOD, "", line])
    with pytest.raises(EditDataError, match=rf"edits\.jsonl:3: .*{message}"):
        read_edit_records(path)


def test_a_prompt_string_needs_an_absolute_image(tmp_path) -> None:
    with pytest.raises(EditDataError, match="must be absolute"):
        EditRecord.parse(json.dumps({"image": "a.png", "instruction": "x"}))


def test_a_negative_record_is_the_record_read_with_the_negative_prompt(tmp_path) -> None:
    """What a CFG call's negative text is counted as: the record's sources with the negative prompt (blank allowed in
    a prompt string, not in a data file)."""
    from model_providers.qwen_image_edit.data import negative_record

    path = _write(tmp_path, [GOOD])
    (record,) = read_edit_records(path)
    neg = EditRecord.parse(negative_record(record.prompt, " "))
    assert neg.images == record.images and neg.instruction == " " and neg.metadata == record.metadata
