"""LoRA: an adapter-only sync against a full weight sync, and the optimizer state LoRA keeps against full
fine-tuning, side by side in one process.

One rank (trainer tp=1), the `small` preset in bf16 (as production: bf16 parameters, fp32 main parameters
and Adam state). The full sync is the bridge's `full` mode into a diffusers `QwenImageTransformer2DModel`;
the adapter-only sync is what a LoRA run does after each step (`LoRAAdapterSync`: gather, rename to peft
keys, copy into the diffusers transformer's peft adapters, module-count check). Both are timed as medians
over `--runs`. Optimizer state: Megatron-Core's optimizer built over the full model and over the LoRA
model, one step each, bytes counted by storage (`allocated_bytes`). The last line is adapter-sync time /
full-sync time (target <= 0.1).

    .venv/bin/python benchmarks/lora_sync.py --preset small --rank 8
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from benchmarks.bridge_sync import median_seconds  # noqa: E402
from megatron_omni.bridge import DiffusersTarget, WeightSync  # noqa: E402
from megatron_omni.bridge.lora_sync import LoRAAdapterSync  # noqa: E402
from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan  # noqa: E402
from megatron_omni.models.lora import add_lora  # noqa: E402
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform  # noqa: E402
from megatron_omni.parallel.rank_pool import free_port  # noqa: E402
from megatron_omni.rollout.diffusers_engine import load_lora_into  # noqa: E402
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


class _Engine:
    """The one method of the diffusers engine the adapter sync calls, over a bare diffusers transformer."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer

    def load_lora(self, state, rank, alpha):
        return load_lora_into(self.transformer, state, rank, alpha, torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank (8 on small's hidden 256 ~ 64 on 20B's 3072)")
    ap.add_argument("--runs", type=int, default=7)
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
    linears = [lora_model.global_name(n) for n in add_lora(lora_model, LORA_TARGETS, args.rank, 2.0 * args.rank,
                                                            seed=0, global_name=lora_model.global_name)]

    # full sync: every weight through the bridge
    target = DiffusersTarget(QwenImageTransformer2DModel(**cfg).to(torch.bfloat16))
    plan = qwen_image_plan(cfg, trainer_tp=1, rollout_kind="diffusers", rollout_tp=1, mode="full")
    sync = WeightSync(plan, sources=megatron_sources(full_model), target=target, tp_group=groups.tp)
    full_stats = sync.sync()
    full_s = median_seconds(sync.sync, args.runs, "full sync")

    # adapter-only sync: into a diffusers transformer through peft
    family = get_family("qwen_image")
    lora_sync = LoRAAdapterSync(lora_model, _Engine(QwenImageTransformer2DModel(**cfg).to(torch.bfloat16)), family,
                                cfg, linears, args.rank, 2.0 * args.rank, groups.tp, groups.mcore.pp,
                                lora_model.global_name)
    lora_stats = lora_sync.sync()
    lora_s = median_seconds(lora_sync.sync, args.runs, "adapter sync")

    full_opt = _optimizer_bytes(full_model, mcfg, groups)
    lora_opt = _optimizer_bytes(lora_model, mcfg, groups)
    print(f"preset={args.preset} {cfg['num_layers']}x{cfg['num_attention_heads']}x{cfg['attention_head_dim']} bf16, "
          f"LoRA rank {args.rank} on {len(linears)} linears ({lora_stats.modules} diffusers modules), "
          f"runs={args.runs}")
    print(f"full sync:    {full_stats.bytes_loaded / 1e6:8.2f} MB in {full_s * 1e3:8.2f} ms")
    print(f"adapter sync: {lora_stats.bytes_loaded / 1e6:8.2f} MB in {lora_s * 1e3:8.2f} ms "
          f"(bytes {lora_stats.bytes_loaded / full_stats.bytes_loaded:.3f} of full)")
    print(f"optimizer state: full fine-tuning {full_opt / 1e6:.2f} MB, LoRA {lora_opt / 1e6:.2f} MB "
          f"(ratio {lora_opt / full_opt:.4f})")
    print(f"adapter-sync time / full-sync time (target <= 0.1): {lora_s / full_s:.3f}")


if __name__ == "__main__":
    main()
