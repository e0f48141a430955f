"""Parallel layouts, process groups and the device/backend platform (the only place that names them)."""

from megatron_omni.parallel.groups import ParallelGroups, build_parallel_groups, group_rank_lists
from megatron_omni.parallel.layout import LayoutError, ParallelLayout

__all__ = ["LayoutError", "ParallelGroups", "ParallelLayout", "build_parallel_groups", "group_rank_lists"]
