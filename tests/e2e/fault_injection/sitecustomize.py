"""Filesystem faults for the fault tests' subprocesses (on PYTHONPATH only there): every `open` for writing of
a path containing $FAULT_MATCH either fails with ENOSPC ($FAULT=enospc: a full disk) or first sleeps
$FAULT_SLOW_S seconds ($FAULT=slow: a slow disk, so a signal lands mid-write). Forked writer processes
(Megatron's checkpoint writers) inherit it."""

import builtins
import errno
import io
import os
import time

_MATCH = os.environ.get("FAULT_MATCH")
_KIND = os.environ.get("FAULT")
_open = builtins.open


def _faulty_open(file, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - open's signature
    writing = any(c in mode for c in "wax+")
    if writing and isinstance(file, (str, os.PathLike)) and _MATCH in os.fspath(file):
        if _KIND == "enospc":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(file))
        if _KIND == "slow":
            time.sleep(float(os.environ.get("FAULT_SLOW_S", "0.5")))
    return _open(file, mode, *args, **kwargs)


if _MATCH and _KIND:
    builtins.open = _faulty_open
    io.open = _faulty_open
