"""LoRA adapters in checkpoints and in diffusers' format.

A training checkpoint of a LoRA run holds the adapters only (`lora_sharded_state_dict`: each factor under
`lora.<global linear name>.lora_a|lora_b`, split along the layer's tensor-parallel dim where it is split, so it
reshards like the base), their optimizer state, and in its content metadata the LoRA settings and the base's
identity (`base_identity`: the pipeline folder's path and a CRC-32 of its transformer files); a resume checks
that the base is the same.

`diffusers_lora_state` names full adapters the way diffusers' peft loader does (`<module>.lora_A.weight`),
from the family's weight mappings: a fused Megatron qkv becomes to_q / to_k / to_v, each with the shared A and
its rows of B. `lora_to_hf` writes that with diffusers' own `save_lora_weights` (loadable by the pipeline's
`load_lora_weights`), or with `merge=True` a whole pipeline folder whose transformer holds W + (alpha / r) B A.
"""

from __future__ import annotations

import json
import shutil
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor

from megatron_omni.checkpoint import manifest
from megatron_omni.checkpoint.errors import CheckpointError
from megatron_omni.checkpoint.safetensors_io import PlannedTensor, SafetensorsFolder, ShardedSafetensorsWriter
from megatron_omni.models.lora import adapters

LORA_PREFIX = "lora."
LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"  # diffusers' (peft's) suffixes of one adapted module
LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes


def lora_sharded_state_dict(model: torch.nn.Module) -> ShardedStateDict:
    """This rank's adapters as a `ShardedStateDict` keyed by local parameter name (`<linear>.lora.lora_a`):
    ShardedTensors `lora.<global linear name>.lora_a|lora_b` whose data is the parameter (so the optimizer maps
    its state onto them and a load writes in place); the split factor at its tp offset (column: B on dim 0,
    row: A on dim 1), the replicated one with tp replica ids. A fused SwiGLU fc1's B (each tp rank's rows
    `[gate_r; up_r]`) goes through Megatron-Core's gate/up factory as the fc1 weight does, so the checkpoint holds
    the global `[gate; up]` at any tp (contiguous shards would hold `[gate_0; up_0; gate_1; up_1]` at tp 2, and a
    resume at another tp would permute the rows). Needs `model.global_name` and `pg_collection`."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    pg = model.pg_collection
    tp_rank, tp_size, dp_rank = pg.tp.rank(), pg.tp.size(), pg.dp_cp.rank()
    modules = dict(model.named_modules())
    out: ShardedStateDict = {}
    for name, a in adapters(model).items():
        split_factor, dim = ("lora_a", 1) if a.parallel == "row" else ("lora_b", 0)
        swiglu = name.endswith("linear_fc1") and getattr(getattr(modules[name], "config", None),
                                                         "gated_linear_unit", False)
        for factor in ("lora_a", "lora_b"):
            key = f"{LORA_PREFIX}{model.global_name(name)}.{factor}"
            t = getattr(a, factor)
            if factor == split_factor:
                sh = ShardedTensor.from_rank_offsets(key, t, (dim, tp_rank, tp_size), replica_id=(0, 0, dp_rank))
                if swiglu:
                    sh = apply_swiglu_sharded_factory(sh, ())
            else:
                sh = ShardedTensor.from_rank_offsets(key, t, replica_id=(0, tp_rank, dp_rank))
            out[f"{name}.lora.{factor}"] = sh
    return out


def base_identity(pipeline_dir: str | Path) -> dict[str, Any]:
    """What a LoRA checkpoint records about its base: the pipeline folder's resolved path, and the size and a
    CRC-32 over the (sorted) files of its trained transformer's folder (the weights the adapters were trained on:
    `transformer`, or a Wan2.2 A14B pipeline's `transformer_2`, then named under `component`)."""
    from megatron_omni.checkpoint.families import trained_component

    root = Path(pipeline_dir).resolve()
    component = trained_component(root) if (root / "model_index.json").is_file() else "transformer"
    folder = root / component
    if not folder.is_dir():
        raise CheckpointError(f"{pipeline_dir} has no {component} folder: not a diffusers pipeline")
    crc, size = 0, 0
    for name in manifest.content_files(folder):
        entry = manifest.file_entry(folder / name)
        crc = zlib.crc32(f"{name}:{entry['size']}:{entry['crc32']};".encode(), crc)
        size += entry["size"]
    return {"path": str(folder.parent), "transformer_crc32": crc, "transformer_bytes": size,
            **({} if component == "transformer" else {"component": component})}


