"""Print versions and devices, then run a one-collective smoke test on this machine's backend.

Usage: `python tools/env_check.py` (single process; it starts a 1-rank job) or under torchrun, where
every rank all-reduces its rank and checks the sum. The container runs it as its health check.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch
import torch.distributed as dist

from megatron_omni.parallel import platform

PACKAGES = ["torch", "megatron.core", "diffusers", "transformers", "safetensors", "rapidocr", "onnxruntime",
            "vllm", "vllm_omni", "transformer_engine", "apex", "wandb", "tensorboard"]


def versions() -> dict[str, str]:
    """Installed version of each package the project uses, or why it is missing."""
    out = {}
    for name in PACKAGES:
        try:
            mod = importlib.import_module(name)
            out[name] = str(getattr(mod, "__version__", "installed"))
        except Exception as exc:  # noqa: BLE001 - an optional package may fail to import in many ways
            out[name] = f"not available ({type(exc).__name__})"
    return out


def main() -> int:
    print(f"python {sys.version.split()[0]}  device={platform.device_type()}  backend={platform.backend()}")
    for name, ver in versions().items():
        print(f"  {name:20s} {ver}")
    if platform.has_gpu():
        for i in range(torch.cuda.device_count()):
            print(f"  gpu {i}: {torch.cuda.get_device_name(i)}")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511")
    platform.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank)], device=platform.device())
    dist.all_reduce(t)
    expected = world * (world - 1) / 2
    ok = float(t) == expected
    print(f"rank {rank}/{world}: all_reduce sum={float(t)} expected={expected} -> {'OK' if ok else 'FAILED'}")
    platform.destroy_distributed()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
