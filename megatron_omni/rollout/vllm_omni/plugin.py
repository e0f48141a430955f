"""The entry points vLLM-Omni reaches before anything of its own is importable: the platform plugin
(`cpu_platform_plugin`, entry-point group `vllm_omni.platform_plugins`), the import shims, and the `mp` worker
process's entry (`cpu_worker_main`). This module imports neither vllm nor vllm_omni: vLLM-Omni calls the plugin
while its own package is still importing. See `platform` for the platform itself."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

from megatron_omni.parallel import platform as _platform

PLATFORM_CLASS = "megatron_omni.rollout.vllm_omni.platform.CpuOmniPlatform"
CPU_WORKER = "megatron_omni.rollout.vllm_omni.cpu_worker"
MP_EXECUTOR = f"{CPU_WORKER}.CpuMultiprocExecutor"
_QWEN2_VL_PROCESSOR = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_WAN_PACKAGE = "vllm_omni.diffusion.models.wan2_2"


def accelerator_present() -> bool:
    """Whether a vLLM-Omni accelerator platform (CUDA, ROCm, NPU, XPU) can be active in this process."""
    if _platform.has_gpu():
        return True
    return any(hasattr(torch, name) and getattr(torch, name).is_available() for name in ("npu", "xpu"))


def cpu_platform_plugin() -> str | None:
    """The entry point vLLM-Omni calls to choose its platform: ours where no accelerator is, else None (GPU
    machines keep vLLM-Omni's own platforms)."""
    if accelerator_present():
        return None
    install_import_shims()
    return PLATFORM_CLASS


def install_import_shims() -> None:
    """Make vLLM-Omni's engine modules importable beside the CPU torch (idempotent): transformers' Qwen2-VL image
    processor module, which imports torchvision, is served by its PIL variant (the same `smart_resize`, all
    vLLM's Qwen2-VL model takes from it), and vLLM-Omni's Wan package is entered without its `__init__`
    (`bare_wan_package`). Nothing where torchvision imports."""
    if _QWEN2_VL_PROCESSOR in sys.modules:
        return
    try:
        import torchvision  # noqa: F401
    except ImportError:
        sys.modules[_QWEN2_VL_PROCESSOR] = importlib.import_module(
            "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
        bare_wan_package()


def bare_wan_package() -> None:
    """Register vLLM-Omni's Wan2.2 package without running its `__init__` (idempotent): the `__init__` imports the
    image-to-video pipeline, which imports torchvision; its text-to-video modules (the pipeline vLLM-Omni's engine
    loads its post-processing from, the transformer) import without it. Imports nothing of vLLM-Omni itself."""
    name = _WAN_PACKAGE
    if name in sys.modules:
        return
    root = importlib.util.find_spec("vllm_omni")
    if root is None:
        return
    spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
    spec.submodule_search_locations = [str(Path(root.submodule_search_locations[0]) / "diffusion" / "models" /
                                           "wan2_2")]
    sys.modules[name] = importlib.util.module_from_spec(spec)


def release_fork_server() -> None:
    """Let this forked process's fork server exit with the process that launched it. multiprocessing hands every
    child of the server the write end of the server's "alive" pipe (the server leaves when no process holds it),
    so a worker would keep its server up after its launcher died, and the server, its parent, would keep the
    worker's death signal (SIGTERM when the parent exits, vLLM-Omni's `set_death_signal`) from ever firing: both
    outlived a killed rank (and held its stdout open) until this closed it. A worker starts no processes of its
    own through the server. No-op in a process the server did not start."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None and server.get_inherited_fds() is not None:
        os.close(server._forkserver_alive_fd)
        server._forkserver_alive_fd = None


def cpu_worker_main(environment: dict[str, str], *args: Any, **kwargs: Any) -> None:
    """The `mp` executor's worker process entry (`cpu_worker.CpuMultiprocExecutor`): the environment of the process
    that launched it (a forked worker would otherwise see its fork server's, frozen when that started), its fork
    server released (`release_fork_server`), the import shims, then vLLM-Omni's `WorkerProc.worker_main` with
    `cpu_worker.CpuWorkerProc` as its worker process class."""
    os.environ.clear()
    os.environ.update(environment)
    release_fork_server()
    install_import_shims()
    from megatron_omni.rollout.vllm_omni import cpu_worker

    cpu_worker.run_worker_main(*args, **kwargs)
