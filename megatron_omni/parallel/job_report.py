"""One line for a whole job, printed by global rank 0, before the job's process group exists (a config error every
rank finds at once).

Why a hand-off: torchrun SIGTERMs a job's other workers as soon as the first one exits. Every rank validates the
same config, so a rank 1 that finishes first and leaves would have rank 0 killed before it prints, and the user
sees torchrun's failure report without the cause. So under torchrun the other ranks wait, bounded, on a key that
rank 0 sets in torchrun's agent store (`TORCHELASTIC_USE_AGENT_STORE`: the agent hosts the job's TCPStore at
MASTER_ADDR:MASTER_PORT for the job's whole life) once its line is out. A job without that store (one process,
another launcher) has nothing that kills rank 0 early, and its other ranks leave at once.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

REPORTED_KEY = "megatron_omni/rank0_reported"


def global_rank(env: Mapping[str, str] = os.environ) -> int:
    """torchrun's global rank (RANK), else LOCAL_RANK, else 0 (a lone process)."""
    return int(env.get("RANK", env.get("LOCAL_RANK", "0")))


def _agent_store(env: Mapping[str, str], timeout_s: float) -> dist.TCPStore | None:
    """A client of torchrun's agent store, or None (no agent store in this job, or it cannot be reached)."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in env:
        return None
    import torch.distributed as dist

    try:
        return dist.TCPStore(env.get("MASTER_ADDR", "localhost"), int(env["MASTER_PORT"]), is_master=False,
                             wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError):  # the agent is gone: nobody is left to kill rank 0 early either
        return None


def report_on_rank0(line: str, *, wait_s: float = 30.0, env: Mapping[str, str] = os.environ) -> None:
    """Print `line` to stderr on global rank 0 only; on every other rank of a torchrun job, return once rank 0 has
    printed it (or after `wait_s`: a rank 0 that died never reports), so the caller's exit cannot get rank 0
    killed before its line. The key carries torchrun's run id and restart count, so a restarted job never reads
    the report of an earlier attempt."""
    key = f"{REPORTED_KEY}/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if global_rank(env) == 0:
        print(line, file=sys.stderr, flush=True)
        store = _agent_store(env, wait_s)
        if store is not None:
            try:
                store.set(key, "1")
            except RuntimeError:  # the agent went away meanwhile: the others' bounded wait ends on its own
                pass
        return
    store = _agent_store(env, wait_s)
    if store is None:
        return
    try:
        store.wait([key])
    except RuntimeError:  # timed out (the store's timeout is `wait_s`): leave without rank 0's word
        pass
