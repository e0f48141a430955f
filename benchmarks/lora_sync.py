"""LoRA: an adapter-only sync against a full weight sync into each rollout engine, and the optimizer state LoRA
keeps against full fine-tuning, side by side in one process.

One rank (trainer tp=1), the `small` preset in bf16 (as production: bf16 parameters, fp32 main parameters
and Adam state). Per engine, the full sync is the bridge's weight sync in the mode the trainer uses at this
layout (`sync_mode`: `direct`, each parameter copied in place; the gathering `full` mode is timed too), the
adapter-only sync is what a LoRA run does after each step (`LoRAAdapterSync`: the engine's in-place copy and
the proof that exactly the trained modules carry the adapter and every key was written):

- diffusers: a diffusers `QwenImageTransformer2DModel`, adapters through peft (`load_lora_into`);
- vllm_omni: vLLM-Omni's real `QwenImageTransformer2DModel` on CPU, adapters through its LoRA manager and
  LoRA layers (`VllmOmniLoRAReceiver`, registered through its LoRA request path by the first, untimed, sync).

The full sync in the trainer's mode and the adapter sync of one engine are timed interleaved (full, adapter, full,
...; the gathering mode is timed on its own after): times are medians, and the ratio is the median over runs of
each adapter sync's time over the full sync's timed just before it (a paired ratio is steady on a shared machine
where the medians of either side drift).
Optimizer state: Megatron-Core's optimizer built over the full model and over the LoRA model, one step each,
bytes counted by storage (`allocated_bytes`). The last line is adapter-sync time / full-sync time, the larger
of the two engines' (target <= 0.1).

    .venv/bin/python benchmarks/lora_sync.py --preset small --rank 8
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
from megatron_omni.bridge.family_sync import sync_mode  # noqa: E402
from megatron_omni.bridge.lora_sync import LoRAAdapterSync  # noqa: E402
from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan  # noqa: E402
from megatron_omni.models.lora import add_lora  # noqa: E402
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform  # noqa: E402
from megatron_omni.parallel.rank_pool import free_port  # noqa: E402
from megatron_omni.rollout.lora_receiver import load_lora_into  # noqa: E402
from megatron_omni.trainer.config import LORA_TARGETS  # noqa: E402
from megatron_omni.trainer.training_state import OptimizerSettings, allocated_bytes, build_ddp_and_optimizer  # noqa: E402
from model_providers import get_family  # noqa: E402
from model_providers.qwen_image import provider  # noqa: E402


def _optimizer_bytes(model: torch.nn.Module, mcfg, groups) -> int:
    """Optimizer state bytes after one (zero-gradient) step of Megatron-Core's Adam over `model`."""
    ddp, opt = build_ddp_and_optimizer(model, mcfg, groups.mcore, OptimizerSettings(lr=1e-4))
    ddp.zero_grad_buffer()
    opt.zero_grad()
    opt.step()
    return allocated_bytes(ddp, opt)["optimizer_states"]


class _DiffusersEngine:
    """The one method of the diffusers engine the adapter sync calls, over a bare diffusers transformer."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer

    def load_lora(self, state, rank, alpha):
        return load_lora_into(self.transformer, state, rank, alpha, torch.bfloat16)


class _Worker:
    """vLLM-Omni's engine side as the adapter sync calls it: the worker extension's `load_flowgrpo_lora`."""

    def __init__(self, worker) -> None:
        self.worker = worker

    def load_lora(self, state, rank, alpha):
        return self.worker.load_flowgrpo_lora(state, rank, alpha)


class _VllmPipeline(torch.nn.Module):
    """What vLLM-Omni's LoRA manager and our receiver read of a pipeline: its transformer, device, config."""

    def __init__(self, transformer: torch.nn.Module, od_config) -> None:
        super().__init__()
        self.transformer = transformer
        self.od_config = od_config
        self.device = next(transformer.parameters()).device


