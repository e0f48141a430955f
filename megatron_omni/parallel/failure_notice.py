"""A job-wide failure notice: the rank that fails with a named cause tells every other rank, so that each prints
the same cause instead of its transport's error.

Why: a rank that leaves (exit 1, one line naming the cause) closes its gloo connections, and a rank waiting for it
in a collective then fails with gloo's "Connection closed by peer", seconds later and without the cause (a
data-parallel rank whose own vLLM-Omni engine is alive, while the other rank's worker was killed). gloo offers no
way to wake a rank blocked in a collective short of closing the connection (`ProcessGroup.abort`/`shutdown` do not
close the pairs on CPU: measured), and the job's TCPStore lives in the process of rank 0 under env:// (or in
torchrun's agent), so a notice written there is readable only while its host lives.

So: every rank of a multi-rank job starts `watch()` after joining: a daemon thread with its own client connection
to the job's TCPStore, blocked on one key. The failing rank calls `publish(line, code)` before it leaves: it writes
the line, its rank and the exit code under that key, then waits (bounded) until every other rank has read it, so a
store it hosts outlives the notice. Each watcher that sees the notice prints the same line (saying which rank
raised it) and ends its process with the same exit code at once, wherever the main thread is (a rollout, a
collective): no rank waits for its collective to fail. A job whose store is not a TCPStore (a file store) gets no
watcher and keeps the transport's error.
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import threading

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

NOTICE_KEY = "megatron_omni/failure_notice"
READ_KEY = "megatron_omni/failure_notice_read"
_published = threading.Event()  # this rank's own notice: its watcher must not act on it


def _job_store() -> dist.TCPStore | None:
    """The TCPStore under the default group's prefix stores, or None (not initialised, not a TCPStore)."""
    if not dist.is_initialized():
        return None
    store = c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


def _client(store: dist.TCPStore, timeout_s: float) -> dist.TCPStore:
    """A connection of our own to `store` (a store connection is not shared between a blocked waiter and the
    main thread's group creation)."""
    return dist.TCPStore(store.host, store.port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def publish(line: str, code: int, wait_s: float = 15.0) -> bool:
    """Tell every other rank of the job that this one fails with `line` (printed by it already) and exit `code`;
    return once all of them have read it or after `wait_s` (a rank that has left never reads). The first notice
    of a job wins (a second failing rank's is dropped: the others have left on the first). False when there is
    no notice to give (one rank, no TCPStore)."""
    store = _job_store()
    if store is None or dist.get_world_size() < 2:
        return False
    _published.set()
    try:
        client = _client(store, wait_s)
        notice = pickle.dumps((dist.get_rank(), line, code))
        if client.compare_set(NOTICE_KEY, "", notice) != notice:
            client.add(READ_KEY, 1)  # another rank's notice came first: this rank has it (it leaves on its own)
            return False
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=wait_s)
        while int(client.add(READ_KEY, 0)) < dist.get_world_size() - 1 and datetime.datetime.now() < deadline:
            threading.Event().wait(0.05)
        return True
    except Exception:  # noqa: BLE001 - the store went with its host: the others fail on the transport instead
        return False


def watch(poll_s: float = 3600.0) -> bool:
    """Start this rank's watcher (see the module docstring); False when the job has no TCPStore or one rank."""
    store = _job_store()
    if store is None or dist.get_world_size() < 2:
        return False
    rank = dist.get_rank()
    client = _client(store, poll_s)

    def run() -> None:
        while True:
            try:
                client.wait([NOTICE_KEY])
                source, line, code = pickle.loads(client.get(NOTICE_KEY))
            except Exception:  # noqa: BLE001 - a wait timed out (loop) or the store's host has left (stop)
                if dist.is_initialized() and not _published.is_set():
                    try:
                        client.check([NOTICE_KEY])
                        continue
                    except Exception:  # noqa: BLE001
                        return
                return
            if _published.is_set() or source == rank:
                return
            print(f"{line} (raised on rank {source}; rank {rank} stops with it)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            try:
                client.add(READ_KEY, 1)
            finally:
                os._exit(code)

    threading.Thread(target=run, name="failure-notice", daemon=True).start()
    return True
