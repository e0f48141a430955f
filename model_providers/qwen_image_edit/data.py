"""Edit data: (source image, instruction, metadata) records, read from a JSONL file with the images beside it.

One record per line: `{"image": "<path>", "instruction": "<text>", "metadata": {...}}` (metadata optional, a JSON
object: what a reward reads, e.g. the word to write), or with several source images `{"images": ["<path>", ...],
...}` (one of the two keys; `QwenImageEditPlusPipeline` reads them as "Picture 1", "Picture 2", ... and appends
their latents to the image stream in that order; the first is the image being edited, the one a reward compares
the output with). A relative image path is relative to the JSONL file's folder. Every record is checked when the
file is read, and a bad one is refused with its line number: not JSON, a missing or empty field, an image path
that is not a file, an image that does not decode.

Through the trainer a record travels as its prompt string (`EditRecord.prompt`: canonical JSON with the image's
absolute path), so the prompt lists, the rollout engines' `generate(prompts)`, the reward requests and the run
folder's sample records carry it unchanged; `EditRecord.parse` reads it back where the image is needed (the
edit engine, an edit reward).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class EditDataError(ValueError):
    """A record of an edit data file (or an edit prompt string) that cannot be used, named by where it is."""


@dataclass(frozen=True)
class EditRecord:
    """One edit: the source images' absolute paths (a path or a sequence of them; kept as a tuple), the
    instruction and free-form metadata."""

    images: tuple[str, ...] | str
    instruction: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        images = (self.images,) if isinstance(self.images, str) else tuple(self.images)
        if not images:
            raise EditDataError("an edit record needs at least one source image")
        object.__setattr__(self, "images", images)

    @property
    def image(self) -> str:
        """The first source image's path (the image being edited)."""
        return self.images[0]

    @property
    def prompt(self) -> str:
        """The record as the trainer's prompt string (canonical JSON; `parse` inverts it). One source is written
        as `image`, several as `images`."""
        src = {"image": self.images[0]} if len(self.images) == 1 else {"images": list(self.images)}
        return json.dumps(src | {"instruction": self.instruction, "metadata": self.metadata},
                          sort_keys=True, ensure_ascii=False, separators=(",", ":"))

    @classmethod
    def parse(cls, prompt: str) -> EditRecord:
        """The record of a prompt string made by `prompt`; EditDataError when it is not one. Its instruction may
        be blank (a `negative_record`'s: the negative prompt " " or ""); a data file's may not."""
        return _record(prompt, "edit prompt", base=None, blank_instruction=True)

    def with_instruction(self, instruction: str) -> EditRecord:
        """This record's sources and metadata with another instruction (a negative prompt is encoded with the
        record's sources as its instruction would be: `negative_record`)."""
        return EditRecord(self.images, instruction, self.metadata)

    def load_image(self):
        """The first source image as an RGB PIL image (EditDataError naming the file when it no longer decodes)."""
        return _decode(Path(self.image), "edit prompt")

    def load_images(self) -> list:
        """Every source image as an RGB PIL image, in the record's order."""
        return [_decode(Path(p), "edit prompt") for p in self.images]


def negative_record(prompt: str, negative_prompt: str) -> str:
    """The prompt string whose text embedding is the edit record `prompt`'s negative: the same sources read with
    `negative_prompt` as the instruction (what the trainer counts a CFG call's negative text length with)."""
    return EditRecord.parse(prompt).with_instruction(negative_prompt).prompt


def _decode(path: Path, where: str):
    from PIL import Image, UnidentifiedImageError

    if not path.is_file():
        raise EditDataError(f"{where}: image {str(path)!r} is not a file")
    try:
        with Image.open(path) as im:
            im.load()
            return im.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise EditDataError(f"{where}: image {str(path)!r} does not decode ({exc})") from None


def _record(line: str, where: str, base: Path | None, blank_instruction: bool = False) -> EditRecord:
    try:
        data = json.loads(line)
    except json.JSONDecodeError as exc:
        raise EditDataError(f"{where}: not a JSON object ({exc.msg} at column {exc.colno})") from None
    if not isinstance(data, dict):
        raise EditDataError(f"{where}: not a JSON object")
    unknown = set(data) - {"image", "images", "instruction", "metadata"}
    if unknown:
        raise EditDataError(f"{where}: unknown keys {sorted(unknown)} (expected image or images, instruction, "
                            "metadata)")
    if ("image" in data) == ("images" in data):
        raise EditDataError(f"{where}: give exactly one of 'image' (a path) and 'images' (a list of paths)")
    if "images" in data:
        paths = data["images"]
        if not isinstance(paths, list) or not paths:
            raise EditDataError(f"{where}: 'images' must be a non-empty list of paths, got {paths!r}")
    else:
        paths = [data["image"]]
    if not isinstance(data.get("instruction"), str) or not (blank_instruction or data["instruction"].strip()):
        raise EditDataError(f"{where}: 'instruction' must be a non-empty string, got {data.get('instruction')!r}")
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict):
        raise EditDataError(f"{where}: 'metadata' must be a JSON object, got {metadata!r}")
    resolved = []
    for i, item in enumerate(paths):
        key = "image" if "image" in data else f"images[{i}]"
        if not isinstance(item, str) or not item.strip():
            raise EditDataError(f"{where}: {key!r} must be a non-empty string, got {item!r}")
        path = Path(item)
        if base is not None and not path.is_absolute():
            path = base / path
        elif not path.is_absolute():
            raise EditDataError(f"{where}: image path {item!r} must be absolute in a prompt string")
        resolved.append(str(path.resolve()))
    return EditRecord(images=tuple(resolved), instruction=data["instruction"], metadata=metadata)


def read_edit_records(path: str | os.PathLike, decode: bool = True) -> list[EditRecord]:
    """The records of a JSONL file (blank lines skipped); each image is decoded once to refuse broken files
    up front (`decode=False` only checks that it is a file). Raises EditDataError naming the file and line."""
    p = Path(path)
    if not p.is_file():
        raise EditDataError(f"{str(path)!r} is not a file")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise EditDataError(f"{str(path)!r} is not UTF-8 (byte offset {exc.start})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{p}:{number}"
        record = _record(line, where, base=p.parent)
        for image in record.images:
            if decode:
                _decode(Path(image), where)
            elif not Path(image).is_file():
                raise EditDataError(f"{where}: image {image!r} is not a file")
        records.append(record)
    if not records:
        raise EditDataError(f"{str(path)!r} has no records")
    return records
