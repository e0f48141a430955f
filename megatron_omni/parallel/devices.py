"""Device strings of processes that are not trainer ranks (reward workers): light to import (no megatron-core),
and with platform.py the only place that names device types."""

from __future__ import annotations

import torch


def torch_device_of(spec: str | None) -> torch.device:
    """The torch device a worker's device string names: None or "cpu" -> the CPU, "type:index" -> that
    accelerator (the reward server hands scorers such strings). ValueError naming `spec` when torch does not know
    it or the accelerator is absent, so a scorer never silently computes on another device."""
    if spec is None or spec == "cpu":
        return torch.device("cpu")
    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"device {spec!r} is not a torch device ('cpu' or 'type:index')") from exc
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device {spec!r}: no such accelerator on this machine ({torch.cuda.device_count()} visible)")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {spec!r}: reward scorers run on the CPU or a CUDA device")
    return dev
