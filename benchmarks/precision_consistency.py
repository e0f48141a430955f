"""train/rollout log-prob consistency by precision: the embedded diffusers engine samples trajectories in
fp32 or bf16, the Megatron model (same weights, same dtype) recomputes their log-probs at trainer TP 1 and 2
(gloo ranks), with and without true CFG. Prints mean and max |dlogp| per configuration and, last, the worst
bf16 no-CFG mean divided by VeRL-Omni's measured 2.2e-5.

    PYTHONPATH=. python benchmarks/precision_consistency.py [--pipeline DIR] [--tp 1 2]

Default pipeline: the shipped tiny text pipeline (examples/tiny/text_pipeline). Measured on CPU (each rank
rolls out all 8 samples, 6 steps, window 3; mean / max |dlogp|):

    dtype tp  no-CFG mean  no-CFG max  CFG mean  CFG max
    fp32   1  1.5e-08      1.2e-07     0         0
    fp32   2  1.5e-08      1.2e-07     2.0e-08   1.2e-07
    bf16   1  0            0           0         0
    bf16   2  7.6e-06      3.2e-05     1.1e-05   1.5e-04

bf16 before the diffusers rounding order (RMSNorm), the pipeline's timestep convention, one text length per
call and the split linears' rounding: 2.6e-05 / 1.0e-04 (TP 1), 2.8e-05 / 1.1e-04 (TP 2). What is left at
TP 2 is the row-parallel layers' reduction order (two fp32 half sums against the engine's one GEMM), which
moves rare rounding ties."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

VERL_OMNI_NO_CFG = 2.2e-5
PROMPTS = ['a sign that says "HI"', "a red cube on a table", 'the word "SUN"', "a cat"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def measure(rank: int, world_size: int, pipeline: str, tp: int, dtype_name: str) -> dict[str, float]:
    """On each gloo rank: mean/max |dlogp| of the engine's trajectories (no-CFG and CFG) recomputed by the
    Megatron model at `tp`, both in `dtype_name`."""
    from megatron_omni.models.dit.diffusers_interface import DiffusersForward
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.rollout.base import SamplingParams
    from megatron_omni.rollout.diffusers_engine import DiffusersRolloutEngine
    from megatron_omni.rollout.logprob import recompute_log_probs
    from model_providers.qwen_image import provider

    dtype = DTYPES[dtype_name]
    engine = DiffusersRolloutEngine(pipeline, max_batch_size=3, dtype=dtype)
    groups = build_parallel_groups(ParallelLayout(tp=tp))
    seed_everything(0, tp_rank=groups.tp.rank())
    mcfg = provider.transformer_config(dict(engine.transformer.config), tp=tp, params_dtype=dtype)
    model = provider.build_model(mcfg, groups)
    provider.load_hf_state_dict(model, engine.transformer.state_dict())
    velocity = DiffusersForward(model)
    out: dict[str, float] = {}
    base = dict(height=64, width=64, num_steps=6, window_size=3, noise_level=1.0)
    for name, params in {"no_cfg": SamplingParams(**base),
                         "cfg": SamplingParams(**base, guidance_scale=3.0, negative_prompt=" ")}.items():
        traj = engine.generate(PROMPTS, params, group_size=2, seeds=list(range(100, 108)))
        with torch.no_grad():
            rec = recompute_log_probs(traj, velocity, batch_size=4, dtype=dtype)
        gap = (rec.log_probs - traj.log_probs).abs()
        out[name] = float(gap.mean())
        out[name + "_max"] = float(gap.max())
    return out


def main() -> None:
    from tests.distributed.harness import run_ranks

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pipeline", default=str(Path(__file__).resolve().parents[1] / "examples/tiny/text_pipeline"))
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES))
    args = ap.parse_args()
    rows, worst = [], 0.0
    for dtype_name in args.dtype:
        for tp in args.tp:
            r = run_ranks(measure, max(tp, 1), args.pipeline, tp, dtype_name, timeout_s=900)[0]
            rows.append((dtype_name, tp, r))
            if dtype_name == "bf16":
                worst = max(worst, r["no_cfg"])
    print(f"{'dtype':6} {'tp':>3} {'mean no-CFG':>12} {'max no-CFG':>12} {'mean CFG':>12} {'max CFG':>12}")
    for dtype_name, tp, r in rows:
        print(f"{dtype_name:6} {tp:>3} {r['no_cfg']:12.2e} {r['no_cfg_max']:12.2e} {r['cfg']:12.2e} "
              f"{r['cfg_max']:12.2e}")
    if "bf16" in args.dtype:
        print(f"worst bf16 no-CFG mean |dlogp| / VeRL-Omni's {VERL_OMNI_NO_CFG:.1e}: {worst / VERL_OMNI_NO_CFG:.3f}")


if __name__ == "__main__":
    main()
