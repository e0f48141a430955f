"""Checkpoint and resume of a training run, atomically: a checkpoint is written into a temporary folder and
renamed to `step_XXXXXX` only when every rank has finished, so a half-written one is never picked up.
The last `keep` checkpoints are kept.

Each rank saves its own model shard, optimizer and scheduler state, RNG states (CPU generator, Python,
NumPy) and the step; rank 0 adds the metric history. Resume needs the same parallel layout (a layout
change goes through the checkpoint converter's Megatron distributed checkpoint instead).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of a run (temporary or incomplete folders are ignored)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / COMPLETE).exists())
    return done[-1] if done else None


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Collective: every rank passes its own `state`; returns the final folder."""
    rank = dist.get_rank()
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    part = tmp / f"rank_{rank:05d}.pt"
    torch.save(state, str(part) + ".partial")
    os.replace(str(part) + ".partial", part)
    dist.barrier()
    if rank == 0:
        (tmp / COMPLETE).write_text(f"{dist.get_world_size()}\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in sorted(p for p in final.parent.glob("step_*") if (p / COMPLETE).exists())[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(folder: Path) -> dict[str, Any]:
    """This rank's state from a complete checkpoint folder."""
    if not (folder / COMPLETE).exists():
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker)")
    world = int((folder / COMPLETE).read_text().split()[0])
    if world != dist.get_world_size():
        raise ValueError(f"checkpoint {folder} was written by {world} ranks, this job has {dist.get_world_size()}")
    return torch.load(folder / f"rank_{dist.get_rank():05d}.pt", weights_only=False)
