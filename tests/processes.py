"""Process checks the tests share: whether a pid still runs, and a process's multiprocessing fork servers."""

from __future__ import annotations

from pathlib import Path

import psutil


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie, exited but not yet reaped, is not alive)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return status != "Z"


def fork_servers(pid: int) -> list[int]:
    """The pids of the multiprocessing fork servers among `pid`'s children (a child that exited and was not reaped
    yet, or is gone by the time its command line is read, is none of them)."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if "multiprocessing.forkserver" in " ".join(child.cmdline()):
                found.append(child.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue
    return found
