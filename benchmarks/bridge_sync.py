"""Weight-sync throughput: Megatron Qwen-Image -> rollout module in-process, full and direct mode.

One process (trainer tp=1, rollout tp=1, colocated). For each mode the sync and the reference run as
interleaved pairs (sync, copy, sync, copy, ...) after a warm-up of each, so both see the same machine load:
bytes written into the rollout parameters, GB/s and peak extra memory the bridge held for one bucket are
reported at the median of the sync's times; the reference is a plain `torch` copy of the same tensors
(`dst.copy_(src)`, tensor by tensor, into preallocated buffers). The last line is, per mode, the median over
the pairs of (copy seconds / sync seconds): the sync's throughput as a share of that copy's (target >= 0.5).

    .venv/bin/python benchmarks/bridge_sync.py --preset small --rollout vllm_omni
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from megatron_omni.bridge import DiffusersTarget, VllmOmniTarget, WeightSync  # noqa: E402
from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan  # noqa: E402
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform  # noqa: E402
from megatron_omni.parallel.rank_pool import free_port  # noqa: E402
from model_providers.qwen_image import provider  # noqa: E402


def paired_seconds(fn, ref, runs: int, desc: str) -> tuple[list[float], list[float]]:
    """Seconds of `runs` interleaved pairs of calls (fn, ref) after one untimed warm-up call of each."""
    fn()  # warm-up: first-touch page faults and lazy initialisation are not steady-state cost
    ref()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in tqdm(range(runs), desc=desc, leave=False):
        for f, out in ((fn, times[0]), (ref, times[1])):
            t0 = time.perf_counter()
            f()
            out.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rollout", choices=("vllm_omni", "diffusers"), default="vllm_omni")
    ap.add_argument("--runs", type=int, default=21, help="interleaved (sync, copy) pairs per mode")
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--layers", type=int, help="override the preset's block count")
    ap.add_argument("--heads", type=int, help="override the preset's attention heads")
    ap.add_argument("--head-dim", type=int, help="override the preset's head dim")
    args = ap.parse_args()
    cfg = provider.hf_config(args.preset)
    for key, value in (("num_layers", args.layers), ("num_attention_heads", args.heads),
                       ("attention_head_dim", args.head_dim)):
        if value is not None:
            cfg[key] = value
    d = cfg["attention_head_dim"]
    if sum(cfg["axes_dims_rope"]) != d:  # RoPE axes must fill the head dim: keep the preset's proportions
        cfg["axes_dims_rope"] = (d // 4, 3 * d // 8, d - d // 4 - 3 * d // 8)

    torch.set_num_threads(1)
    platform.init_distributed(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    groups = build_parallel_groups(ParallelLayout())
    platform.seed_everything(0)
    model = provider.build_model(provider.transformer_config(cfg), groups)
    sources = megatron_sources(model)
    hf_cfg = cfg

    ctx = None
    if args.rollout == "vllm_omni":
        from megatron_omni.rollout.vllm_omni import inline

        ctx = inline.vllm_omni_parallel(1)
        od, _ = ctx.__enter__()
        module = inline.build_transformer(od, hf_cfg)
        inline.finish_loading(module)
        target = VllmOmniTarget(module, 0, 1)
    else:
        from diffusers import QwenImageTransformer2DModel

        target = DiffusersTarget(QwenImageTransformer2DModel(**hf_cfg))

    bucket_bytes = int(args.bucket_mb * 2**20)
    results = {}
    for mode in ("full", "direct"):
        plan = qwen_image_plan(cfg, trainer_tp=1, rollout_kind=args.rollout, rollout_tp=1, mode=mode)
        sync = WeightSync(plan, sources=sources, target=target, tp_group=groups.tp, bucket_bytes=bucket_bytes)
        stats = sync.sync()
        # The reference: the same tensors copied by plain torch into preallocated buffers.
        pairs = [(t, torch.empty_like(t)) for t in sources.values()]

        def plain_copy(pairs: list = pairs) -> None:
            for src, dst in pairs:
                dst.copy_(src)

        times, ref_times = paired_seconds(sync.sync, plain_copy, args.runs, f"sync {mode} / torch copy")
        sec, ref = statistics.median(times), statistics.median(ref_times)
        ref_bytes = sum(t.numel() * t.element_size() for t in sources.values())
        if ref_bytes != stats.bytes_loaded:
            raise RuntimeError(f"sync wrote {stats.bytes_loaded} bytes but the model has {ref_bytes}")
        results[mode] = (stats, sec, ref, statistics.median(r / t for t, r in zip(times, ref_times)))
        print(f"{mode:>6}: {stats.bytes_loaded / 1e6:8.1f} MB in {stats.buckets} buckets, "
              f"{sec * 1e3:7.2f} ms = {stats.bytes_loaded / sec / 1e9:6.2f} GB/s; torch copy {ref * 1e3:7.2f} ms = "
              f"{ref_bytes / ref / 1e9:6.2f} GB/s; peak extra {stats.peak_extra_bytes / 1e6:.1f} MB")
    if ctx is not None:
        ctx.__exit__(None, None, None)
    print(f"preset={args.preset} {cfg['num_layers']}x{cfg['num_attention_heads']}x{cfg['attention_head_dim']} "
          f"rollout={args.rollout} runs={args.runs} bucket={args.bucket_mb} MB")
    ratios = ", ".join(f"{m} {ratio:.2f}" for m, (_, _, _, ratio) in results.items())
    print(f"ratio of sync throughput to plain torch copy (median of {args.runs} interleaved pairs, "
          f"target >= 0.5): {ratios}")


if __name__ == "__main__":
    main()
