"""Fixtures shared by the e2e fault tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import _train

# The fault tests' run: 4 steps, checkpoints after steps 2 and 4 (all kept).
FAULT_STEPS = ["--set", "steps=4", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=5"]


@pytest.fixture(scope="session")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted 4-step run with checkpoints after steps 2 and 4 (the reference a fault test compares
    with); one for the whole session (test_faults_checkpoints.py and test_faults_runs.py each built their own, the
    same run twice), never modified (tests copy it; test_faults_runs.py checks that a refused start leaves it
    untouched)."""
    run = tmp_path_factory.mktemp("runs") / "first"
    proc = _train(run, *FAULT_STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run
