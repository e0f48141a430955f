"""A checkpoint folder's manifest: every file's size and CRC-32, written at save and verified before a load.

CRC-32 (zlib, streamed in 8 MiB blocks) rather than a cryptographic hash: it is there to find truncated or
damaged files (a lost write, a disk that filled, a copy cut short), not tampering, and zlib's runs at several
GB/s, so verifying costs about as much as reading the files once. The manifest (`MANIFEST.json`) is written
last, before any COMPLETE marker; a folder without one (written before manifests existed) is not verified.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

from megatron_omni.checkpoint.errors import CheckpointError

MANIFEST = "MANIFEST.json"
# Files that are not part of the content: the manifest itself and the trainer's COMPLETE marker (written after).
UNLISTED = frozenset({MANIFEST, "COMPLETE", "COMPLETE.partial"})
BLOCK = 8 << 20


def file_entry(path: Path) -> dict[str, int]:
    """{"size": bytes, "crc32": CRC-32 of the contents} of one file."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return {"size": size, "crc32": crc}


def content_files(folder: Path) -> list[str]:
    """The names (relative, '/'-separated) of every file under `folder` that the manifest lists."""
    names = []
    for root, _, files in os.walk(folder):
        for name in files:
            rel = Path(root, name).relative_to(folder).as_posix()
            if rel not in UNLISTED:
                names.append(rel)
    return sorted(names)


def entries(folder: Path, names: Iterable[str]) -> dict[str, dict[str, int]]:
    """The manifest entries of `names` (files under `folder`)."""
    return {name: file_entry(folder / name) for name in names}


def write_manifest(folder: Path, listed: dict[str, dict[str, int]] | None = None) -> None:
    """Write `folder/MANIFEST.json` (temporary name, then rename): `listed` entries as given (computed by the
    ranks that wrote those files), every other content file checksummed here."""
    folder = Path(folder)
    listed = dict(listed or {})
    rest = [n for n in content_files(folder) if n not in listed]
    listed.update(entries(folder, rest))
    tmp = folder / (MANIFEST + ".partial")
    tmp.write_text(json.dumps({"algorithm": "crc32", "files": listed}, indent=1, sort_keys=True))
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: Path) -> dict[str, dict[str, int]] | None:
    """The manifest's {file: entry}, or None when the folder has none."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"damaged checkpoint {folder}: unreadable {MANIFEST} ({exc})") from None


def verify(folder: Path, names: Iterable[str] | None = None) -> None:
    """Raise CheckpointError naming the first file of `folder` that is missing, of another size or with
    another checksum than its manifest says (only `names`, when given: a rank's share). No manifest: nothing
    to verify."""
    folder = Path(folder)
    listed = read_manifest(folder)
    if listed is None:
        return
    for name in sorted(listed) if names is None else names:
        want = listed[name]
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"damaged checkpoint {folder}: {name} is missing")
        size = path.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"damaged checkpoint {folder}: {name} has {size} bytes, {want['size']} written")
        if file_entry(path)["crc32"] != want["crc32"]:
            raise CheckpointError(f"damaged checkpoint {folder}: {name} does not match its checksum")
