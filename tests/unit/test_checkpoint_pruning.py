"""`checkpoint.keep` prunes only the current run's checkpoints: its newest `keep` stay, the one just written is
never listed, another run's (or a pre-run-id) checkpoint is never touched, half-written folders are not seen."""

from __future__ import annotations

from pathlib import Path

from megatron_omni.trainer.checkpoint_folders import COMPLETE, RUN_ID, checkpoint_dir, checkpoints_to_prune


def _checkpoint(run_dir: Path, step: int, run_id: str | None, complete: bool = True) -> Path:
    folder = checkpoint_dir(run_dir, step)
    folder.mkdir(parents=True)
    if run_id is not None:
        (folder / RUN_ID).write_text(run_id + "\n")
    if complete:
        (folder / COMPLETE).write_text("")
    return folder


def test_only_the_current_runs_older_checkpoints_are_pruned(tmp_path: Path) -> None:
    old_run = [_checkpoint(tmp_path, s, "old") for s in (10, 12)]  # another run's, at later steps
    legacy = _checkpoint(tmp_path, 1, None)
    half = _checkpoint(tmp_path, 3, "new", complete=False)
    mine = [_checkpoint(tmp_path, s, "new") for s in (2, 4, 6, 8)]
    pruned = checkpoints_to_prune(tmp_path, "new", keep=2, final=mine[-1])
    assert pruned == mine[:2]
    assert not set(pruned) & {*old_run, legacy, half}
    # the checkpoint just written is never pruned, whatever keep says
    assert mine[-1] not in checkpoints_to_prune(tmp_path, "new", keep=1, final=mine[-1])
    assert checkpoints_to_prune(tmp_path, "new", keep=4, final=mine[-1]) == []
    assert checkpoints_to_prune(tmp_path, "other", keep=1, final=mine[-1]) == []
