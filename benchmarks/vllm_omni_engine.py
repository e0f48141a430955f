"""vLLM-Omni's `Omni` engine (our CPU platform plugin, our `mp` executor, one worker process: what the trainer runs
at rollout tp 1) against the embedded diffusers engine, on the tiny preset, in one process:

- rollout images/s at the same batch (same prompts, seeds and sampling params; the engine runs vLLM-Omni's
  scheduling, one request per sample), and both engines on ONE sample, whose difference is the engine's
  per-request overhead (IPC, scheduling, msgpack/shared-memory packing, its own prompt encoding per request);
- one full weight sync: bucketed `collective_rpc` into the worker (`VllmOmniRolloutEngine.load_weights`: begin,
  buckets, finish, the worker's completeness check) against the embedded engine's in-process copy.

Alternating runs, medians; the engine/diffusers images/s ratio is printed LAST.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/vllm_omni_engine.py [--runs 3] [--batch 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_omni.rollout.base import SamplingParams  # noqa: E402
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine  # noqa: E402
from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline  # noqa: E402

PROMPTS = ["OPEN 24 HOURS", "a red cat on a mat", "STOP", "hello world"]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8, help="samples per forward of the embedded engine and ours")
    parser.add_argument("--group", type=int, default=2, help="samples per prompt")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()

    from megatron_omni.rollout.vllm_omni.engine import VllmOmniRolloutEngine, executor_backend
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims

    install_import_shims()
    params = SamplingParams(height=args.size, width=args.size, num_steps=args.steps, noise_level=1.2, window_size=2)
    n = len(PROMPTS) * args.group
    seeds = list(range(n))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_pipeline(Path(tmp) / "pipe", seed=0)
        start = time.perf_counter()
        engine = VllmOmniRolloutEngine(folder, tensor_parallel_size=1, dtype="float32", enable_sleep_mode=True,
                                       distributed_executor_backend=executor_backend(), max_batch_size=args.batch)
        startup = time.perf_counter() - start
        ref = DiffusersRolloutEngine(folder, max_batch_size=args.batch)
        state = {k: v.detach().clone() for k, v in ref.transformer.state_dict().items()}
        size_mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
        try:
            for e in (engine, ref):  # warm-up
                e.generate(PROMPTS, params, group_size=args.group, seeds=seeds)
            t = {"engine": [], "diffusers": [], "engine_1": [], "diffusers_1": [], "sync_rpc": [], "sync_copy": []}
            for _ in range(args.runs):
                t["engine"].append(_timed(lambda: engine.generate(PROMPTS, params, group_size=args.group, seeds=seeds)))
                t["diffusers"].append(_timed(lambda: ref.generate(PROMPTS, params, group_size=args.group, seeds=seeds)))
                t["engine_1"].append(_timed(lambda: engine.generate(PROMPTS[:1], params, seeds=[0])))
                t["diffusers_1"].append(_timed(lambda: ref.generate(PROMPTS[:1], params, seeds=[0])))
                t["sync_rpc"].append(_timed(lambda: engine.load_weights(state.items())))
                t["sync_copy"].append(_timed(lambda: ref.load_weights(state.items())))
        finally:
            engine.close()
    med = {k: statistics.median(v) for k, v in t.items()}
    print(f"tiny preset, {n} samples ({len(PROMPTS)} prompts x {args.group}), {args.size}px, {args.steps} steps, "
          f"batch {args.batch}, {torch.get_num_threads()} threads, {args.runs} runs (medians)")
    print(f"engine start-up (imports, worker process, load, warm-up request): {startup:.1f} s")
    for k in ("engine", "diffusers"):
        print(f"rollout {k:10s} {n} samples {med[k]:7.3f} s  {n / med[k]:7.2f} images/s")
    for k in ("engine_1", "diffusers_1"):
        print(f"rollout {k:10s} 1 sample  {med[k]:7.3f} s")
    overhead = (med["engine_1"] - med["diffusers_1"]) * 1e3
    print(f"engine per-request overhead (one sample, engine - embedded): {overhead:.1f} ms; engine time per "
          f"sample at {n} requests: {med['engine'] / n * 1e3:.1f} ms vs one request "
          f"{med['engine_1'] * 1e3:.1f} ms (how much the engine batches its requests)")
    print(f"weight sync ({size_mb:.2f} MiB): RPC buckets {med['sync_rpc'] * 1e3:.1f} ms, in-process copy "
          f"{med['sync_copy'] * 1e3:.1f} ms, ratio {med['sync_rpc'] / med['sync_copy']:.1f}x")
    print(f"engine/diffusers images/s ratio: {med['diffusers'] / med['engine']:.3f}")


if __name__ == "__main__":
    main()
