"""Convert BAGEL between its published folder layout and a Megatron distributed checkpoint (streaming).

    python tools/checkpoint/convert_bagel.py bagel-to-mcore BAGEL_DIR MCORE_DIR
    python tools/checkpoint/convert_bagel.py mcore-to-bagel MCORE_DIR BAGEL_DIR [--bagel-source ORIGINAL_DIR]
    python tools/checkpoint/convert_bagel.py make-tiny      BAGEL_DIR [--seed 0]   (a random tiny BAGEL, offline)

A BAGEL folder holds `config.json`, `llm_config.json`, `vit_config.json`, `ema.safetensors` (the MoT language
model, the generation side and the ViT) and `ae.safetensors` (FLUX's VAE). The checkpoint holds every Megatron
tensor whole under its global name (loadable at any TP/PP: `megatron_omni.checkpoint.bagel.load_bagel_checkpoint`),
the ViT tensors as stored (`frozen.<name>`) and the configs as content metadata; `--bagel-source` copies
`ae.safetensors` and any tokenizer files back. Exit status: 0 on success, 2 on bad input (nothing is written).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("bagel-to-mcore", "mcore-to-bagel"):
        p = sub.add_parser(name)
        p.add_argument("source")
        p.add_argument("output")
        if name == "mcore-to-bagel":
            p.add_argument("--bagel-source", help="a BAGEL folder whose ae.safetensors / tokenizer files are copied")
    tiny = sub.add_parser("make-tiny", help="write a random tiny BAGEL folder in the published layout (offline)")
    tiny.add_argument("output")
    tiny.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from megatron_omni.checkpoint import bagel
    from megatron_omni.checkpoint.errors import CheckpointError

    try:
        if args.command == "bagel-to-mcore":
            n = bagel.bagel_to_mcore(args.source, args.output)
        elif args.command == "mcore-to-bagel":
            n = bagel.mcore_to_bagel(args.source, args.output, bagel_source=args.bagel_source)
        else:
            from model_providers.bagel.provider import write_bagel_folder

            write_bagel_folder(args.output, "tiny", seed=args.seed)
            n = None
    except (CheckpointError, FileExistsError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}" + ("" if n is None else f": {n} tensors"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
