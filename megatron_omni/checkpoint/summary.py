"""`inspect`: what a checkpoint holds (family, preset, parameters, dtypes, layout), read from metadata only."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from megatron.core import dist_checkpointing

from megatron_omni.checkpoint import manifest
from megatron_omni.checkpoint.errors import CheckpointError
from megatron_omni.checkpoint.families import family_of_config, resolve_diffusers_folder
from megatron_omni.checkpoint.safetensors_io import SafetensorsFolder
from megatron_omni.checkpoint.sharded_state import read_content_metadata
from megatron_omni.checkpoint.streaming import checkpoint_tensor_specs


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """Summary of a Megatron distributed checkpoint or a diffusers transformer/pipeline folder.

    Keys: format, family, preset ('custom' when none matches), parameters, tensors, dtypes
    ({dtype: parameters}), layout, files, bytes, and `config` (the diffusers architecture).
    """
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p} is not a folder")
    if dist_checkpointing.check_is_distributed_checkpoint(str(p)):
        manifest.verify(p)
        meta = read_content_metadata(p)
        fam = family_of_config(meta["diffusers_config"], f"{p} (content metadata)")
        specs = checkpoint_tensor_specs(p)
        numels = {k: (math.prod(s), d) for k, (s, d) in specs.items()}
        layout = meta.get("layout", {})
        return {
            "format": "megatron torch_dist",
            "family": fam.name,
            "preset": fam.preset_name(meta["diffusers_config"]) or "custom",
            "parameters": sum(n for n, _ in numels.values()),
            "tensors": len(specs),
            "dtypes": dict(_dtype_counts(numels.values())),
            "layout": "saved at " + " ".join(f"{k}={v}" for k, v in layout.items()) + " (loads at any tp/pp/cp)",
            "files": len([f for f in p.iterdir() if f.suffix == ".distcp"]),
            "bytes": _folder_bytes(p),
            "config": fam.arch_config(meta["diffusers_config"]),
        }
    src = resolve_diffusers_folder(p)
    weights = SafetensorsFolder(src.transformer_dir)
    numels = {k: (math.prod(e.shape), e.dtype) for k, e in weights.entries.items()}
    return {
        "format": "diffusers pipeline" if src.pipeline_dir is not None else "diffusers transformer",
        "family": src.family.name,
        "preset": src.family.preset_name(src.config) or "custom",
        "parameters": sum(n for n, _ in numels.values()),
        "tensors": len(numels),
        "dtypes": dict(_dtype_counts(numels.values())),
        "layout": "unsharded (full tensors, diffusers names)",
        "files": len(weights.files),
        "bytes": sum(f.stat().st_size for f in weights.files),
        "config": src.family.arch_config(src.config),
    }


def _dtype_counts(items) -> Counter:  # noqa: ANN001 - iterable of (numel, dtype)
    counts: Counter = Counter()
    for n, d in items:
        counts[str(d).removeprefix("torch.")] += n
    return counts


def format_summary(summary: dict[str, Any]) -> str:
    """Human-readable lines of `inspect_checkpoint`'s summary."""
    dtypes = ", ".join(f"{d} {n:,}" for d, n in sorted(summary["dtypes"].items()))
    lines = [
        f"format:      {summary['format']}",
        f"family:      {summary['family']}",
        f"preset:      {summary['preset']}",
        f"parameters:  {summary['parameters']:,} in {summary['tensors']} tensors",
        f"dtypes:      {dtypes}",
        f"layout:      {summary['layout']}",
        f"files:       {summary['files']} weight files, {summary['bytes'] / 2**20:.1f} MiB",
        "config:      " + ", ".join(f"{k}={v}" for k, v in summary["config"].items()),
    ]
    return "\n".join(lines)
