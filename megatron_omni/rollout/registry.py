"""Rollout engines by name (`rollout.engine`): the trainer asks for one here and never imports a concrete
engine. Each entry names a builder `module:function` that is imported only when that engine is built, so
choosing the diffusers engine needs neither vllm nor vllm_omni.

A builder takes the diffusers pipeline folder and the engine settings and returns a `RolloutEngine`; it is
called on every rank of the job (collective: an engine may span ranks, e.g. vLLM-Omni at rollout tp > 1).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field

import torch

from megatron_omni.rollout.base import RolloutEngine
from megatron_omni.rollout.quantization import QuantizationSpec

ENGINES = {
    "diffusers": "megatron_omni.rollout.diffusers_engines.engine:build_diffusers_engine",
    "vllm_omni": "megatron_omni.rollout.vllm_omni.engine:build_vllm_omni_engine",
}


@dataclass(frozen=True)
class EngineSettings:
    """What every builder is given. tp: the engine's tensor-parallel size; dtype: what its transformer
    computes in; max_batch_size: samples per transformer forward; quantization: what its transformer runs
    quantized (`rollout.quantization` on the family's `quantized_linears`; see `rollout/quantization.py`);
    vllm_omni_process: where vLLM-Omni runs (`rollout.vllm_omni_process`); vae_dtype: what its VAE computes in."""

    tp: int = 1
    dtype: torch.dtype = torch.float32
    max_batch_size: int = 8
    quantization: QuantizationSpec = field(default_factory=QuantizationSpec)
    # vLLM-Omni only (`rollout.vllm_omni_process`): "engine" (vLLM-Omni's `Omni` with its worker processes) or
    # "inline" (its pipeline class and transformer inside the trainer's ranks).
    vllm_omni_process: str = "engine"
    # What the engine's VAE computes in; None: `dtype` (`rollout.vae_dtype`).
    vae_dtype: torch.dtype | None = None


def build_engine(name: str, pipeline_dir: str | os.PathLike, settings: EngineSettings) -> RolloutEngine:
    """The rollout engine `name` (a key of `ENGINES`) over the diffusers folder `pipeline_dir`; raises
    KeyError naming the known engines for any other name. Collective over the job's ranks."""
    if name not in ENGINES:
        raise KeyError(f"unknown rollout engine {name!r}; known: {sorted(ENGINES)}")
    module, function = ENGINES[name].split(":")
    engine = getattr(importlib.import_module(module), function)(pipeline_dir, settings)
    if not isinstance(engine, RolloutEngine):
        raise TypeError(f"{ENGINES[name]} built a {type(engine).__name__}, which is not a RolloutEngine")
    return engine