def _interleaved_runs(fns: dict, runs: int, desc: str) -> dict[str, list[float]]:
    """Seconds of each function of `fns`, called in turn `runs` times after one untimed round (so the i-th times of
    all functions were taken side by side)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in tqdm(range(runs), desc=desc, leave=False):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (8 on small's hidden 256 ~ 64 on 20B's 3072)")
    ap.add_argument("--runs", type=int, default=41)
    ap.add_argument("--engines", nargs="+", default=["diffusers", "vllm_omni"], choices=["diffusers", "vllm_omni"])
    ap.add_argument("--heads", type=int, help="override the preset's attention heads")
    ap.add_argument("--head-dim", type=int, help="override the preset's head dim")
    args = ap.parse_args()
    from diffusers import QwenImageTransformer2DModel

    torch.set_num_threads(1)
    platform.init_distributed(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}")
    groups = build_parallel_groups(ParallelLayout())
    platform.seed_everything(0)
    cfg = provider.hf_config(args.preset)
    for key, value in (("num_attention_heads", args.heads), ("attention_head_dim", args.head_dim)):
        if value is not None:
            cfg[key] = value
    d = cfg["attention_head_dim"]
    if sum(cfg["axes_dims_rope"]) != d:  # RoPE axes must fill the head dim: keep the preset's proportions
        cfg["axes_dims_rope"] = (d // 4, 3 * d // 8, d - d // 4 - 3 * d // 8)
    mcfg = provider.transformer_config(cfg, params_dtype=torch.bfloat16)
    full_model = provider.build_model(mcfg, groups)
    lora_model = provider.build_model(mcfg, groups)
    alpha = 2.0 * args.rank
    linears = [lora_model.global_name(n) for n in add_lora(lora_model, LORA_TARGETS, args.rank, alpha, seed=0,
                                                            global_name=lora_model.global_name)]
    with torch.no_grad():  # trained adapters: B no longer zero
        for p in lora_model.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.02)
    family = get_family("qwen_image")
    mode = sync_mode(1, 1, 1)

    def engines():
        """(engine, the full sync's target, the adapter sync's engine) per engine, each in a fresh module."""
        for engine in args.engines:
            if engine == "diffusers":
                yield (engine, DiffusersTarget(QwenImageTransformer2DModel(**cfg).to(torch.bfloat16)),
                       _DiffusersEngine(QwenImageTransformer2DModel(**cfg).to(torch.bfloat16)))
                continue
            from megatron_omni.rollout.vllm_omni import inline

            with inline.vllm_omni_parallel(1, dtype=torch.bfloat16) as (od, _):
                od.dtype = torch.bfloat16
                modules = [inline.build_transformer(od, cfg).to(torch.bfloat16) for _ in range(2)]
                for m in modules:
                    inline.finish_loading(m)
                # the base weights through vLLM-Omni's loader, as an engine starts (its LoRA manager reads the
                # fused q/k/v names the loader records)
                WeightSync(qwen_image_plan(cfg, trainer_tp=1, rollout_kind=engine, rollout_tp=1, mode="full"),
                           sources=megatron_sources(full_model), target=VllmOmniTarget(modules[1], 0, 1),
                           tp_group=groups.tp).sync()
                worker = inline.worker_with_extension(_VllmPipeline(modules[1], od))
                yield engine, VllmOmniTarget(modules[0], 0, 1), _Worker(worker)

    results = {}
    for engine, target, receiver in engines():
        syncs = {m: WeightSync(qwen_image_plan(cfg, trainer_tp=1, rollout_kind=engine, rollout_tp=1, mode=m),
                               sources=megatron_sources(full_model), target=target, tp_group=groups.tp)
                 for m in dict.fromkeys((mode, "full"))}
        lora_sync = LoRAAdapterSync(lora_model, receiver, family, cfg, linears, args.rank, alpha, groups.tp,
                                    groups.mcore.pp, lora_model.global_name)
        stats = {m: s.sync() for m, s in syncs.items()}
        lora_stats = lora_sync.sync()  # the first: the engine's own loader (its LoRA request path for vLLM-Omni)
        # the ratio's pairs: the trainer's full sync and the adapter sync, nothing else between them (a `full` mode
        # sync frees and maps its bucket buffers, which slowed the next small copy by a third here)
        times = _interleaved_runs({f"full sync ({mode})": syncs[mode].sync, "adapter sync": lora_sync.sync},
                                  args.runs, engine)
        if mode != "full":
            times.update(_interleaved_runs({"full sync (full)": syncs["full"].sync}, args.runs, engine + " full"))
        sec = {name: statistics.median(t) for name, t in times.items()}
        # the median of the paired ratios: each adapter sync against the full sync timed just before it
        results[engine] = statistics.median(a / f for a, f in zip(times["adapter sync"], times[f"full sync ({mode})"],
                                                                   strict=True))
        print(f"{engine}: LoRA rank {args.rank} on {len(linears)} linears -> {lora_stats.modules} modules carrying it")
        for m, s in stats.items():
            print(f"  full sync ({m}): {s.bytes_loaded / 1e6:8.2f} MB in {sec[f'full sync ({m})'] * 1e3:8.3f} ms")
        print(f"  adapter sync:  {lora_stats.bytes_loaded / 1e6:8.2f} MB in {sec['adapter sync'] * 1e3:8.3f} ms "
              f"(bytes {lora_stats.bytes_loaded / stats[mode].bytes_loaded:.3f} of full; time "
              f"{results[engine]:.3f} of the {mode} full sync, median of paired runs)")

    full_opt = _optimizer_bytes(full_model, mcfg, groups)
    lora_opt = _optimizer_bytes(lora_model, mcfg, groups)
    print(f"preset={args.preset} {cfg['num_layers']}x{cfg['num_attention_heads']}x{cfg['attention_head_dim']} bf16, "
          f"runs={args.runs} (interleaved; times are medians, ratios medians of paired runs), 1 thread")
    print(f"optimizer state: full fine-tuning {full_opt / 1e6:.2f} MB, LoRA {lora_opt / 1e6:.2f} MB "
          f"(ratio {lora_opt / full_opt:.4f})")
    per_engine = ", ".join(f"{e} {r:.3f}" for e, r in results.items())
    print(f"adapter-sync time / full-sync time ({per_engine}; target <= 0.1): {max(results.values()):.3f}")


if __name__ == "__main__":
    main()
