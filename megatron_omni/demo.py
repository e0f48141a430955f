"""`make demo`: the embedded default job on this machine.

For now: the environment check, then the tiny Qwen-Image Megatron model run at TP=2 on two spawned ranks
(gloo on CPU, NCCL on GPUs) and compared with diffusers' module on the same weights. The trainer turns
this into the CPU FlowGRPO run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

GRID = (1, 4, 6)


def _rank(rank: int, world_size: int, port: int, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from diffusers import QwenImageTransformer2DModel

    from megatron_omni.models.dit.model import DiTBatch
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
    from model_providers.qwen_image import provider

    platform.init_distributed()
    groups = build_parallel_groups(ParallelLayout(tp=world_size))
    platform.seed_everything(0, tp_rank=groups.tp.rank())
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**provider.hf_config("tiny"))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    model = provider.build_model(provider.transformer_config("tiny", tp=world_size), groups)
    provider.load_hf_state_dict(model, ref.state_dict())
    g = torch.Generator().manual_seed(1)
    cfg = provider.hf_config("tiny")
    latents = torch.randn(2, 24, cfg["in_channels"], generator=g)
    prompt = torch.randn(2, 5, cfg["joint_attention_dim"], generator=g)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    sigma = torch.tensor([0.25, 0.75])
    with torch.no_grad():
        out = model(DiTBatch(latents, prompt, mask, sigma, GRID))
        expected = ref(hidden_states=latents, encoder_hidden_states=prompt, encoder_hidden_states_mask=mask,
                       timestep=sigma, img_shapes=[[GRID]] * 2).sample
    err = float((out - expected).norm() / expected.norm())
    results.put((rank, err, sum(p.numel() for p in model.parameters())))
    platform.destroy_distributed()


def main() -> int:
    start = time.time()
    print("== environment check")
    rc = subprocess.call([sys.executable, str(Path(__file__).resolve().parents[1] / "tools" / "env_check.py")])
    if rc:
        print("environment check failed", file=sys.stderr)
        return rc
    print("\n== tiny Qwen-Image MMDiT, Megatron-Core model at TP=2 vs diffusers (same weights)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    rows = sorted(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    ok = all(p.exitcode == 0 for p in procs) and all(err < 1e-5 for _, err, _ in rows)
    for rank, err, n in rows:
        print(f"rank {rank}: {n} parameters on this rank, relative error vs diffusers {err:.2e}")
    print(f"\ndemo {'OK' if ok else 'FAILED'} in {time.time() - start:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
