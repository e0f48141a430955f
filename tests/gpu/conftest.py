"""GPU tests share a figure recorder: with GPU_CHECK_RECORD set (tools/gpu_check.sh sets it), each test's
measured figures are appended to that JSON-lines file, and tools/gpu_check_report.py prints them as one table."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest


@pytest.fixture
def record() -> Callable[..., None]:
    """record(check, **figures): keep this test's figures for the GPU check's table (no-op without the env)."""
    path = os.environ.get("GPU_CHECK_RECORD")

    def write(check: str, **figures) -> None:
        print(f"{check}: {figures}")
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({"check": check, **figures}) + "\n")

    return write
