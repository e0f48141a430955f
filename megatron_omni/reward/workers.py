"""Scorer worker processes: one process per worker, each holding one scorer built for its device.

The server's event loop never runs a scorer: OCR and judges are CPU- or accelerator-bound and would stall
every other request. Each worker is a single-process `ProcessPoolExecutor` (spawn), so a batch goes to a
known process (the one that owns a device) and a crashed worker is replaced. Workers exit on their own
when the server process disappears (a SIGKILLed server must not leave scorers behind).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from megatron_omni.reward.errors import RewardInputError, RewardScorerError

# Result of one item: ("ok", reward) | ("ok", {"reward", "terms", "failed"}) (a weighted sum: its terms' rewards
# and the messages of its failed optional terms) | ("input_error", message) | ("error", message).
ItemResult = tuple[str, Any]
WorkItem = tuple[bytes, str, dict]  # PNG bytes, prompt, metadata

_SCORER: Any = None


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(0)
            time.sleep(0.5)

    threading.Thread(target=watch, name="reward-parent-watch", daemon=True).start()


def _build(spec: Any, kwargs: dict, device: str | None, threads: int, parent_pid: int,
           options: dict | None = None) -> dict:
    """Runs in the worker: build the scorer once (and warm it up); returns its name, and for a weighted sum its
    terms' weights and required flags."""
    global _SCORER
    _exit_with_parent(parent_pid)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:
        pass
    from megatron_omni.reward.registry import build_scorer
    from megatron_omni.reward.scorers import WeightedSum

    _SCORER = build_scorer(spec, device=device, options=options, **kwargs)
    _SCORER.warmup()
    if isinstance(_SCORER, WeightedSum):
        return {"name": _SCORER.name, "weights": dict(_SCORER.weights), "required": dict(_SCORER.required)}
    return {"name": _SCORER.name, "weights": {}, "required": {}}


def _score_batch(items: list[WorkItem]) -> list[ItemResult]:
    """Runs in the worker: decode and score a batch; one result per item, errors kept per item."""
    from megatron_omni.reward.images import decode_png

    if _SCORER is None:
        raise RewardScorerError("worker has no scorer (it was not built)")
    results: list[ItemResult | None] = [None] * len(items)
    images, prompts, metas, where = [], [], [], []
    for i, (png, prompt, meta) in enumerate(items):
        try:
            images.append(decode_png(png))
        except RewardInputError as exc:
            results[i] = ("input_error", str(exc))
            continue
        prompts.append(prompt)
        metas.append(meta)
        where.append(i)
    if where:
        try:
            for i, r in zip(where, _scored(images, prompts, metas)):
                results[i] = ("ok", r)
        except RewardInputError:
            # One bad sample must not fail its batch-mates: score one by one to attribute the error.
            for j, i in enumerate(where):
                results[i] = _score_one(images[j], prompts[j], metas[j])
        except Exception as exc:
            for i in where:
                results[i] = ("error", f"{type(exc).__name__}: {exc}")
    return results  # type: ignore[return-value]


def _scored(images: list, prompts: list[str], metas: list[dict]) -> list[Any]:
    """The scorer's rewards, or for a weighted sum {"reward", "terms", "failed"} per image."""
    from megatron_omni.reward.scorers import WeightedSum

    if not isinstance(_SCORER, WeightedSum):
        return _SCORER(images, prompts, metas)
    from megatron_omni.reward.images import to_pil_rgb
    from megatron_omni.reward.scorers import check_rewards

    pil = [to_pil_rgb(im) for im in images]
    values, failed = _SCORER.term_scores(pil, prompts, metas)
    total = check_rewards(_SCORER.name, _SCORER.combine(values, len(pil)), len(pil))
    return [{"reward": total[i], "terms": {k: v[i] for k, v in values.items()}, "failed": failed}
            for i in range(len(pil))]


def _score_one(image: Any, prompt: str, meta: dict) -> ItemResult:
    try:
        return ("ok", _scored([image], [prompt], [meta])[0])
    except RewardInputError as exc:
        return ("input_error", str(exc))
    except Exception as exc:
        return ("error", f"{type(exc).__name__}: {exc}")


class ScorerWorker:
    """One scorer process, driven from the server's event loop."""

    def __init__(self, spec: Any, kwargs: dict, *, device: str | None = None, threads: int = 1,
                 options: dict | None = None):
        self.spec, self.kwargs, self.device, self.threads = spec, dict(kwargs), device, int(threads)
        self.options = dict(options or {})
        self.name: str | None = None
        self.info: dict = {}
        self._executor: concurrent.futures.ProcessPoolExecutor | None = None

    async def start(self) -> str:
        """Spawn the process and build the scorer in it; raises what the build raised."""
        self._executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=1, mp_context=multiprocessing.get_context("spawn")
        )
        loop = asyncio.get_running_loop()
        self.info = await loop.run_in_executor(
            self._executor, _build, self.spec, self.kwargs, self.device, self.threads, os.getpid(), self.options
        )
        self.name = self.info["name"]
        return self.name

    async def score(self, items: list[WorkItem]) -> list[ItemResult]:
        """Results of `items`; a dead worker is restarted and the batch reported as failed."""
        if self._executor is None:
            raise RewardScorerError("worker not started")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor, _score_batch, items)
        except BrokenProcessPool as exc:
            self.stop()
            await self.start()
            raise RewardScorerError(f"scorer worker ({self.device or 'cpu'}) died while scoring") from exc

    def stop(self) -> None:
        """Stop the process now, without waiting for a running batch."""
        ex, self._executor = self._executor, None
        if ex is None:
            return
        # shutdown(wait=False) leaves a busy worker running; terminate it so the server exits promptly.
        procs = list(getattr(ex, "_processes", {}).values())
        ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
