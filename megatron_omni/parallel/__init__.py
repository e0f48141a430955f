"""Parallel layouts, process groups and the device/backend platform (the only place that names them).

The names below load on first use (PEP 562): `groups` imports megatron-core (several seconds), which a process
that only needs `platform` (vLLM-Omni's spawned CPU workers, through the platform plugin) must not pay."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megatron_omni.parallel.groups import ParallelGroups, build_parallel_groups, group_rank_lists
    from megatron_omni.parallel.layout import LayoutError, ParallelLayout

_LAZY = {"ParallelGroups": "groups", "build_parallel_groups": "groups", "group_rank_lists": "groups",
         "LayoutError": "layout", "ParallelLayout": "layout"}

__all__ = ["LayoutError", "ParallelGroups", "ParallelLayout", "build_parallel_groups", "group_rank_lists"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
