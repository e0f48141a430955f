"""The CPU platform's worker side (`platform.CpuOmniPlatform`): the diffusion worker class, the `mp` executor and
its worker process, and the SDPA attention backend. Imported after `plugin.install_import_shims` (vLLM-Omni's
worker module reaches vLLM's Qwen2-VL model, whose image-processor import needs torchvision otherwise)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatron_omni.rollout.vllm_omni.plugin import cpu_worker_main, install_import_shims

install_import_shims()

from vllm_omni.diffusion.attention.backends.sdpa import SDPABackend, SDPAImpl  # noqa: E402
from vllm_omni.diffusion.data import AsyncDiffusionOutput, AsyncOutputKind  # noqa: E402
from vllm_omni.diffusion.executor import multiproc_executor as _mp_executor  # noqa: E402
from vllm_omni.diffusion.ipc import pack_diffusion_output_shm  # noqa: E402
from vllm_omni.diffusion.worker import diffusion_worker as _dw  # noqa: E402


class CpuDiffusionWorker(_dw.DiffusionWorker):
    """vLLM-Omni's diffusion worker on the CPU platform. Sleep is a real state: while asleep the worker refuses
    to run a request (`execute_model` raises, naming it), and the weights stay where they are, so after
    `wake_up` they equal those before `sleep`. Releasing the memory they occupy (vLLM's CuMemAllocator pools)
    is CUDA's only: host memory has nothing to release here."""

    asleep = False

    def _maybe_get_memory_pool_context(self, tag: str) -> Any:
        return contextlib.nullcontext()  # no CuMemAllocator pools on the host (sleep mode's CUDA part)

    def sleep(self, level: int = 1) -> int:
        self.asleep = True
        return 0

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.asleep = False
        return True

    def execute_model(self, req: Any, od_config: Any, *args: Any, **kwargs: Any) -> Any:
        if self.asleep:
            raise RuntimeError(f"vLLM-Omni worker {self.rank} is asleep: call wake_up before a request")
        return super().execute_model(req, od_config, *args, **kwargs)


class CpuWorkerProc(_dw.WorkerProc):
    """vLLM-Omni's worker process with its async-output loop packing without a device stream (the original builds
    a side stream from `torch.accelerator.current_accelerator()`, None on CPU, and the thread dies before any
    output returns; the outputs are host tensors already, so the packing is the synchronous copy)."""

    def _async_output_loop(self) -> None:
        while True:
            item = self._async_output_queue.get()
            if item is None:
                break
            output, async_output_id, _event = item
            try:
                pack_diffusion_output_shm(output, d2h_stream=None)
                self._enqueue_result(AsyncDiffusionOutput(kind=AsyncOutputKind.OUTPUT_READY,
                                                          async_output_id=async_output_id, output=output))
            except Exception:
                _dw.logger.exception("Async output packing failed for id %r; sending error", async_output_id)
                self._enqueue_result(AsyncDiffusionOutput(kind=AsyncOutputKind.OUTPUT_READY,
                                                          async_output_id=async_output_id,
                                                          error="Background SHM packing failed"))
            finally:
                with self._async_output_done:
                    self._async_output_pending = max(0, self._async_output_pending - 1)
                    self._async_output_done.notify_all()


def run_worker_main(*args: Any, **kwargs: Any) -> None:
    """`WorkerProc.worker_main` in this (spawned, ours alone) worker process, building `CpuWorkerProc`."""
    _dw.WorkerProc = CpuWorkerProc
    CpuWorkerProc.worker_main(*args, **kwargs)


class _Launch:
    """Stands for `WorkerProc` while `CpuMultiprocExecutor` launches: the spawned target is ours."""

    worker_main = staticmethod(cpu_worker_main)


class CpuMultiprocExecutor(_mp_executor.MultiprocDiffusionExecutor):
    """vLLM-Omni's `mp` diffusion executor whose worker processes start through `platform.cpu_worker_main`."""

    def _launch_workers(self, broadcast_handle: Any, wake_events: list[Any]) -> Any:
        original = _mp_executor.WorkerProc
        _mp_executor.WorkerProc = _Launch
        try:
            return super()._launch_workers(broadcast_handle, wake_events)
        finally:
            _mp_executor.WorkerProc = original




class CpuSDPAImpl(SDPAImpl):
    """SDPA on CPU: `forward` is `_forward_impl` (torch's scaled_dot_product_attention); the base class dispatches
    only to GPU platforms' `forward_*`."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attn_metadata: Any = None) -> torch.Tensor:
        return self._forward_impl(query, key, value, attn_metadata)


class CpuSDPABackend(SDPABackend):
    """vLLM-Omni's TORCH_SDPA backend with `CpuSDPAImpl`."""

    @staticmethod
    def get_impl_cls() -> type:
        return CpuSDPAImpl
