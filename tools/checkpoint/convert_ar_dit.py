"""Convert an AR-DiT hybrid between its Hugging Face folder and a Megatron distributed checkpoint.

    python tools/checkpoint/convert_ar_dit.py hf-to-mcore HF_DIR MCORE_DIR
    python tools/checkpoint/convert_ar_dit.py mcore-to-hf MCORE_DIR HF_DIR
    python tools/checkpoint/convert_ar_dit.py make-tiny   HF_DIR [--seed 0]     (a random tiny hybrid, offline)

The Hugging Face folder holds the three parts in their own formats: `decoder/` (transformers Qwen2
`save_pretrained`), `connector/` (`model.safetensors`: norm.weight, proj.weight, proj.bias), `transformer/`
(diffusers `QwenImageTransformer2DModel`), `ar_dit.json` (eos/pad ids) and `model_index.json` (the folder is
what the GPU rollout serves: vLLM its `decoder/`, vLLM-Omni the folder with `rollout.vllm_omni.hybrid`'s
pipeline class). The Megatron checkpoint has the
layout of the AR-DiT trainer's checkpoints (`checkpoint.sharded_state.ar_dit_sharded_state_dict`): every tensor
under `decoder.` / `connector.` / `dit.` + its global Megatron name, as ShardedTensors at their tensor-parallel
offsets, SwiGLU's fused `linear_fc1` through Megatron-Core's gate/up factory, so a checkpoint written here
(tp = 1) loads into a hybrid at any tp, and `mcore-to-hf` also reads a training checkpoint
(`OUT/checkpoints/step_N`, any tp; its optimizer state is left out). Content metadata records the hybrid
config. Conversion runs in one process on full tensors (no streaming yet). Exit status: 0 on success, 2 on bad
input (nothing is written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


# --------------------------------------------------------------------------------------- sharded state
def save_hybrid(model, checkpoint_dir: str | Path, hybrid_config: dict[str, Any]) -> None:
    """Save an `ARDiTModel` (every rank calls this) in the layout the AR-DiT trainer's checkpoints use, with
    the hybrid config as content metadata."""
    from megatron.core import dist_checkpointing

    from megatron_omni.checkpoint.sharded_state import (
        ar_dit_content_metadata,
        ar_dit_sharded_state_dict,
        synchronous_write_results,
    )

    ckpt = str(checkpoint_dir)
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    synchronous_write_results()
    dist_checkpointing.save(ar_dit_sharded_state_dict(model), ckpt,
                            content_metadata=ar_dit_content_metadata(hybrid_config))


def load_hybrid(model, checkpoint_dir: str | Path) -> None:
    """Load a converter or training checkpoint saved at any tp into this rank's shards (every rank calls
    this)."""
    from megatron_omni.checkpoint.sharded_state import load_ar_dit_weights

    load_ar_dit_weights(model, checkpoint_dir)


# ------------------------------------------------------------------------------------------ HF folders
def save_hf_folder(hybrid, out_dir: str | Path) -> None:
    """Write a `TorchHybrid` as an AR-DiT Hugging Face folder (decoder/, connector/, transformer/, ar_dit.json,
    and model_index.json, which lets vLLM-Omni serve the DiT half from this folder)."""
    from safetensors.torch import save_file

    from megatron_omni.rollout.vllm_omni.hybrid import write_model_index

    out = Path(out_dir)
    hybrid.decoder.save_pretrained(out / "decoder")
    hybrid.dit.save_pretrained(out / "transformer")
    (out / "connector").mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hybrid.connector.state_dict().items()},
              str(out / "connector" / "model.safetensors"))
    cfg = hybrid.config
    (out / "ar_dit.json").write_text(json.dumps({"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id},
                                                indent=2))
    write_model_index(out)


def load_hf_folder(folder: str | Path):
    """Read an AR-DiT Hugging Face folder into a `TorchHybrid` (offline; fp32 kept as stored)."""
    from diffusers import QwenImageTransformer2DModel
    from safetensors.torch import load_file
    from transformers import Qwen2ForCausalLM

    from megatron_omni.checkpoint.errors import CheckpointError
    from megatron_omni.models.ar.connector import Connector
    from model_providers.ar_dit.provider import TorchHybrid, hybrid_config

    root = Path(folder)
    for part in ("decoder/config.json", "transformer/config.json", "connector/model.safetensors", "ar_dit.json"):
        if not (root / part).is_file():
            raise CheckpointError(f"{root} is not an AR-DiT folder: {part} is missing")
    decoder = Qwen2ForCausalLM.from_pretrained(root / "decoder", local_files_only=True, dtype=torch.float32)
    dit = QwenImageTransformer2DModel.from_pretrained(root / "transformer", local_files_only=True,
                                                      torch_dtype=torch.float32)
    ids = json.loads((root / "ar_dit.json").read_text())
    cfg = hybrid_config({"decoder": decoder.config, "dit": dict(dit.config), **ids})
    connector = Connector(cfg.decoder_hidden, cfg.joint_attention_dim, eps=cfg.decoder["rms_norm_eps"])
    state = load_file(str(root / "connector" / "model.safetensors"))
    if set(state) != set(connector.state_dict()):
        raise CheckpointError(f"connector tensors {sorted(state)} != {sorted(connector.state_dict())}")
    connector.load_state_dict(state)
    return TorchHybrid(config=cfg, decoder=decoder.eval(), connector=connector, dit=dit.eval())


# ------------------------------------------------------------------------------------------- commands
def _one_rank_groups():
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform

    platform.init_distributed(rank=0, world_size=1)
    groups = build_parallel_groups(ParallelLayout())
    platform.seed_everything(0)
    return groups


def hf_to_mcore(source: str | Path, output: str | Path) -> None:
    """HF folder -> Megatron distributed checkpoint (written to a temp folder, then renamed)."""
    from megatron_omni.checkpoint.staging import staged_output
    from model_providers.ar_dit import provider

    hybrid = load_hf_folder(source)
    groups = _one_rank_groups()
    model = provider.build_model(hybrid.config, groups)
    provider.load_hf_state(model, *hybrid.state())
    with staged_output(output) as tmp:
        save_hybrid(model, tmp, hybrid.config.to_dict())


def mcore_to_hf(source: str | Path, output: str | Path) -> None:
    """Megatron distributed checkpoint (this converter's or an AR-DiT training checkpoint, any tp it was saved
    at) -> HF folder (temp folder, then renamed)."""
    from megatron_omni.checkpoint.sharded_state import read_ar_dit_config
    from megatron_omni.checkpoint.staging import staged_output
    from model_providers.ar_dit import provider

    cfg = provider.hybrid_config(read_ar_dit_config(source))
    groups = _one_rank_groups()
    model = provider.build_model(cfg, groups)
    load_hybrid(model, source)
    hybrid = provider.torch_hybrid(cfg)
    hybrid.load(*provider.hf_state(model))
    with staged_output(output) as tmp:
        save_hf_folder(hybrid, tmp)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("hf-to-mcore", "mcore-to-hf"):
        p = sub.add_parser(name)
        p.add_argument("source")
        p.add_argument("output")
    tiny = sub.add_parser("make-tiny", help="write a random tiny AR-DiT HF folder (offline)")
    tiny.add_argument("output")
    tiny.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from megatron_omni.checkpoint.errors import CheckpointError

    try:
        if args.command == "hf-to-mcore":
            hf_to_mcore(args.source, args.output)
        elif args.command == "mcore-to-hf":
            mcore_to_hf(args.source, args.output)
        else:
            from megatron_omni.checkpoint.staging import staged_output
            from model_providers.ar_dit import provider

            with staged_output(args.output) as tmp:
                save_hf_folder(provider.torch_hybrid("tiny", seed=args.seed), tmp)
    except (CheckpointError, KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
