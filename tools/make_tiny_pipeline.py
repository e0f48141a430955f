"""Write a complete, tiny Qwen-Image pipeline folder offline, deterministically from a seed.

    python tools/make_tiny_pipeline.py --out /tmp/tiny-qwen-image --seed 0 [--preset small]

The builder lives in `model_providers/qwen_image/tiny_pipeline.py` (the trainer uses it for `model.pipeline=tiny`);
this is its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_providers.qwen_image.tiny_pipeline import (  # noqa: E402,F401  (re-exported for scripts and tests)
    SMALL_TRANSFORMER,
    TinyPipelineConfig,
    TinyTransformerConfig,
    make_tiny_pipeline,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="destination folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny", help="transformer size")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    cfg = TinyPipelineConfig(transformer=SMALL_TRANSFORMER) if args.preset == "small" else TinyPipelineConfig()
    path = make_tiny_pipeline(args.out, seed=args.seed, config=cfg, overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"wrote {path} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
