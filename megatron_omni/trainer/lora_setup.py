"""What a LoRA run (`model.lora.rank > 0`) sets up around the DiT: the adapters on the model's parallel linears
(checked against the whole model's names over every pipeline stage), how the rollout engine receives them
(`rollout.lora_sync`), and what its checkpoints record about them (settings and the base's identity, which a
resume must match: `checkpointing.check_identity`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.checkpoint.lora import base_identity
from megatron_omni.models.lora import add_lora, unmatched_targets
from megatron_omni.trainer.config import ConfigError, LoRAConfig


def attach_lora(model: torch.nn.Module, lora: LoRAConfig, seed: int, pp_group: dist.ProcessGroup) -> list[str]:
    """Put adapters on `model`'s (this stage's) linears matching `lora.target_patterns()`, base frozen; returns
    the adapted linears' global names over the whole model (every stage's, in block order). Each adapter starts
    from its own seeded draw (`add_lora(seed=...)`), so it is the same at any layout. Raises ConfigError
    naming a pattern that matches no linear of any stage. Collective over pp."""
    patterns = lora.target_patterns()
    try:
        local = add_lora(model, patterns, lora.rank, lora.alpha, lora.dropout, seed=seed,
                         global_name=model.global_name, require_match=pp_group.size() == 1)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"model.lora.targets: {exc}") from None
    names = [model.global_name(n) for n in local]
    linears = names
    if pp_group.size() > 1:
        stages: list = [None] * pp_group.size()
        dist.all_gather_object(stages, names, group=pp_group)
        linears = [n for stage in stages for n in stage]
        unmatched = unmatched_targets(patterns, linears)
        if unmatched:
            raise ConfigError(f"model.lora.targets: {unmatched} match no tensor-parallel linear of any stage")
    return linears


def lora_sync_mode(lora_sync: str, engine: str, quantized: bool = False, vllm_omni_process: str = "engine") -> str:
    """How the engine `engine` receives adapters: `rollout.lora_sync` resolved. "auto": adapters only (r * (in + out)
    numbers per adapted linear instead of in * out) wherever the engine takes them: the diffusers engine (peft) and
    vLLM-Omni, inline (its LoRA manager and layers in the trainer's ranks) or as its engine (`vllm_omni_process`:
    the worker extension's `load_flowgrpo_lora_everywhere` over collective_rpc, every worker reporting what it
    carries); any other engine takes merged full weights. A `quantized` engine (`rollout.quantization`) always
    takes merged weights: its FP8 linears take no adapters."""
    if lora_sync != "auto":
        return lora_sync
    if quantized:
        return "merge"
    if engine in ("diffusers", "vllm_omni"):  # vllm_omni_process: both ways take adapters
        return "adapter"
    return "merge"


def lora_identity(lora: LoRAConfig, linears: list[str], pipeline_dir: str | Path,
                  group: dist.ProcessGroup | None = None,
                  identify: Callable[[str | Path], dict[str, Any]] = base_identity,
                  targets: list[str] | None = None) -> dict[str, Any]:
    """What a LoRA checkpoint records (content metadata `lora`, and the identity a resume checks): the
    settings (`targets`: the patterns the adapters went on, default `lora.target_patterns()`, the DiT's), the
    number of adapted linears and the base's identity (`identify(pipeline_dir)`: a diffusers pipeline's
    `base_identity` by default). Reads the base's files once, on the first rank of `group` (the trainer's ranks;
    None: the job), and shares the result. Collective over `group`."""
    root = 0 if group is None else dist.get_global_rank(group, 0)
    found = [identify(pipeline_dir) if dist.get_rank() == root else None]
    dist.broadcast_object_list(found, src=root, group=group)
    return {"rank": lora.rank, "alpha": lora.alpha, "dropout": lora.dropout,
            "targets": lora.target_patterns() if targets is None else list(targets),
            "modules": len(linears), "base": found[0]}
