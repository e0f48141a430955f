"""Convert between diffusers folders and Megatron distributed checkpoints (any TP/PP/CP), streaming.

    python tools/checkpoint/convert.py hf-to-mcore  PIPELINE_OR_TRANSFORMER_DIR  MCORE_DIR  [--dtype bf16]
    python tools/checkpoint/convert.py mcore-to-hf  MCORE_DIR  OUT_DIR  [--pipeline-source PIPELINE_DIR]
    python tools/checkpoint/convert.py lora-to-hf   LORA_CHECKPOINT  OUT_DIR  [--merge] [--pipeline-source DIR]
    python tools/checkpoint/convert.py inspect      DIR
    a BAGEL folder (ema.safetensors + llm_config.json) or BAGEL checkpoint converts through hf-to-mcore /
    mcore-to-hf too (`--pipeline-source` then names the BAGEL folder whose ae.safetensors is copied)
    add --dry-run to print the name mapping plan and write nothing

Exit status: 0 on success, 2 on bad input (the message names the tensor or file; nothing is written).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    h2m = sub.add_parser("hf-to-mcore", help="diffusers transformer or pipeline folder -> Megatron checkpoint")
    h2m.add_argument("source", help="diffusers transformer folder (config.json) or pipeline folder")
    h2m.add_argument("output", help="new (or empty) folder for the distributed checkpoint")
    h2m.add_argument("--dtype", choices=("bf16", "fp32"), help="cast every tensor (default: keep source dtype)")
    h2m.add_argument("--file-size", default="256MiB",
                     help="bound on each checkpoint data file, which is also the memory bound (default 256MiB)")

    m2h = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> diffusers transformer or pipeline folder")
    m2h.add_argument("source", help="Megatron distributed checkpoint folder (saved at any layout)")
    m2h.add_argument("output", help="new (or empty) folder for the diffusers output")
    m2h.add_argument("--pipeline-source", help="original pipeline folder: write a complete pipeline")
    m2h.add_argument("--dtype", choices=("bf16", "fp32"), help="cast every tensor (default: keep checkpoint dtype)")
    m2h.add_argument("--config", help="diffusers config.json, for checkpoints without content metadata")
    m2h.add_argument("--prefix", default="", help="key prefix of the model tensors in the checkpoint")
    m2h.add_argument("--max-shard-size", default="10GB", help="safetensors shard size (default 10GB, as diffusers)")
    m2h.add_argument("--bucket-size", default="256MiB", help="tensors read per step: the memory bound")

    l2h = sub.add_parser("lora-to-hf", help="LoRA training checkpoint -> diffusers LoRA safetensors (or a merged "
                                            "pipeline folder)")
    l2h.add_argument("source", help="a training checkpoint of a model.lora.rank > 0 run")
    l2h.add_argument("output", help="new (or empty) folder: pytorch_lora_weights.safetensors, or with --merge a "
                                    "complete diffusers pipeline")
    l2h.add_argument("--merge", action="store_true", help="write the base pipeline with W + (alpha/r) B A merged in")
    l2h.add_argument("--pipeline-source", help="the base pipeline folder (default: the one the checkpoint records; "
                                               "its transformer's checksum must match)")
    l2h.add_argument("--dtype", choices=("bf16", "fp32"), help="cast every tensor written (default: keep)")

    for p in (h2m, m2h):
        p.add_argument("--dry-run", action="store_true", help="print the name mapping plan, write nothing")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")

    ins = sub.add_parser("inspect", help="summarise a checkpoint or diffusers folder")
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true", help="print the summary as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Megatron and torch DCP warn about their own internals (deprecated calls they make); not actionable here.
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    from megatron_omni.checkpoint import CheckpointError, convert, summary
    from megatron_omni.checkpoint.safetensors_io import parse_size

    try:
        if args.command == "inspect":
            info = summary.inspect_checkpoint(args.path)
            print(json.dumps(info, indent=2, default=str) if args.json else summary.format_summary(info))
            return 0
        if args.command == "lora-to-hf":
            from megatron_omni.checkpoint.lora import lora_to_hf

            done = lora_to_hf(args.source, args.output, merge=args.merge, pipeline_source=args.pipeline_source,
                              dtype=args.dtype)
            what = "merged pipeline" if done.merged else "LoRA weights"
            print(f"wrote {done.output} ({what}): {done.modules} adapted modules, {done.bytes / 2**20:.1f} MiB in "
                  f"{done.seconds:.1f} s")
            if done.component != "transformer" and not done.merged:  # diffusers loads into `transformer` by default
                print(f"the adapters are the pipeline's {done.component}'s: load them with "
                      f"load_lora_weights(..., load_into_{done.component}=True)")
            return 0
        from megatron_omni.checkpoint import bagel

        if args.command in ("hf-to-mcore", "mcore-to-hf") and bagel.is_bagel_source(args.source):
            # A BAGEL folder (ema.safetensors + llm_config.json) or checkpoint: not a diffusers transformer.
            unsupported = [f"--{o.replace('_', '-')}" for o in ("dtype", "dry_run") if getattr(args, o)]
            if unsupported:
                raise CheckpointError(f"{' and '.join(unsupported)}: not supported for BAGEL conversion yet")
            if args.command == "hf-to-mcore":
                n = bagel.bagel_to_mcore(args.source, args.output, max_file_bytes=parse_size(args.file_size))
            else:
                n = bagel.mcore_to_bagel(args.source, args.output, bagel_source=args.pipeline_source,
                                         bucket_bytes=parse_size(args.bucket_size))
            print(f"wrote {args.output}: {n} BAGEL tensors")
            return 0
        if args.command == "hf-to-mcore":
            result = convert.hf_to_mcore(args.source, args.output, dtype=args.dtype, dry_run=args.dry_run,
                                         progress=not args.no_progress, max_file_bytes=parse_size(args.file_size))
        else:
            result = convert.mcore_to_hf(
                args.source, args.output, pipeline_source=args.pipeline_source, dtype=args.dtype,
                config_path=args.config, prefix=args.prefix, max_shard_bytes=parse_size(args.max_shard_size),
                bucket_bytes=parse_size(args.bucket_size), dry_run=args.dry_run, progress=not args.no_progress)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if result.dry_run:
        print("\n".join(result.plan))
        print(f"dry run: {result.tensors} tensors, {result.bytes / 2**20:.1f} MiB of {result.family} weights "
              f"would be written to {result.output}")
    else:
        print(f"wrote {result.output}: {result.tensors} tensors, {result.bytes / 2**20:.1f} MiB in "
              f"{result.seconds:.1f} s ({result.gb_per_s:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    # As the trainer's entry point leaves: the exit hooks and flushes, without the interpreter's teardown (a full
    # collection over the modules torch, megatron-core and diffusers loaded: seconds of CPU that free nothing the OS
    # does not). A SIGTERM mid-write still ends in SystemExit(143) from main, after its partial folder is removed.
    from megatron_omni.train import exit_without_teardown

    exit_without_teardown(main())
