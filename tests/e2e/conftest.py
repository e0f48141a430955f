"""Fixtures shared by the e2e tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import _train

# The one test whose slow command starts when collection ends (its module's docstring says why).
INSTALL_PLAN_TEST = "tests/e2e/test_container_install_plan.py::test_gpu_install_plan_keeps_the_constrained_torch"


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the GPU install plan's pip resolve (niced, one process that depends on nothing else) now when its
    test was collected: it soaks up the idle core time of the tests that run before it. Under pytest-xdist
    (`make test` runs two workers) every worker collects every test: the first one here starts it, in a folder
    the worker that runs the test finds by the test run's id."""
    if any(item.nodeid == INSTALL_PLAN_TEST for item in session.items):
        from tests.e2e.test_container_install_plan import start_plan

        start_plan()


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests.e2e.test_container_install_plan import stop_plan

    # a worker that started the resolve leaves it to the other worker's test unless the run stops early
    stop_plan(session_failed=bool(session.shouldstop or session.shouldfail))


# The fault tests' run: 4 steps, checkpoints after steps 2 and 4 (all kept).
FAULT_STEPS = ["--set", "steps=4", "--set", "checkpoint.every=2", "--set", "checkpoint.keep=5"]


# LD_PRELOAD as this process started (conftest is imported before any test runs).
_STARTED_LD_PRELOAD = os.environ.get("LD_PRELOAD")


@pytest.fixture(scope="module", autouse=True)
def no_inherited_rendezvous() -> None:
    """Drop MASTER_ADDR / MASTER_PORT from this process before each e2e module: tests/distributed runs first and
    leaves them set here (the whole suite shows it, a module alone does not), and a one-rank run that inherits
    MASTER_PORT binds that port instead of a free one, so two runs a test overlaps fail with EADDRINUSE. Tests
    that need a rendezvous set their own. LD_PRELOAD too goes back to what this process started with: a test
    that configured a vLLM engine in this process had vLLM's CPU platform add tcmalloc and torch's libgomp to it,
    and every run an e2e test started afterwards inherited them (a user's shell does not set them; vLLM sets them
    in the rank that starts an engine, for its workers), and those runs could not fork from the zygote."""
    _drop_rendezvous()
    if _STARTED_LD_PRELOAD is None:
        os.environ.pop("LD_PRELOAD", None)
    else:
        os.environ["LD_PRELOAD"] = _STARTED_LD_PRELOAD


def _drop_rendezvous() -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)


@pytest.fixture(scope="session")
def first_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> Path:
    """An uninterrupted 4-step run with checkpoints after steps 2 and 4 (the reference a fault test compares
    with); one for the whole test run, never modified (tests copy it; test_faults_runs.py checks that a refused
    start leaves it untouched). Under pytest-xdist (`make test`: two workers, a module whole in one) the modules
    that read it can land in both workers: the first worker to need it builds it in the run's shared temporary
    folder under a file lock, the other waits on the lock and reads the same folder (pytest-xdist's documented
    recipe for a session fixture built once), so the suite trains it once, not once per worker."""
    _drop_rendezvous()  # a session fixture is set up before the module's autouse one
    if worker_id == "master":  # one process: its own session folder
        return _build_first_run(tmp_path_factory.mktemp("runs") / "first")
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent  # the folder of this test run that every worker's sits in
    run, built = shared / "first_run", shared / "first_run.built"  # the mark beside it: the run folder stays the run's
    with FileLock(str(shared / "first_run.lock")):
        if not built.is_file():
            shutil.rmtree(run, ignore_errors=True)  # a build that failed in the other worker
            _build_first_run(run)
            built.touch()
    return run


def _build_first_run(run: Path) -> Path:
    proc = _train(run, *FAULT_STEPS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run