@dataclass(frozen=True)
class LoRATarget:
    """One diffusers module an adapted Megatron linear feeds: `module` (its diffusers name), `linear` (the
    Megatron linear's global name) and `part` (its index among the linear's diffusers tensors: 0 for a plain
    copy, 0/1/2 for q/k/v of a fused qkv)."""

    module: str
    linear: str
    part: int


def lora_targets(mappings: Sequence[Any], linears: Sequence[str]) -> list[LoRATarget]:
    """The diffusers modules of the adapted Megatron linears `linears` (global names, e.g.
    `layers.3.img.linear_qkv`), from the family's weight mappings (`ParamMapping`: megatron, hf). Pure.
    Raises KeyError for a linear the mappings do not know."""
    by_weight = {m.megatron: m for m in mappings}
    out = []
    for linear in linears:
        m = by_weight.get(f"{linear}.weight")
        if m is None:
            raise KeyError(f"no weight mapping for LoRA-adapted linear {linear!r}")
        out += [LoRATarget(hf.removesuffix(".weight"), linear, i) for i, hf in enumerate(m.hf)]
    return out


def diffusers_lora_state(full: Mapping[str, tuple[torch.Tensor, torch.Tensor]], mappings: Sequence[Any],
                         megatron_to_hf: Callable[..., list[torch.Tensor]], num_heads: int,
                         own_storage: bool = True) -> dict[str, torch.Tensor]:
    """Full adapters {global linear name: (A [r, in], B [out, r])} -> diffusers peft keys
    `<module>.lora_A.weight` [r, in] and `<module>.lora_B.weight` [out_part, r] (no `transformer.` prefix).
    B is split like the linear's weight rows (the family's `megatron_to_hf`, e.g. per-head q|k|v); the parts of
    a fused linear get copies of the same A. `own_storage=False` returns views of `full` instead, for a caller
    that copies them straight into other tensors (the adapter sync): A shared, and a B part whose rows are
    strided (a fused qkv's q, k, v) as a view with more leading dims ([heads, head_dim, r]) whose rows,
    flattened, are the key's rows; a file needs `own_storage=True`."""
    by_weight = {m.megatron: m for m in mappings}
    out: dict[str, torch.Tensor] = {}
    for linear, (a, b) in full.items():
        m = by_weight[f"{linear}.weight"]
        for hf, b_part in zip(m.hf, megatron_to_hf(m, b, num_heads, views=not own_storage), strict=True):
            module = hf.removesuffix(".weight")
            out[f"{module}.{LORA_A}"] = a.clone() if own_storage else a
            out[f"{module}.{LORA_B}"] = b_part.contiguous() if own_storage else b_part
    return out


