"""diffusers <-> Megatron distributed checkpoint conversion, streaming, bit-exact.

`hf_to_mcore`: a diffusers transformer (or pipeline) folder -> a full-tensor torch_dist checkpoint under
global Megatron names, loadable at any TP/PP/CP layout (`sharded_state.load_model_checkpoint`).
`mcore_to_hf`: a distributed checkpoint saved at any layout (by the converter or by training) -> a
diffusers transformer folder, or a whole pipeline when the original pipeline folder is given.

Both check the whole input before writing anything (tensor names against the family's mapping, shapes
against the config, file integrity), build the output in a temporary folder renamed at the end, and hold
at most a bounded bucket of tensors in memory. Values are copied, never recomputed: fusing q/k/v into
Megatron's per-head layout and splitting it back are permutations, so a round trip is byte-identical
unless `dtype` asks for a cast.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from megatron_omni.checkpoint import families, manifest
from megatron_omni.checkpoint.errors import CheckpointError
from megatron_omni.checkpoint.families import family_of_config, resolve_diffusers_folder
from megatron_omni.checkpoint.safetensors_io import PlannedTensor, SafetensorsFolder, ShardedSafetensorsWriter
from megatron_omni.checkpoint.sharded_state import content_metadata, read_content_metadata, require_dist_checkpoint
from megatron_omni.checkpoint.staging import check_output, staged_output
from megatron_omni.checkpoint.streaming import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FILE_BYTES,
    bucket_keys,
    checkpoint_tensor_specs,
    load_full_tensors,
    save_streaming,
    single_process_group,
)
from model_providers.registry import ModelFamily

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_MAX_SHARD_BYTES = 10 * 10**9  # diffusers' save_pretrained default ("10GB")


@dataclass
class ConversionResult:
    """What a conversion did (or, for a dry run, would do)."""

    output: Path
    family: str
    tensors: int
    bytes: int
    seconds: float = 0.0
    dry_run: bool = False
    plan: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds else float("nan")


def parse_dtype(name: str | None) -> torch.dtype | None:
    """'bf16' | 'fp32' | None (keep the source dtype)."""
    if name is None:
        return None
    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def _hf_shapes(kind: str, shape: tuple[int, ...], n: int) -> list[tuple[int, ...]]:
    if kind == "fuse_qkv":
        return [(shape[0] // 3, *shape[1:])] * n
    return [shape]


def _progress(total: int, desc: str, enabled: bool) -> tqdm:
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, disable=not enabled,
                dynamic_ncols=True)


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# --------------------------------------------------------------------------------------------- hf -> mcore


def hf_to_mcore(
    source: str | Path,
    output: str | Path,
    *,
    dtype: str | None = None,
    dry_run: bool = False,
    progress: bool = True,
    max_file_bytes: int = DEFAULT_FILE_BYTES,
) -> ConversionResult:
    """Convert a diffusers transformer or pipeline folder into a Megatron distributed checkpoint.

    Every Megatron tensor is written whole ([full shape], global name); the source dtype is kept unless
    `dtype` ('bf16' | 'fp32') casts. Raises `CheckpointError` naming the tensor or file on bad input,
    before anything is written.
    """
    cast = parse_dtype(dtype)
    src = resolve_diffusers_folder(source)
    fam, cfg = src.family, src.config
    weights = SafetensorsFolder(src.transformer_dir)
    mappings = fam.mappings_for(cfg)
    shapes = fam.megatron_shapes(cfg)
    heads = fam.num_heads(cfg)

    expected = [n for m in mappings for n in m.hf]
    missing = [n for n in expected if n not in weights.entries]
    extra = sorted(set(weights.entries) - set(expected))
    if missing:
        raise CheckpointError(f"{src.transformer_dir}: missing tensors {missing[:8]}"
                              f"{' ...' if len(missing) > 8 else ''} ({len(missing)} of {len(expected)})")
    if extra:
        raise CheckpointError(f"{src.transformer_dir}: unexpected tensors {extra[:8]}"
                              f"{' ...' if len(extra) > 8 else ''} (not part of a {fam.name} model with this config)")
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    plan = []
    for m in mappings:
        parts = [weights.entries[n] for n in m.hf]
        for entry, want in zip(parts, _hf_shapes(m.kind, shapes[m.megatron], len(parts))):
            if entry.shape != want:
                raise CheckpointError(f"tensor {entry.name} in {entry.file} has shape {entry.shape}, the config "
                                      f"({src.transformer_dir / 'config.json'}) implies {want}")
        if len({e.dtype for e in parts}) != 1:
            raise CheckpointError(f"tensors {list(m.hf)} are fused into {m.megatron} but have different dtypes "
                                  f"{[str(e.dtype) for e in parts]}")
        specs[m.megatron] = (shapes[m.megatron], cast or parts[0].dtype)
        plan.append(f"{m.megatron}  <-  {', '.join(m.hf)}  [{m.kind}, tp_dim={m.tp_dim}, stage={m.stage}, "
                    f"{tuple(shapes[m.megatron])}, {str(specs[m.megatron][1]).removeprefix('torch.')}]")
    total = sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())
    out = check_output(output)
    result = ConversionResult(out, fam.name, len(specs), total, dry_run=dry_run, plan=plan)
    if dry_run:
        return result

    by_key = {m.megatron: m for m in mappings}
    start = time.perf_counter()
    with _progress(total, "hf-to-mcore", progress) as bar, staged_output(out) as tmp, single_process_group():
        produced: set[str] = set()

        def produce(key: str) -> torch.Tensor:
            m = by_key[key]
            full = fam.hf_to_megatron(m, [weights.read(n) for n in m.hf], heads).to(specs[key][1])
            produced.add(key)
            bar.update(full.numel() * full.element_size())
            bar.set_postfix_str(f"{len(produced)}/{len(specs)} tensors", refresh=False)
            return full

        meta = content_metadata(fam.name, cfg, {"tp": 1, "pp": 1, "cp": 1, "dp": 1},
                                source=str(src.transformer_dir))
        save_streaming(tmp, specs, produce, meta, max_file_bytes=max_file_bytes)
        manifest.write_manifest(tmp)
        if produced != set(specs):
            raise CheckpointError(f"the writer skipped tensors {sorted(set(specs) - produced)[:8]}")
    result.seconds = time.perf_counter() - start
    return result


# --------------------------------------------------------------------------------------------- mcore -> hf


def _checkpoint_config(checkpoint: str, config_path: str | Path | None) -> tuple[ModelFamily, dict[str, Any]]:
    if config_path is not None:
        cfg = families.read_json(Path(config_path))
        return family_of_config(cfg, str(config_path)), cfg
    meta = read_content_metadata(checkpoint)
    cfg = meta["diffusers_config"]
    fam = family_of_config(cfg, f"{checkpoint} (content metadata)")
    if meta.get("family") != fam.name:
        raise CheckpointError(f"{checkpoint}: content metadata says family {meta.get('family')!r} but its "
                              f"diffusers config is a {fam.name} model")
    return fam, cfg


def copy_pipeline_components(pipeline_dir: Path, out: Path, component: str = "transformer") -> None:
    """Copy every component of a diffusers pipeline folder but `component` (the transformer the conversion writes)
    into `out`."""
    for item in sorted(pipeline_dir.iterdir()):
        if item.name != component:
            dst = out / item.name
            shutil.copytree(item, dst) if item.is_dir() else shutil.copy2(item, dst)


def mcore_to_hf(
    checkpoint: str | Path,
    output: str | Path,
    *,
    pipeline_source: str | Path | None = None,
    dtype: str | None = None,
    config_path: str | Path | None = None,
    prefix: str = "",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dry_run: bool = False,
    progress: bool = True,
) -> ConversionResult:
    """Convert a Megatron distributed checkpoint (any layout) into a diffusers folder.

    Writes `config.json` and safetensors shards of at most `max_shard_bytes` (+ index when more than
    one) into `output`; with `pipeline_source` (the original pipeline folder), `output` becomes a complete
    pipeline: every other component is copied and the transformer goes to `output/transformer`. The
    checkpoint's tensors are `prefix + global Megatron name`.
    """
    cast = parse_dtype(dtype)
    ckpt = str(checkpoint)
    require_dist_checkpoint(ckpt)
    manifest.verify(Path(ckpt))  # a damaged file is named here, not as a torch error mid-export
    fam, cfg = _checkpoint_config(ckpt, config_path)
    mappings = fam.mappings_for(cfg)
    shapes = fam.megatron_shapes(cfg)
    heads = fam.num_heads(cfg)
    specs = checkpoint_tensor_specs(ckpt)

    wanted = [prefix + m.megatron for m in mappings]
    missing = [k for k in wanted if k not in specs]
    # Only the model's own namespaces count: a training checkpoint also holds optimizer state and RNG
    # objects under other keys, which a diffusers export leaves out.
    namespaces = {m.megatron.split(".")[0] for m in mappings}
    wanted_set = set(wanted)
    extra = sorted(k for k in specs if k.startswith(prefix) and k[len(prefix):].split(".")[0] in namespaces
                   and k not in wanted_set)
    if missing:
        raise CheckpointError(f"{ckpt}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                              f"({len(missing)} of {len(wanted)})")
    if extra:
        raise CheckpointError(f"{ckpt}: unexpected tensors {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    planned: list[PlannedTensor] = []
    plan = []
    for m in mappings:
        shape, src_dtype = specs[prefix + m.megatron]
        if shape != tuple(shapes[m.megatron]):
            raise CheckpointError(f"{ckpt}: tensor {prefix + m.megatron} has shape {shape}, the config implies "
                                  f"{tuple(shapes[m.megatron])}")
        out_dtype = cast or src_dtype
        for name, hf_shape in zip(m.hf, _hf_shapes(m.kind, shape, len(m.hf))):
            planned.append(PlannedTensor(name, out_dtype, hf_shape))
        plan.append(f"{prefix + m.megatron}  ->  {', '.join(m.hf)}  [{m.kind}, {shape}, "
                    f"{str(out_dtype).removeprefix('torch.')}]")

    pipeline_dir, component = None, "transformer"
    if pipeline_source is not None:
        pipe = resolve_diffusers_folder(pipeline_source)
        if pipe.pipeline_dir is None:
            raise CheckpointError(f"{pipeline_source} is not a pipeline folder (no model_index.json)")
        if pipe.family.name != fam.name or fam.arch_config(pipe.config) != fam.arch_config(cfg):
            raise CheckpointError(f"the transformer of pipeline {pipe.pipeline_dir} ({fam.arch_config(pipe.config)})"
                                  f" differs from the checkpoint's ({fam.arch_config(cfg)})")
        pipeline_dir, component = pipe.pipeline_dir, pipe.component
    total = sum(t.nbytes for t in planned)
    out = check_output(output)
    result = ConversionResult(out, fam.name, len(planned), total, dry_run=dry_run, plan=plan)
    if dry_run:
        return result

    groups = [[prefix + m.megatron] for m in mappings]
    by_key = {prefix + m.megatron: m for m in mappings}
    start = time.perf_counter()
    with _progress(total, "mcore-to-hf", progress) as bar, staged_output(out) as tmp, single_process_group():
        transformer_dir = tmp
        if pipeline_dir is not None:
            copy_pipeline_components(pipeline_dir, tmp, component)
            transformer_dir = tmp / component
            transformer_dir.mkdir()
        (transformer_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        writer = ShardedSafetensorsWriter(transformer_dir, planned, max_shard_bytes)
        try:
            done = 0
            for loaded in load_full_tensors(ckpt, bucket_keys(specs, groups, bucket_bytes), specs):
                for key in list(loaded):
                    m = by_key[key]
                    # pop: each tensor is freed once written, so a bucket shrinks as it is consumed
                    for name, t in zip(m.hf, fam.megatron_to_hf(m, loaded.pop(key), heads)):
                        t = t.to(cast) if cast is not None else t
                        writer.write(name, t)
                        bar.update(t.numel() * t.element_size())
                        done += 1
                    bar.set_postfix_str(f"{done}/{len(planned)} tensors", refresh=False)
                del loaded, t
            writer.close()
        except BaseException:
            writer.abort()
            raise
    result.seconds = time.perf_counter() - start
    return result
