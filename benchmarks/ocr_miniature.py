"""The OCR miniature's algorithm comparison (issue 30): each algorithm from the shipped checkpoint under the same
RL budget, held-out OCR before and after on the fair protocol, every algorithm's held-out curve in one PNG.

Each algorithm runs its recipe (`examples.tiny.recipe`: `ocr_miniature` for flowgrpo, `ocr_miniature_mixgrpo`,
`ocr_miniature_nft`, `ocr_miniature_grpo_guard`) as a user would, in this process (one rank), with the OCR scorer
in a reward server of its own. The held-out figure is (a)+(b) of the recipe's evaluation: (a) the RL words under
seeds no RL step samples, (b) words no training ever showed, written only with the RL words' glyphs; the
pretraining words RL never sees (OK, HI and numbers) are reported apart as transfer. All ODE-sampled with 20
steps, before training, every few steps and after.

**A fair budget on a shared machine.** Wall-clock minutes measured while other jobs run are not comparable
between runs, so the budget is converted into steps: the algorithms first run `--calibration-steps` RL steps
each, interleaved (A B C D, twice), and each gets `floor(minutes * 60 / its median seconds per step)` steps (the
trainer's own `time_step`: rollout, rewards, recompute, update, sync; not evaluations). `--seconds-per-step
ALG=S ...` skips the calibration with known figures. The curve's x-axis is RL minutes at those rates.

Printed: the calibration, each run's held-out figures (before, after, peak and its step, seen / unseen / transfer),
per algorithm the means over seeds, whether the run ends within 10% of its peak, and LAST the best algorithm's
mean after/before ratio on (a)+(b) (target: >= 2.0 within 10 minutes of RL, the end within 10% of the peak).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ocr_miniature.py --algorithms flowgrpo mixgrpo diffusionnft \\
        grpo_guard --seeds 0 1 2 [--minutes 10] [--run-dir runs/ocr-miniature-algorithms] [--set a.b=v ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.tiny import recipe as recipes  # noqa: E402
from megatron_omni.reward.launcher import RewardServerProcess  # noqa: E402
from megatron_omni.trainer.config import JobConfig, apply_overrides  # noqa: E402

RECIPES = {"flowgrpo": "ocr_miniature", "mixgrpo": "ocr_miniature_mixgrpo", "diffusionnft": "ocr_miniature_nft",
           "grpo_guard": "ocr_miniature_grpo_guard"}
KEYS = {"held-out (a)+(b)": "reward_mean", "(a) RL words, new seeds": "seen_reward_mean",
        "(b) unseen words": "unseen_reward_mean", "transfer": "transfer_reward_mean"}
PEAK_TOLERANCE = 0.10  # the end may sit at most 10% under the peak


def _config(algorithm: str, seed: int, overrides: list[str], run_dir: Path, url: str) -> JobConfig:
    cfg = apply_overrides(getattr(recipes, RECIPES[algorithm])(), overrides)
    cfg.seed = seed
    cfg.run_dir = str(run_dir)
    cfg.reward.url = url
    cfg.logging.tensorboard = False
    cfg.logging.image_every = 0
    cfg.checkpoint.every = 0
    return cfg


def _train(cfg: JobConfig) -> dict:
    from megatron_omni.parallel import platform
    from megatron_omni.trainer.run import run

    cfg.validate(world_size=1)
    platform.init_distributed()
    try:
        return run(cfg, overwrite=True)
    finally:
        platform.destroy_distributed()


def _history(run_dir: Path, name: str) -> list[dict]:
    path = run_dir / name
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def calibrate(algorithms: list[str], steps: int, rounds: int, overrides: list[str], root: Path,
              url: str) -> dict[str, float]:
    """Median seconds per RL step of each algorithm (its `time_step`, first step of each run left out: it
    builds caches), measured interleaved: `rounds` rounds of `steps` + 1 steps per algorithm."""
    times: dict[str, list[float]] = {a: [] for a in algorithms}
    for r in range(rounds):
        for a in algorithms:
            cfg = _config(a, 0, overrides, root / "calibration" / f"{a}_{r}", url)
            cfg.steps = steps + 1
            cfg.eval.prompts, cfg.eval.transfer_prompts = [], []
            _train(cfg)
            times[a] += [h["time_step"] for h in _history(Path(cfg.run_dir), "metrics.jsonl")[1:]]
            print(f"calibration round {r}: {a} {statistics.median(times[a]):.2f} s/step so far "
                  f"(load average {os.getloadavg()[0]:.1f})", flush=True)
    return {a: statistics.median(t) for a, t in times.items()}


def _ratio(after: float, before: float) -> float:
    return after / before if before > 0 else math.nan


def draw_curves(results: dict[str, list[dict]], rates: dict[str, float], path: Path) -> None:
    """One PNG: every algorithm's held-out (a)+(b) curve against RL minutes, each seed thin and their mean bold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_omni.trainer import atomic_files

    fig, ax = plt.subplots(figsize=(7, 4))
    for (algorithm, runs), colour in zip(results.items(), plt.rcParams["axes.prop_cycle"].by_key()["color"]):
        per_seed = []
        for r in runs:
            xs = [e["step"] * rates[algorithm] / 60 for e in r["evals"]]
            ys = [e["reward_mean"] for e in r["evals"]]
            ax.plot(xs, ys, color=colour, alpha=0.3, linewidth=0.8)
            per_seed.append(ys)
        if len({len(y) for y in per_seed}) == 1:
            mean = [statistics.mean(v) for v in zip(*per_seed)]
            ax.plot(xs, mean, color=colour, marker="o", linewidth=2,
                    label=f"{algorithm} ({rates[algorithm]:.1f} s/step)")
    ax.set_xlabel("RL minutes (steps x calibrated seconds per step)")
    ax.set_ylabel("held-out OCR similarity, (a)+(b)")
    ax.set_title("OCR miniature: held-out curve per algorithm (thin: seeds, bold: mean)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_files.save_figure(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algorithms", nargs="+", choices=sorted(RECIPES), default=["flowgrpo"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="RL budget per run, converted into steps")
    ap.add_argument("--calibration-steps", type=int, default=2)
    ap.add_argument("--seconds-per-step", nargs="*", default=[], metavar="ALG=S",
                    help="known seconds per step (skips calibrating those algorithms)")
    ap.add_argument("--evaluations", type=int, default=5, help="held-out evaluations after step 0 (about)")
    ap.add_argument("--run-dir", default="runs/ocr-miniature-algorithms", help="where the runs, results.json and "
                    "the curves' PNG go")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    a = ap.parse_args()
    if a.minutes <= 0 or a.calibration_steps < 1 or a.evaluations < 1:
        raise SystemExit("--minutes, --calibration-steps and --evaluations must be positive")
    known = {}
    for item in a.seconds_per_step:
        name, _, value = item.partition("=")
        if name not in RECIPES or not value:
            raise SystemExit(f"--seconds-per-step {item!r}: expected ALG=SECONDS with ALG one of {sorted(RECIPES)}")
        known[name] = float(value)

    root = Path(a.run_dir)
    started = time.perf_counter()
    results: dict[str, list[dict]] = {alg: [] for alg in a.algorithms}
    with RewardServerProcess("ocr", workers=1, max_queue=256, timeout_s=120) as srv:
        todo = [alg for alg in a.algorithms if alg not in known]
        rates = {**known, **(calibrate(todo, a.calibration_steps, 2, a.overrides, root, srv.url) if todo else {})}
        steps = {alg: max(1, int(a.minutes * 60 // rates[alg])) for alg in a.algorithms}
        for alg in a.algorithms:
            print(f"{alg}: {rates[alg]:.2f} s per RL step -> {steps[alg]} steps in {a.minutes:g} minutes", flush=True)
        for seed in a.seeds:
            for alg in a.algorithms:
                run_dir = root / alg / f"seed_{seed}"
                cfg = _config(alg, seed, a.overrides, run_dir, srv.url)
                cfg.steps = steps[alg]
                cfg.eval.every = max(1, steps[alg] // a.evaluations)
                t0 = time.perf_counter()
                summary = _train(cfg)
                evals = _history(run_dir, "eval.jsonl")
                before, after = evals[0], evals[-1]
                results[alg].append({"seed": seed, "evals": evals, "summary": summary})
                print(f"{alg} seed {seed}: {cfg.steps} steps, {(time.perf_counter() - t0) / 60:.1f} min with "
                      f"evaluations, run folder {run_dir}")
                for label, key in KEYS.items():
                    print(f"  {label}: before {before[key]:.3f} -> after {after[key]:.3f}")
                print(f"  held-out peak {after['peak_reward_mean']:.3f} at step {after['peak_step']}, last "
                      f"{after['reward_mean']:.3f}; training reward {summary['first_reward']:.3f} -> "
                      f"{summary['last_reward']:.3f}", flush=True)
    rows = []
    for alg, runs in results.items():
        b = statistics.mean(r["evals"][0]["reward_mean"] for r in runs)
        f = statistics.mean(r["evals"][-1]["reward_mean"] for r in runs)
        peaks = [r["evals"][-1]["peak_reward_mean"] for r in runs]
        holds = all(r["evals"][-1]["reward_mean"] >= (1 - PEAK_TOLERANCE) * p for r, p in zip(runs, peaks))
        for label, key in KEYS.items():
            mb = statistics.mean(r["evals"][0][key] for r in runs)
            mf = statistics.mean(r["evals"][-1][key] for r in runs)
            print(f"{alg}, mean of {len(runs)} seeds, {label}: {mb:.3f} -> {mf:.3f}")
        per_seed = ", ".join(f"{r['seed']}: {_ratio(r['evals'][-1]['reward_mean'], r['evals'][0]['reward_mean']):.2f}"
                             for r in runs)
        print(f"{alg}: ratio after/before per seed {per_seed}; of the means {_ratio(f, b):.2f}; end within "
              f"{PEAK_TOLERANCE:.0%} of the peak in every seed: {'yes' if holds else 'no'}")
        rows.append((_ratio(f, b), alg))
    draw_curves(results, rates, root / "held_out_curves.png")
    print(f"held-out curves: {root / 'held_out_curves.png'}   (total {(time.perf_counter() - started) / 60:.1f} min)")
    (root / "results.json").write_text(json.dumps({"rates": rates, "steps": steps, "results": results}, indent=1,
                                                  default=str))
    best_ratio, best = max(rows, key=lambda r: (not math.isnan(r[0]), r[0]))
    print(f"best algorithm {best}: held-out (a)+(b) OCR similarity ratio after/before (mean of {len(a.seeds)} "
          f"seeds, {a.minutes:g} min of RL): {best_ratio:.2f}")


if __name__ == "__main__":
    main()