def read_lora_checkpoint(checkpoint: str | Path) -> tuple[dict[str, Any], dict[str, Any],
                                                           dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(our content metadata entry, its `lora` entry, {global linear name: (A, B)} full tensors) of a LoRA
    training checkpoint, read in this process. Raises CheckpointError for a checkpoint without adapters."""
    from megatron_omni.checkpoint.sharded_state import read_content_metadata, require_dist_checkpoint
    from megatron_omni.checkpoint.streaming import checkpoint_tensor_specs, load_full_tensors, single_process_group

    ckpt = str(checkpoint)
    require_dist_checkpoint(ckpt)
    manifest.verify(Path(ckpt))
    meta = read_content_metadata(ckpt)
    lora = meta.get("lora")
    if not lora:
        raise CheckpointError(f"{ckpt} holds no LoRA adapters (trained with model.lora.rank=0); export it with "
                              "mcore-to-hf")
    specs = {k: v for k, v in checkpoint_tensor_specs(ckpt).items() if k.startswith(LORA_PREFIX)}
    linears = sorted({k[len(LORA_PREFIX):].rsplit(".", 1)[0] for k in specs})
    if len(linears) != lora["modules"]:
        raise CheckpointError(f"{ckpt}: {len(linears)} adapted linears stored, its metadata says {lora['modules']}")
    tensors: dict[str, torch.Tensor] = {}
    with single_process_group():
        for loaded in load_full_tensors(ckpt, [sorted(specs)], specs):
            tensors.update(loaded)
    full = {}
    for linear in linears:
        a, b = (tensors.get(f"{LORA_PREFIX}{linear}.{f}") for f in ("lora_a", "lora_b"))
        if a is None or b is None:
            raise CheckpointError(f"{ckpt}: adapter of {linear} lacks its {'lora_a' if a is None else 'lora_b'}")
        full[linear] = (a, b)
    return meta, lora, full


@dataclass
class LoRAExport:
    """What `lora_to_hf` wrote: the folder, the adapted diffusers modules, bytes and seconds."""

    output: Path
    modules: int
    bytes: int
    merged: bool
    seconds: float
    component: str = "transformer"  # the pipeline component the adapters are for (A14B: `transformer_2`)


def lora_to_hf(checkpoint: str | Path, output: str | Path, *, merge: bool = False,
               pipeline_source: str | Path | None = None, dtype: str | None = None) -> LoRAExport:
    """A LoRA training checkpoint -> `output/pytorch_lora_weights.safetensors` written by the base pipeline's
    diffusers `save_lora_weights` (keys `transformer.<module>.lora_A|B.weight`, rank and alpha in its adapter
    metadata), or with `merge` a complete diffusers pipeline folder: the base pipeline's other components and
    a transformer holding W + (alpha / r) B A. The base pipeline is `pipeline_source`, else the one the
    checkpoint records; either must match the recorded checksum. Written to a temporary folder, renamed last."""
    import diffusers

    from megatron_omni.checkpoint.convert import parse_dtype
    from megatron_omni.checkpoint.staging import check_output, staged_output
    from model_providers import get_family

    t0 = time.perf_counter()
    meta, lora, full = read_lora_checkpoint(checkpoint)
    base = Path(pipeline_source if pipeline_source is not None else lora["base"]["path"])
    if not (base / "model_index.json").is_file():
        raise CheckpointError(f"base pipeline {base} is not a diffusers pipeline folder (pass --pipeline-source)")
    found = base_identity(base)
    component = found.get("component", "transformer")
    if component != lora["base"].get("component", "transformer"):
        raise CheckpointError(f"base pipeline {base}: its trained transformer is {component}, the adapters were "
                              f"trained on {lora['base'].get('component', 'transformer')}")
    if found["transformer_crc32"] != lora["base"]["transformer_crc32"]:
        raise CheckpointError(f"base pipeline {base}: its transformer's checksum {found['transformer_crc32']} is not "
                              f"the one the adapters were trained on ({lora['base']['transformer_crc32']}, "
                              f"{lora['base']['path']})")
    cfg = meta["diffusers_config"]
    fam = get_family(meta["family"])
    mappings = fam.mappings_for(cfg)
    state = diffusers_lora_state(full, mappings, fam.megatron_to_hf, fam.num_heads(cfg))
    cast = parse_dtype(dtype)
    if cast is not None:
        state = {k: v.to(cast) for k, v in state.items()}
    modules = sorted({k.rsplit(".lora_", 1)[0] for k in state})
    out = check_output(output)
    with staged_output(out) as tmp:
        if not merge:
            pipeline_cls = getattr(diffusers, json.loads((base / "model_index.json").read_text())["_class_name"])
            pipeline_cls.save_lora_weights(
                str(tmp), transformer_lora_layers=state, weight_name=LORA_WEIGHT_NAME,
                transformer_lora_adapter_metadata={"r": lora["rank"], "lora_alpha": lora["alpha"],
                                                   "target_modules": modules, "lora_dropout": 0.0})
            written = sum(t.numel() * t.element_size() for t in state.values())
        else:
            written = _write_merged_pipeline(base, tmp, state, lora["rank"], lora["alpha"], cast, component)
    return LoRAExport(out, len(modules), written, merge, time.perf_counter() - t0, component)


def _write_merged_pipeline(base: Path, tmp: Path, state: dict[str, torch.Tensor], rank: int, alpha: float,
                           cast: torch.dtype | None, component: str = "transformer") -> int:
    """Copy the base pipeline's components except the trained transformer (`component`) into `tmp`, and write that
    transformer with every adapted weight merged (fp32 product, stored in the weight's dtype or `cast`). Returns
    bytes written."""
    from megatron_omni.checkpoint.convert import copy_pipeline_components

    copy_pipeline_components(base, tmp, component)
    src = SafetensorsFolder(base / component)
    (tmp / component).mkdir()
    shutil.copy2(base / component / "config.json", tmp / component / "config.json")
    scale = alpha / rank
    names = sorted(src.entries)
    planned = [PlannedTensor(n, cast or src.entries[n].dtype, tuple(src.entries[n].shape)) for n in names]
    writer = ShardedSafetensorsWriter(tmp / component, planned, 10 * 10**9)
    written = 0
    try:
        for name in names:
            t = src.read(name)
            module = name.removesuffix(".weight")
            if name.endswith(".weight") and f"{module}.{LORA_A}" in state:
                a, b = state[f"{module}.{LORA_A}"].float(), state[f"{module}.{LORA_B}"].float()
                t = (t.float() + scale * (b @ a)).to(t.dtype)
            t = t.to(cast) if cast is not None else t
            writer.write(name, t)
            written += t.numel() * t.element_size()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return written
