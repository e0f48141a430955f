"""The AR-DiT run loop: RL steps of an `ARDiTTrainer` from the newest checkpoint (or step 0) to the last,
one JSON line of metrics per step in `out_dir/metrics.jsonl` (rank 0), checkpoints every `save_every`
steps and after the last, each carrying the metric history so a resumed run's file is the uninterrupted
run's."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megatron_omni.rollout.ar_dit_engine import ARDiTTrajectory
from megatron_omni.trainer import atomic_files
from megatron_omni.trainer.ar_dit import ARDiTTrainer

StepMetrics = Callable[[ARDiTTrajectory], dict[str, float]]


def run_ar_dit(trainer: ARDiTTrainer, steps: int, out_dir: str | os.PathLike | None = None,
               save_every: int = 0, resume: bool = False, step_metrics: StepMetrics | None = None
               ) -> list[dict[str, Any]]:
    """Train until `steps` RL steps are done; returns each step's metrics (plus `step_metrics(trajectory)`,
    e.g. a reward's parts). `save_every` > 0 checkpoints into `out_dir/checkpoints` every that many steps and
    after the last; `resume` continues from the newest complete checkpoint there (its metric history
    included), if any. Collective (every rank of `trainer.groups`)."""
    if (save_every or resume) and out_dir is None:
        raise ValueError("save_every and resume need out_dir (the checkpoints live in out_dir/checkpoints)")
    rank0 = trainer.groups.rank == 0
    history: list[dict[str, Any]] = []
    start = 0
    if resume:
        common = trainer.resume(out_dir)
        if common is not None:
            start, history = int(common["step"]), list(common["history"])
            if rank0:  # the metrics of steps after that checkpoint are about to be redone
                atomic_files.write_jsonl(Path(out_dir) / "metrics.jsonl", history)
    for step in range(start, steps):
        metrics, traj, _ = trainer.train_step(step)
        if step_metrics is not None:
            metrics.update(step_metrics(traj))
        metrics["step"] = step
        history.append(metrics)
        if out_dir is not None and rank0:
            path = Path(out_dir) / "metrics.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with path.open("a") as f:
                f.write(json.dumps(metrics) + "\n")
        if save_every and ((step + 1) % save_every == 0 or step + 1 == steps):
            trainer.save_checkpoint(out_dir, step + 1, {"history": history})
    return history
