"""A command's `main` called in the pytest process instead of a new interpreter (an interpreter start with
megatron-core, diffusers and transformers is seconds of the suite's budget per call): its output captured, its
environment swapped in for the call, an escaping exception printed and counted as the interpreter would."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import subprocess
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType


def script_module(path: str | os.PathLike, name: str | None = None) -> ModuleType:
    """The script at `path` (e.g. tools/checkpoint/convert.py) imported as a module (its `main` not called)."""
    spec = importlib.util.spec_from_file_location(name or Path(path).stem + "_cli", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_main(main: Callable[[list[str]], int | None], argv: Sequence[str], env: Mapping[str, str] | None = None,
              args: Sequence[str] | None = None) -> subprocess.CompletedProcess:
    """`main(argv)` in this process, as `python PROG ARGV` would run it: stdout and stderr captured, the process
    environment exactly `env` meanwhile (None: unchanged), argparse's SystemExit its status, any other exception a
    traceback on stderr and status 1. `args`: the command line recorded in the result (default `argv`)."""
    saved = dict(os.environ)
    out, err = io.StringIO(), io.StringIO()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(list(argv))
            except SystemExit as exc:  # argparse
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:  # noqa: BLE001 - what the interpreter would print
                traceback.print_exc()
                rc = 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(list(args if args is not None else argv), 0 if rc is None else rc,
                                       out.getvalue(), err.getvalue())
