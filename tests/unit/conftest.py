"""Shared fixtures of the one-process tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_pipeline_dir(tmp_path_factory) -> str:
    """The tiny offline Qwen-Image pipeline (seed 0), built once per test module."""
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    path = tmp_path_factory.mktemp("tiny_pipeline") / "tiny"
    make_tiny_pipeline(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def groups():
    """One-rank process groups (tp = cp = pp = dp = 1) for a module whose models take them, torn down after it."""
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform

    platform.init_distributed(rank=0, world_size=1)
    yield build_parallel_groups(ParallelLayout())
    platform.destroy_distributed()
