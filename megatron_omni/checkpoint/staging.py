"""All-or-nothing output folders: build into a hidden temporary folder beside the target, rename at the end.

A failed or interrupted conversion leaves nothing at the target and no temporary folder behind (the
temporary folder is removed on any exception, KeyboardInterrupt included).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from megatron_omni.checkpoint.errors import CheckpointError


def check_output(path: str | Path) -> Path:
    """Validate an output folder before any work: absent or empty, with a writable parent folder."""
    out = Path(path).absolute()
    if out.exists():
        if not out.is_dir():
            raise CheckpointError(f"output {out} exists and is not a folder")
        if any(out.iterdir()):
            raise CheckpointError(f"output folder {out} is not empty; choose a new path or empty it")
    parent = out.parent
    if not parent.exists():
        raise CheckpointError(f"cannot write {out}: parent folder {parent} does not exist")
    if not parent.is_dir():
        raise CheckpointError(f"cannot write {out}: {parent} is not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot write {out}: no write permission in {parent}")
    return out


@contextlib.contextmanager
def staged_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes `path`, on failure it is removed."""
    out = check_output(path)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as exc:
        raise CheckpointError(f"cannot write {out}: {exc}") from exc
    try:
        yield tmp
        tmp.chmod(0o755)
        if out.exists():
            out.rmdir()  # checked empty above; rmdir refuses if something appeared meanwhile
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
