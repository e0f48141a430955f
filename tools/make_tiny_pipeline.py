"""Write a complete, tiny pipeline folder offline, deterministically from a seed: Qwen-Image (default), the
Wan text-to-video pipeline (`--family wan`), the SD3.5 pipeline (`--family sd3`), the FLUX.1 pipeline (`--family
flux`) or the Qwen-Image-Edit pipeline (`--family qwen_image_edit`).

    python tools/make_tiny_pipeline.py --out /tmp/tiny-qwen-image --seed 0 [--preset small]
    python tools/make_tiny_pipeline.py --family wan --out /tmp/tiny-wan --seed 0
    python tools/make_tiny_pipeline.py --family wan-a14b --out /tmp/tiny-wan-a14b --seed 0   # Wan2.2-A14B layout
    python tools/make_tiny_pipeline.py --family wan-ti2v --out /tmp/tiny-wan-ti2v --seed 0   # Wan2.2-TI2V-5B layout
    python tools/make_tiny_pipeline.py --family sd3 --out /tmp/tiny-sd3 --seed 0
    python tools/make_tiny_pipeline.py --family flux --out /tmp/tiny-flux --seed 0
    python tools/make_tiny_pipeline.py --family qwen_image_edit --out /tmp/tiny-edit --seed 0

The builders live in `model_providers/<family>/tiny_pipeline.py` (the trainer uses them for `model.pipeline=tiny`);
this is their command line.
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
    parser.add_argument("--family", default="qwen_image",
                        choices=("qwen_image", "wan", "wan-ti2v", "wan-a14b", "sd3", "flux", "qwen_image_edit"))
    parser.add_argument("--out", required=True, help="destination folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", choices=("tiny", "small"), default="tiny",
                        help="transformer size (Qwen-Image; the other families' pipelines are always tiny)")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    if args.family != "qwen_image" and args.preset != "tiny":
        parser.error(f"--preset small is a Qwen-Image size; the {args.family} pipeline is tiny")
    if args.family == "qwen_image_edit":
        from model_providers.qwen_image_edit.tiny_pipeline import make_tiny_edit_pipeline

        path = make_tiny_edit_pipeline(args.out, seed=args.seed, overwrite=args.overwrite)
    elif args.family == "wan-ti2v":
        from model_providers.wan.tiny_pipeline import make_tiny_ti2v_pipeline

        path = make_tiny_ti2v_pipeline(args.out, seed=args.seed, overwrite=args.overwrite)
    elif args.family == "wan-a14b":
        from model_providers.wan.tiny_pipeline import make_tiny_a14b_pipeline

        path = make_tiny_a14b_pipeline(args.out, seed=args.seed, overwrite=args.overwrite)
    elif args.family in ("wan", "sd3", "flux"):
        from importlib import import_module

        make = import_module(f"model_providers.{args.family}.tiny_pipeline").make_tiny_pipeline
        path = make(args.out, seed=args.seed, overwrite=args.overwrite)
    else:
        cfg = TinyPipelineConfig(transformer=SMALL_TRANSFORMER) if args.preset == "small" else TinyPipelineConfig()
        path = make_tiny_pipeline(args.out, seed=args.seed, config=cfg, overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"wrote {path} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
