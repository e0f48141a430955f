"""A prediction, not a measurement (a tool, not a benchmark): the dry-run planner over a grid of layouts for the
20B Qwen-Image OCR recipe (512x512, 10 steps, window 2, 32 prompts x 16, 2 mini-batches, non-CFG) on H200 and H800:
predicted per-GPU memory and images/s/GPU at an assumed MFU, with the reference's published figure (VeRL-Omni,
0.510 images/s/GPU measured on 4xH200) beside it and the MFU that figure implies. No GPU needed.

For each GPU kind, world size and trainer layout (tp, ulysses x ring, pp) the table shows the fastest
setting that fits over recompute mode, micro-batch size and rollout TP (the rollout engine colocated), or
the smallest memory when none fits, then the best predicted images/s/GPU on 8xH200.
Then the disaggregated splits (`placement.mode=disaggregated`, `planner.disaggregated`: T trainer + R rollout
GPUs, steady state at staleness 1, the embedded engine at rollout tp 1) next to the best colocated plan on T + R.
Last line: "predicted at MFU x", with the cost model's assumptions.
Usage: python tools/planner_table.py [--mfu 0.35] [--worlds 8 16] [--cfg] [--splits 4+4 6+2 12+4]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools

from tqdm import tqdm

from megatron_omni.parallel.layout import LayoutError, ParallelLayout
from megatron_omni.planner import (
    DEFAULT_MFU,
    GPUS,
    REFERENCE_GPUS,
    REFERENCE_IMAGES_PER_S_PER_GPU,
    REFERENCE_STEP_S,
    PlanReport,
    RolloutSpec,
    Workload,
    plan,
    reference_implied_mfu,
)
from megatron_omni.planner.disaggregated import ASSUMPTIONS, DisaggregatedReport, plan_disaggregated
from megatron_omni.planner.memory import GIB, RECOMPUTE_MODES

TPS = (1, 2, 4, 8)
CPS = ((1, 1), (2, 1), (4, 1), (2, 2))
PPS = (1, 2, 4)
MICRO = (1, 2, 4, 8)
ROLLOUT_TPS = (1, 2, 4, 8)
SPLIT_TPS = (1, 2, 3, 4, 6, 8)  # a split's trainer side can be 6 or 12 GPUs


def _best(gpu: str, world: int, layout: ParallelLayout, workload: Workload, mfu: float) -> PlanReport | None:
    """The fastest fitting plan over recompute, micro-batch and rollout TP; else the smallest in memory."""
    fitting, all_plans = [], []
    for mode, mbs, rtp in itertools.product(RECOMPUTE_MODES, MICRO, ROLLOUT_TPS):
        try:
            r = plan("20b", layout, world, gpu, dataclasses.replace(workload, micro_batch_size=mbs),
                     rollout=RolloutSpec(tp=rtp), recompute=mode, mfu=mfu)
        except LayoutError:
            continue
        all_plans.append(r)
        if r.memory.fits:
            fitting.append(r)
    if fitting:
        return max(fitting, key=lambda r: r.time.images_per_s_per_gpu)
    return min(all_plans, key=lambda r: r.memory.total) if all_plans else None


def _best_split(gpu: str, trainer: int, rollout: int, workload: Workload, mfu: float) -> DisaggregatedReport | None:
    """The fastest disaggregated plan over the trainer's layout, recompute and micro-batch whose two sides fit
    (rollout tp 1: the double-buffered diffusers engine is one process per rank); else the one whose fuller side
    needs the least memory."""
    best, smallest = None, None
    fuller = lambda r: max(r.trainer.memory.total, r.rollout_memory.total)  # noqa: E731
    for tp, (u, rg), pp, mode, mbs in itertools.product(SPLIT_TPS, CPS, PPS, RECOMPUTE_MODES, MICRO):
        try:
            r = plan_disaggregated("20b", ParallelLayout(tp=tp, ulysses=u, ring=rg, pp=pp), trainer, rollout, gpu,
                                   dataclasses.replace(workload, micro_batch_size=mbs), recompute=mode, mfu=mfu)
        except LayoutError:
            continue
        if r.fits and (best is None or r.images_per_s_per_gpu > best.images_per_s_per_gpu):
            best = r
        if smallest is None or fuller(r) < fuller(smallest):
            smallest = r
    return best or smallest


def _split_row(d: DisaggregatedReport, colocated: PlanReport | None) -> str:
    lay, t = d.trainer.layout, d.trainer
    versus = ("no colocated plan fits" if colocated is None else
              f"colocated best {colocated.time.images_per_s_per_gpu:.3f} (tp{colocated.layout.tp} "
              f"u{colocated.layout.ulysses}r{colocated.layout.ring} pp{colocated.layout.pp} {colocated.recompute} "
              f"mb{colocated.workload.micro_batch_size} rtp{colocated.rollout.tp}) -> x"
              f"{d.images_per_s_per_gpu / colocated.time.images_per_s_per_gpu:.2f}")
    head = (f"{t.gpu.name:5s} {d.trainer_gpus:2d}+{d.rollout_gpus:<2d} | tp{lay.tp} u{lay.ulysses}r{lay.ring} "
            f"pp{lay.pp} dp{lay.dp:<2d} {t.recompute:9s} mb{t.workload.micro_batch_size} | trainer "
            f"{t.memory.total / GIB:5.1f} rollout {d.rollout_memory.total / GIB:5.1f} of "
            f"{d.rollout_memory.capacity / GIB:5.1f} GiB")
    if not d.fits:
        return f"{head} | DOES NOT FIT ({'trainer' if not t.memory.fits else 'rollout'} side)"
    return (f"{head} | rollout {d.rollout_s:5.1f} s, train+push "
            f"{d.train_s:5.1f} s -> {d.step_s:5.1f} s {d.bound:7s} | {d.images_per_s_per_gpu:.3f} img/s/GPU | {versus}")


def _row(r: PlanReport) -> str:
    m, lay = r.memory, r.layout
    state = (m.parameters + m.gradients + m.optimizer_states) / GIB
    rollout = (m.rollout_weights + m.rollout_activations) / GIB
    speed = (f"{r.time.step_s:7.1f} {r.time.images_per_s_per_gpu:6.3f} {r.ratio_to_reference:5.2f}" if m.fits
             else f"{'-':>7s} {'-':>6s} {'-':>5s}")
    return (f"{r.gpu.name:5s} {r.gpus:3d} | tp{lay.tp} u{lay.ulysses}r{lay.ring} pp{lay.pp} dp{lay.dp:<2d} | "
            f"{r.recompute:9s} mb{r.workload.micro_batch_size} rtp{r.rollout.tp} | {state:6.1f} "
            f"{m.activations / GIB:6.1f} {rollout:6.1f} {m.total / GIB:6.1f}/{m.capacity / GIB:5.1f} "
            f"{'fits' if m.fits else 'NO  '} | {speed}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mfu", type=float, default=DEFAULT_MFU)
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--cfg", action="store_true", help="the CFG variant (two forwards per step)")
    ap.add_argument("--splits", nargs="*", default=["4+4", "6+2", "12+4"],
                    help="disaggregated trainer+rollout GPU splits to plan (none: skip them)")
    args = ap.parse_args()
    workload = Workload(cfg=args.cfg)

    cases = [(g, w, ParallelLayout(tp=tp, ulysses=u, ring=rg, pp=pp))
             for g in GPUS for w in args.worlds for tp in TPS for u, rg in CPS for pp in PPS]
    rows: list[PlanReport] = []
    invalid = 0
    for gpu, world, layout in tqdm(cases, desc="layouts", unit="layout"):
        r = _best(gpu, world, layout, workload, args.mfu)
        if r is None:
            invalid += 1
        else:
            rows.append(r)

    print(f"assumption: MFU {args.mfu:.2f} of the dense bf16 peak (989 TFLOP/s on H200 and H800) for rollout and "
          "training; non-overlapped TP/Ulysses/optimizer collectives at 0.7 x NVLink (450 / 200 GB/s per "
          "direction) or 50 GB/s per GPU across nodes; rollout colocated (weights resident with the training "
          "state, text encoder + VAE included), 4 GiB reserve per GPU")
    print(f"recipe: 20B, 512x512, 10 steps, window 2, 32 prompts x 16, 2 mini-batches, cfg={args.cfg}; "
          f"{invalid} of {len(cases)} layouts are impossible (heads/blocks/tokens/world size) and not listed")
    print("gpu   n   | layout               | recompute mb rtp | state   acts  rollout total/cap   fit | "
          "step_s img/s/GPU ratio")
    for r in rows:
        print(_row(r))

    best = max((r for r in rows if r.gpu.name == "H200" and r.gpus == 8 and r.memory.fits),
               key=lambda r: r.time.images_per_s_per_gpu, default=None)
    if best is None:
        raise SystemExit("no layout fits on 8xH200")
    print("\nbest on 8xH200:")
    print(best.table())
    print(f"reference VeRL-Omni on {REFERENCE_GPUS}xH200: {REFERENCE_IMAGES_PER_S_PER_GPU:.3f} images/s/GPU, "
          f"~{REFERENCE_STEP_S:.0f} s/step; at our FLOPs count per image ({best.flops_per_image / 1e12:.0f} TFLOP) "
          f"that is an achieved MFU of {reference_implied_mfu(best):.3f} (we assume {args.mfu:.2f})")
    print(f"best predicted on 8xH200: {best.time.images_per_s_per_gpu:.3f} images/s/GPU (the reference measured "
          f"{REFERENCE_IMAGES_PER_S_PER_GPU:.3f} on {REFERENCE_GPUS}xH200)")
    last = f"every figure above is predicted at MFU {args.mfu:.2f} (a cost model, not a measurement); assumptions: "
    if not args.splits:
        print(last + "the planner's memory and time model (docs/parallelism.md)")
        return
    splits = [tuple(int(n) for n in s.split("+")) for s in args.splits]
    print("\ndisaggregated (best fitting trainer layout per split; colocated best over the table's grid on T + R):")
    for gpu in GPUS:
        for trainer, rollout in splits:
            d = _best_split(gpu, trainer, rollout, workload, args.mfu)
            colocated = max((r for r in rows if r.gpu.name == gpu and r.gpus == trainer + rollout and r.memory.fits),
                            key=lambda r: r.time.images_per_s_per_gpu, default=None)
            if colocated is None and trainer + rollout not in args.worlds:
                colocated = max(filter(None, (_best(gpu, trainer + rollout, ParallelLayout(tp=tp, ulysses=u, ring=rg,
                                                                                        pp=pp), workload, args.mfu)
                                              for tp in TPS for u, rg in CPS for pp in PPS)),
                                key=lambda r: (r.memory.fits, r.time.images_per_s_per_gpu), default=None)
                colocated = colocated if colocated is not None and colocated.memory.fits else None
            print(f"{gpu:5s} {trainer:2d}+{rollout:<2d} | no valid layout" if d is None else _split_row(d, colocated))
    print(last + ASSUMPTIONS)


if __name__ == "__main__":
    main()
