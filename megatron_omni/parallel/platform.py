"""Device and communication backend choice and process start-up.

This is the only module of the project that names devices and backends for the rest of it. Everything else
asks it: `device()` for where tensors live, `backend()` for the collective backend, `init_distributed()` to
join the job. On a machine without a GPU, `init_distributed()` and `seed_everything()` first apply
`megatron_cpu_shims.apply_cpu_shims()`, which makes Megatron-Core 0.16.1 run on CPU with gloo
(docs/environment.md).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.parallel.megatron_cpu_shims import apply_cpu_shims
from megatron_omni.parallel.ports import free_port


def has_gpu() -> bool:
    """True when a CUDA device is usable."""
    return torch.cuda.is_available()


def device_type() -> str:
    """'cuda' when a GPU is usable, else 'cpu'."""
    return "cuda" if has_gpu() else "cpu"


def device() -> torch.device:
    """The device this process computes on (the local GPU under torchrun, else the CPU)."""
    if has_gpu():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    """The collective backend: nccl with GPUs, gloo on CPU."""
    return "nccl" if has_gpu() else "gloo"


@contextlib.contextmanager
def devices_for_workers(local_devices: Iterable[int]) -> Iterator[None]:
    """Inside, the processes this one starts see only this node's GPUs `local_devices` (numbered from 0 in
    them: vLLM-Omni's workers take devices 0..tp-1), so the engine a trainer rank owns runs on its rollout
    group's GPUs; the variable is restored on exit. Without GPUs nothing to choose (vLLM-Omni's CPU workers)."""
    if not has_gpu():
        yield
        return
    key = "CUDA_VISIBLE_DEVICES"
    before = os.environ.get(key)
    visible = before.split(",") if before else [str(i) for i in range(torch.cuda.device_count())]
    os.environ[key] = ",".join(visible[i] for i in local_devices)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key)
        else:
            os.environ[key] = before


def synchronize() -> None:
    """Wait for queued device work (timing); a no-op on CPU."""
    if has_gpu():
        torch.cuda.synchronize()


def max_memory_allocated() -> int:
    """Peak bytes allocated on the device since start, or 0 on CPU (use process RSS there)."""
    return torch.cuda.max_memory_allocated() if has_gpu() else 0


def init_distributed(
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Join the job's default process group (torchrun's env:// by default) on the right backend.

    On CPU, applies the Megatron-Core shims first. Safe to call when already initialised.
    """
    if not has_gpu():
        apply_cpu_shims()
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
    _ensure_global_memory_buffer()
    if dist.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    if init_method is None and world_size == 1 and "MASTER_PORT" not in os.environ:
        # A one-process job needs no agreed port: a free one, passed directly rather than through the environment,
        # so that processes this one starts later (a launched trainer, a reward server) inherit no port it holds.
        init_method = f"tcp://127.0.0.1:{free_port()}"
    elif init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        init_method = "env://"
    dist.init_process_group(
        backend=backend(),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _ensure_global_memory_buffer() -> None:
    """Megatron-Core's local attention takes scratch tensors from a process-wide buffer (not a group)."""
    from megatron.core import parallel_state

    if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
        parallel_state._set_global_memory_buffer()




def destroy_distributed() -> None:
    """Leave the job (destroys every process group)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def megatron_config_defaults() -> dict[str, Any]:
    """`TransformerConfig` settings this platform needs (CPU: CPU initialisation, no CUDA-only fusions)."""
    if has_gpu():
        return {"use_cpu_initialization": False}
    return {
        "use_cpu_initialization": True,
        "gradient_accumulation_fusion": False,
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
    }


def seed_everything(seed: int, tp_rank: int = 0) -> None:
    """Seed torch and Megatron-Core's RNG tracker (its model-parallel stream differs per tp rank).

    The tp rank is passed in (never read from Megatron's global state).
    """
    from megatron.core.tensor_parallel import random as mcore_random

    if not has_gpu():
        apply_cpu_shims()
    torch.manual_seed(seed)
    mcore_random.model_parallel_cuda_manual_seed(seed, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
