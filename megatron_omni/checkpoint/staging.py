"""All-or-nothing output folders: build into a hidden temporary folder beside the target, rename at the end.

A failed or interrupted conversion leaves nothing at the target and no temporary folder behind: the
temporary folder is removed on any exception, KeyboardInterrupt (SIGINT) included, and on SIGTERM, which
`sigterm_raises` turns into SystemExit(143) while the folder is being written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
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
def sigterm_raises() -> Iterator[None]:
    """While the block runs, SIGTERM raises SystemExit(143) (so `finally`/`except BaseException` cleanups
    run) instead of killing the process on the spot; the block then ends in SystemExit(143) even when a
    library wrapped it in an error of its own (torch DCP turns it into a CheckpointException). A handler
    someone else installed (the trainer's preemption handler) is left alone, as is everything off the main
    thread (where handlers cannot be set)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    received = []

    def _exit_on_sigterm(signum: int, frame: object) -> None:
        received.append(signum)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        yield
    except BaseException:
        if received:
            raise SystemExit(128 + received[0]) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if received:  # the handler's SystemExit landed in a finalizer, where Python prints and drops it: still exit
        raise SystemExit(128 + received[0])


@contextlib.contextmanager
def staged_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes `path`, on failure it is removed."""
    out = check_output(path)
    with sigterm_raises():
        yield from _staged(out)


def _staged(out: Path) -> Iterator[Path]:
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
