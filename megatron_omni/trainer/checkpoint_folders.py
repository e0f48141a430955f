"""The layout of a run's checkpoints folder, read without megatron-core (a launch script's `--check`, the run
folder's checks before any model is built): which `checkpoints/step_XXXXXX` folders are complete (their `COMPLETE`
marker), which run wrote each (`RUN_ID`), which are intact against their manifest, the newest to resume from, the
ones to prune. Writing and reading a checkpoint's contents: `trainer.checkpointing`."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from megatron_omni.checkpoint import CheckpointError, manifest
from megatron_omni.trainer.config import ConfigError

COMPLETE = "COMPLETE"
RUN_ID = "RUN_ID"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    """The folder of the checkpoint taken after `step` RL steps."""
    return run_dir / "checkpoints" / f"step_{step:06d}"


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The complete checkpoints of a run, oldest first (temporary or half-written folders are left out)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if not p.name.endswith(".tmp") and (p / COMPLETE).is_file())


def checkpoints_to_prune(run_dir: Path, run_id: str, keep: int, final: Path) -> list[Path]:
    """The complete checkpoints of run `run_id` older than its newest `keep` (never `final`, the one just
    written); another run's checkpoints, and those without a run id, are never listed."""
    own = [p for p in complete_checkpoints(run_dir) if run_id_of(p) == run_id]
    return [p for p in own[:-keep] if p != final]


def run_id_of(folder: Path) -> str | None:
    """The run id a checkpoint records (None: written before run ids existed)."""
    path = Path(folder) / RUN_ID
    return path.read_text().strip() if path.is_file() else None


def damage(folder: Path) -> str | None:
    """Collective when torch.distributed is initialised (each rank checks its share of the files): what is
    wrong with a complete checkpoint's files against its manifest, or None when they match."""
    folder = Path(folder)
    try:
        listed = manifest.read_manifest(folder)
        if listed is None:
            problem = None
        elif dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
            manifest.verify(folder, sorted(listed)[rank::world])
            problem = None
        else:
            manifest.verify(folder)
            problem = None
    except CheckpointError as exc:
        problem = str(exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        found: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p is not None), None)
    return problem


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete and intact checkpoint of a run, or None. A damaged one (a file that no longer
    matches the manifest) is skipped with a message naming the file. Collective when torch.distributed is
    initialised (the ranks share the verification)."""
    for folder in reversed(complete_checkpoints(run_dir)):
        problem = damage(folder)
        if problem is None:
            return folder
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"skipping {problem}", flush=True)
    return None


def latest_complete(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (not verified; no collectives)."""
    done = complete_checkpoints(run_dir)
    return done[-1] if done else None


def resume_folder(resume: str | None, run_dir: Path) -> Path | None:
    """The checkpoint `checkpoint.resume` names (collective for "auto" / "auto-or-new": the ranks verify the
    candidates together), or None to start anew. Raises ConfigError for "auto" on a folder without an intact
    checkpoint."""
    if resume in ("auto", "auto-or-new"):
        folder = latest_checkpoint(run_dir)
        if folder is None and resume == "auto":
            raise ConfigError(f"--resume auto: run_dir={run_dir} holds no intact checkpoint (see above); start "
                              f"it anew with --resume auto-or-new, or choose another run_dir")
        return folder
    return Path(resume) if resume else None
