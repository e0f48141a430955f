"""One run per run folder: starting into a folder that holds a run is refused unless the run is resumed
(`--resume auto`) or the folder cleared (`--overwrite`); `--resume auto` on a folder without a checkpoint is
refused unless `--resume auto-or-new`. Each run has an id (config.json's `run_id`, each checkpoint's
RUN_ID) so pruning only touches the current run's checkpoints."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

from megatron_omni.trainer.checkpoint_folders import COMPLETE, latest_complete
from megatron_omni.trainer.config import ConfigError, JobConfig

# What makes a folder hold a run.
RUN_MARKERS = ("config.json", "metrics.jsonl", "checkpoints")
# Everything a run writes into its folder (what --overwrite removes; anything else there is left alone).
RUN_ARTEFACTS = RUN_MARKERS + ("eval.jsonl", "eval", "samples", "tensorboard", "wandb", "pipeline",
                               "reward_curve.png", "eval_before_after.png")
RESUME_AUTO = ("auto", "auto-or-new")


def held_run(run_dir: Path) -> list[str]:
    """The run files `run_dir` holds (empty: no run there)."""
    return [name for name in RUN_MARKERS if (run_dir / name).exists()]


def check_run_dir(cfg: JobConfig, overwrite: bool = False) -> None:
    """Before any work (every rank, read only): raise ConfigError when this start would mix two runs in
    `cfg.run_dir` or resume from nothing."""
    run_dir = Path(cfg.run_dir)
    resume = cfg.checkpoint.resume
    if overwrite and resume:
        raise ConfigError(f"--overwrite clears run_dir={run_dir}; it cannot be combined with --resume {resume}")
    if resume == "auto" and latest_complete(run_dir) is None:
        raise ConfigError(f"--resume auto: run_dir={run_dir} holds no complete checkpoint; start it anew with "
                          f"--resume auto-or-new, or choose another run_dir")
    if resume and resume not in RESUME_AUTO and not (Path(resume) / COMPLETE).is_file():
        raise ConfigError(f"--resume {resume}: not a complete checkpoint folder (no {COMPLETE} marker)")
    held = held_run(run_dir)
    if held and not resume and not overwrite:
        raise ConfigError(f"run_dir={run_dir} already holds a run ({', '.join(held)}): continue it with "
                          f"--resume auto, choose a new run_dir, or pass --overwrite to clear it")


def clear_run_dir(run_dir: Path) -> list[str]:
    """Remove what a run wrote into `run_dir` (RUN_ARTEFACTS and our hidden temporary files); other files
    are left alone. Returns the names removed."""
    removed = []
    if not run_dir.is_dir():
        return removed
    for path in sorted(run_dir.iterdir()):
        ours = path.name in RUN_ARTEFACTS or (path.name.startswith(".") and ".tmp" in path.name)
        if not ours:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    return removed


def new_run_id() -> str:
    """A fresh run id."""
    return uuid.uuid4().hex[:12]
