"""Write a tiny Qwen2.5-VL judge folder offline (random weights, byte-level tokenizer, image-processor config,
chat template), deterministically from a seed; `vllm serve` / `python -m megatron_omni.reward.vllm_server` serve it.

    python tools/make_tiny_vlm.py --out /tmp/tiny-vl --seed 0

The builder lives in `megatron_omni/reward/tiny_vlm.py` (tests import it); this is its command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_omni.reward.tiny_vlm import make_tiny_vlm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="destination folder")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args()
    path = make_tiny_vlm(args.out, seed=args.seed, overwrite=args.overwrite)
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"wrote {path} ({size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
