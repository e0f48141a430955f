"""Rollout-side receivers of weights: a vLLM-Omni transformer module and a diffusers module.

A target exposes its real parameters (names and local shapes, for the coverage check and for direct
writes) and a `load_full` that takes full diffusers-named tensors and says which names it loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class RolloutTarget(Protocol):
    """What the bridge needs from a rollout engine's model on one rollout rank."""

    kind: str
    tp_rank: int
    tp_size: int

    def parameters(self) -> dict[str, torch.Tensor]:
        """Local rollout parameters by name (written in place by direct mode)."""
        ...

    def load_full(self, items: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
        """Load full diffusers-named tensors; return the names that were loaded: a diffusers name given, or the
        rollout parameter a loader reports instead (it renamed the tensor)."""
        ...


class VllmOmniTarget:
    """A vLLM-Omni transformer (Qwen-Image's, Wan2.2's) on one rollout tp rank; loads through its `load_weights`
    (names prefixed `load_prefix`)."""

    kind = "vllm_omni"

    def __init__(self, module: torch.nn.Module, tp_rank: int, tp_size: int, load_prefix: str = "transformer.") -> None:
        self.module = module
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.load_prefix = load_prefix
        self._params = {n: p.data for n, p in module.named_parameters()}

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._params

    @torch.no_grad()
    def load_full(self, items: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
        # load_weights returns the names it was given (prefix stripped) and its parameter names; a tensor it renames
        # (Wan's `scale_shift_table` -> `output_scale_shift_prepare.scale_shift_table`) comes back by its new name.
        loaded = set(self.module.load_weights((self.load_prefix + n, t) for n, t in items))
        return {n for n, _ in items if n in loaded} | {n for n in loaded if n in self._params}


class DiffusersTarget:
    """A diffusers module (not tensor-parallel); loads by copying into same-named parameters."""

    kind = "diffusers"
    tp_rank = 0
    tp_size = 1

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._params = {n: p.data for n, p in module.named_parameters()}

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._params

    @torch.no_grad()
    def load_full(self, items: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = set()
        for name, t in items:
            p = self._params.get(name)
            if p is None:
                continue  # the coverage check reports what this leaves unwritten
            if p.shape != t.shape:
                raise ValueError(f"diffusers parameter {name} has shape {tuple(p.shape)}, got {tuple(t.shape)}")
            p.copy_(t)
            loaded.add(name)
        return loaded
