"""The OCR miniature end to end (issue 11): FlowGRPO from the shipped text pipeline, OCR reward served.

Runs the recipe `examples.tiny.recipe:ocr_miniature` as a user would, in this process (one rank, TP=1 by
default), with the OCR scorer in a reward server of its own (a separate process, as on a cluster). The
trainer evaluates the held-out prompts (8 words RL trains on, 8 it never sees; 8 seeds each) with ODE
sampling before the first and after the last step, and draws `eval_before_after.png` in the run folder.

Printed: held-out OCR similarity before and after (all, seen, unseen), the number of RL steps, the wall
time, and LAST the ratio after/before (target >= 2.0).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/ocr_miniature.py [--steps N] [--run-dir DIR] [--set a.b=v ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from examples.tiny.recipe import ocr_miniature  # noqa: E402
from megatron_omni.reward.launcher import RewardServerProcess  # noqa: E402
from megatron_omni.trainer.config import apply_overrides  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="RL steps (default: the recipe's)")
    ap.add_argument("--run-dir", default=None, help="keep the run here (default: a temporary folder)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE")
    a = ap.parse_args()

    from megatron_omni.parallel import platform
    from megatron_omni.trainer.run import run

    cfg = apply_overrides(ocr_miniature(), a.overrides)
    if a.steps is not None:
        cfg.steps = a.steps
    cfg.logging.tensorboard = False
    tmp = None
    if a.run_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ocr-miniature-")
        cfg.run_dir = tmp.name
    else:
        cfg.run_dir = a.run_dir
    cfg.validate(world_size=1)
    started = time.perf_counter()
    with RewardServerProcess("ocr", workers=1, max_queue=256, timeout_s=120) as srv:
        cfg.reward.url = srv.url
        platform.init_distributed()
        try:
            summary = run(cfg)
        finally:
            platform.destroy_distributed()
    wall = time.perf_counter() - started
    before, after = summary["eval_before"], summary["eval_after"]
    print(f"recipe examples.tiny.recipe:ocr_miniature, {summary['steps']} RL steps of "
          f"{cfg.rollout.prompts_per_step} x {cfg.rollout.group_size} images, run folder {cfg.run_dir}")
    for key in ("reward_mean", "seen_reward_mean", "unseen_reward_mean"):
        print(f"held-out OCR similarity ({key.replace('_reward_mean', '') if key != 'reward_mean' else 'all'}): "
              f"before {before[key]:.3f} -> after {after[key]:.3f}")
    print(f"RL steps: {summary['steps']}   wall time (incl. server start and both evaluations): {wall / 60:.1f} min")
    print(f"training reward: first step {summary['first_reward']:.3f} -> last step {summary['last_reward']:.3f}")
    if before["reward_mean"] <= 0:
        raise SystemExit("the held-out OCR similarity before RL is 0: the ratio is undefined")
    print(f"held-out OCR similarity ratio after/before: {after['reward_mean'] / before['reward_mean']:.2f}")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
