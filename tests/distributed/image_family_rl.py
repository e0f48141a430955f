"""The RL rules and LoRA on SD3.5 and FLUX.1 through the one trainer (the rank task of
`tests/distributed/test_image_vllm_omni.py::test_each_rule_trains_lora_at_cp_or_pp`, which shares that module's tiny
folders and 2-rank pool) (`FlowGRPOTrainer`; nothing in it names a
family): on each family's offline tiny pipeline (real diffusers engine, real Megatron model, real Megatron optimizer)
one trainer with LoRA adapters at a 2-rank layout (SD3.5: Ulysses CP 2, its 3 tiny blocks do not split over 2 stages;
FLUX.1: PP 2) runs one RL step of each rule `algorithm.name` selects: FlowGRPO, MixGRPO, GRPO-Guard
and DiffusionNFT (the configuration each step runs under is validated as a run's would be).

Each step must: give a finite, nonzero loss and gradient norm; recompute the rollout's log-probs (the SDE rules)
within the measured gap; change every adapter that receives a gradient and leave every base weight bit-identical;
and sync merged weights (`rollout.lora_sync=merge`: base + B A through the family's bridge) into the engine's own
transformer copy so that its transition means equal the trainer model's adapted ones within the dtypes' probe
tolerance (the trainer's own check, `check_engine`; the figure is returned and bounded here too).
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

PROMPTS = ["a red cat", "a bowl of fruit"]
LAYOUTS = {"sd3": {"ulysses": 2}, "flux": {"pp": 2}}
GROUP = 2
RULES = ("flowgrpo", "mixgrpo", "grpo_guard", "diffusionnft")
# Measured (fp32, tiny presets, 2 shared cores): trainer/rollout log-prob gap 0 (FLUX) and <= 2.4e-7 (SD3.5 with CFG
# 4.5); merged engine vs adapted trainer probe means <= 1e-6. Bounds leave an order of magnitude.
DLOGP_TOL = 1e-5
PROBE_TOL = 1e-5
FP8_KEYS = ("loss", "grad_norm", "train_rollout_dlogp", "train_rollout_dlogp_max", "is_weight_mean", "is_weight_max",
            "train_rollout_dlogp_after_is", "sync_probe_max_diff", "sync_probe_quant_diff", "sync_probe_quant_bound")


def _config(family: str, rule: str, layout: dict):
    from megatron_omni.trainer.config import JobConfig

    cfg = JobConfig(prompts=PROMPTS, seed=3)
    cfg.model.family = family
    for k, v in layout.items():
        setattr(cfg.parallel, k, v)
    r = cfg.rollout
    r.height = r.width = 32
    r.num_steps = 4
    r.window_size = 2
    r.noise_level = 1.2
    r.max_sequence_length = 8
    r.prompts_per_step = len(PROMPTS)
    r.group_size = GROUP
    r.transformer = "engine"  # the engine samples with its own copy: the merged sync is exercised
    r.lora_sync = "merge"
    if family == "sd3":
        r.guidance_scale, r.negative_prompt = 4.5, ""
    cfg.model.lora.rank, cfg.model.lora.alpha = 4, 8.0
    cfg.optim.lr = 1e-2
    cfg.optim.mini_batches = 1
    cfg.algorithm.clip_range = 0.2
    cfg.algorithm.name = rule
    if rule == "mixgrpo":
        r.window_range = [0, 4]
        cfg.algorithm.mixgrpo = replace(cfg.algorithm.mixgrpo, steps_per_move=1)
    if rule == "diffusionnft":
        cfg.rollout.noise_level = 0.0
        cfg.algorithm.nft = replace(cfg.algorithm.nft, decay_cap=0.0, timestep_fraction=0.5)
    return cfg


def rules(rank: int, world_size: int, family: str, pipeline_dir: str, layout: dict) -> dict:
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    out: dict = {}
    trainer = None
    for step, rule in enumerate(RULES):
        cfg = _config(family, rule, layout)
        cfg.validate(world_size)
        if trainer is None:
            trainer = FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout(**layout)), pipeline_dir,
                                      RewardFunction("jpeg_compressibility"))
        else:  # the trainer reads `algorithm` per step: the same model and adapters go on under the next rule
            trainer.cfg = cfg
        named = dict(trainer.model.named_parameters())
        before = {k: v.detach().clone() for k, v in named.items()}
        result = trainer.train_step(step)
        m = result.metrics
        trainable = {k for k, v in named.items() if v.requires_grad}
        moved = {k for k, v in named.items() if not torch.equal(v.detach(), before[k])}
        out[rule] = {
            "loss": m["loss"], "grad_norm": m["grad_norm"], "dlogp_max": m.get("train_rollout_dlogp_max"),
            "probe": m["sync_probe_max_diff"], "trainable": len(trainable), "moved": len(moved),
            "moved_frozen": sorted(moved - trainable),
            "lora_only": all(".lora_" in k for k in trainable),
            "window": result.trajectory.window_start.tolist() if result.trajectory.log_probs.numel() else None,
        }
    if trainer.family.quantized_linears:  # FP8 rollout (FLUX.1): the engine's own copy fake-quantized, LoRA merged
        trainer.close()
        cfg = _config(family, "flowgrpo", layout)
        cfg.rollout.quantization, cfg.algorithm.is_cap = "fp8", 2.0
        cfg.validate(world_size)
        fp8 = FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout(**layout)), pipeline_dir,
                              RewardFunction("jpeg_compressibility"))
        out["fp8"] = {k: v for k, v in fp8.train_step(0).metrics.items() if k in FP8_KEYS}
        out["fp8"]["quantized"] = fp8.engine.quantizer is not None
    return out




def check_rules(out: dict, family: str) -> None:
    """Assert what `rules` returned on one rank (the last stage's under PP)."""
    for rule in RULES:
        r = out[rule]
        print(f"{family} {rule}: {r}")
        assert math.isfinite(r["loss"]), (rule, r)  # a PPO surrogate at ratio 1 over centred advantages is 0
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0.0, (rule, r)
        assert r["lora_only"] and r["trainable"] > 0, (rule, r)
        assert r["moved_frozen"] == [], (rule, r["moved_frozen"])
        assert r["moved"] == r["trainable"], (rule, r)
        assert r["probe"] <= PROBE_TOL, (rule, r)
        if rule == "diffusionnft":
            assert r["dlogp_max"] is None or math.isnan(r["dlogp_max"]), (rule, r)
        else:
            assert r["dlogp_max"] <= DLOGP_TOL, (rule, r)
    # MixGRPO: every sample of step 1 starts its window where the schedule has moved it (one step per move)
    assert out["mixgrpo"]["window"] == [1] * 4, out["mixgrpo"]["window"]
    if family == "flux":  # FP8 rollout: a gap the trainer measures and corrects with truncated importance weights
        m = out["fp8"]
        print(f"{family} fp8: {m}")
        assert m["quantized"] and 0 < m["sync_probe_quant_diff"] <= m["sync_probe_quant_bound"], m
        assert m["sync_probe_max_diff"] <= PROBE_TOL, m  # the unquantized view holds the merged weights
        assert 0 < m["train_rollout_dlogp"] < 1e-2 and m["train_rollout_dlogp_max"] >= m["train_rollout_dlogp"], m
        assert 0 < m["is_weight_mean"] <= m["is_weight_max"] <= 2.0, m
        assert m["train_rollout_dlogp_after_is"] <= m["train_rollout_dlogp"], m
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0, m
