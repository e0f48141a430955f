"""BAGEL folder (the published layout) <-> Megatron distributed checkpoint, streaming and byte-exact.

`bagel_to_mcore`: `ema.safetensors` -> a full-tensor torch_dist checkpoint under our Megatron names
(`model_providers.bagel.mapping`: q/k/v fused into Megatron's per-query-group layout, gate/up into `linear_fc1`,
both experts), loadable at any TP/PP (`load_bagel_checkpoint`); the frozen ViT side (`vit_model.*`,
`connector.*`, `vit_pos_embed.*`) rides along as stored, under `frozen.<name>`. The three config files are the
content metadata. `mcore_to_bagel`: back to a folder (`ema.safetensors` and the configs; `ae.safetensors` and any
tokenizer files are copied from `bagel_source` when given).

Like `convert.py`'s diffusers path (whose primitives this reuses): the whole input is checked before anything
is written, the output is built in a temporary folder renamed at the end, one tensor (to checkpoint) or one
bucket (to the folder) is in memory at a time, and values are permuted, never recomputed, so a round trip
gives identical tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from megatron_omni.checkpoint.errors import CheckpointError
from megatron_omni.checkpoint.safetensors_io import PlannedTensor, SafetensorsFolder, SafetensorsStreamWriter
from megatron_omni.checkpoint.sharded_state import content_metadata, read_content_metadata
from megatron_omni.checkpoint.staging import staged_output
from megatron_omni.checkpoint.streaming import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_FILE_BYTES,
    bucket_keys,
    checkpoint_tensor_specs,
    load_full_tensors,
    save_streaming,
    single_process_group,
)
from model_providers.ar_dit.decoder_mapping import DecoderMapping, hf_to_megatron_shard, megatron_shards_to_hf
from model_providers.bagel.mapping import FROZEN_PREFIXES, all_mappings

FAMILY = "bagel"
FROZEN = "frozen."
CONFIG_FILES = {"config": "config.json", "llm_config": "llm_config.json", "vit_config": "vit_config.json"}


def _read_configs(folder: Path) -> dict[str, Any]:
    out = {}
    for key, name in CONFIG_FILES.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder} is not a BAGEL folder: {name} is missing")
        try:
            out[key] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
    return out


def _geometry(llm: dict[str, Any]) -> tuple[int, int, int, bool]:
    return (int(llm["num_hidden_layers"]), int(llm["num_attention_heads"]),
            int(llm.get("num_key_value_heads", llm["num_attention_heads"])), bool(llm.get("qk_norm", True)))


def _megatron_shape(m: DecoderMapping, parts: list[tuple[int, ...]]) -> tuple[int, ...]:
    if m.kind == "copy":
        return parts[0]
    return (sum(p[0] for p in parts), *parts[0][1:])


def bagel_to_mcore(source: str | Path, output: str | Path, *, max_file_bytes: int = DEFAULT_FILE_BYTES) -> int:
    """Convert a BAGEL folder into a Megatron distributed checkpoint; returns the number of tensors written.
    Raises `CheckpointError` naming the tensor or file on bad input, before anything is written."""
    src = Path(source)
    configs = _read_configs(src)
    weights = SafetensorsFolder(src, prefix="ema")
    n_layers, heads, groups, qk_norm = _geometry(configs["llm_config"])
    mappings = all_mappings(n_layers, qk_norm)
    expected = {n for m in mappings for n in m.hf}
    missing = sorted(expected - set(weights.entries))
    if missing:
        raise CheckpointError(f"{src}/ema.safetensors: missing tensors {missing[:8]} ({len(missing)} of "
                              f"{len(expected)}; llm_config.json says {n_layers} layers)")
    extra = sorted(n for n in weights.entries if n not in expected and not n.startswith(FROZEN_PREFIXES))
    if extra:
        raise CheckpointError(f"{src}/ema.safetensors: unexpected tensors {extra[:8]} (not part of a BAGEL model "
                              f"with this llm_config.json)")
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    by_key: dict[str, DecoderMapping] = {}
    for m in mappings:
        parts = [weights.entries[n] for n in m.hf]
        if len({e.dtype for e in parts}) != 1:
            raise CheckpointError(f"tensors {list(m.hf)} are fused into {m.megatron} but have different dtypes")
        specs[m.megatron] = (_megatron_shape(m, [tuple(e.shape) for e in parts]), parts[0].dtype)
        by_key[m.megatron] = m
    for name, e in weights.entries.items():
        if name.startswith(FROZEN_PREFIXES):
            specs[FROZEN + name] = (tuple(e.shape), e.dtype)

    def produce(key: str) -> torch.Tensor:
        if key.startswith(FROZEN):
            return weights.read(key[len(FROZEN):])
        m = by_key[key]
        return hf_to_megatron_shard(m, [weights.read(n) for n in m.hf], heads, groups, 0, 1)

    with staged_output(output) as tmp, single_process_group():
        save_streaming(tmp, specs, produce, content_metadata(FAMILY, configs["config"], {"tp": 1, "pp": 1},
                                                             bagel_configs=configs, source=str(src)),
                       max_file_bytes=max_file_bytes)
    return len(specs)


def is_bagel_source(path: str | Path) -> bool:
    """Whether `path` is a BAGEL folder (`ema.safetensors` beside `llm_config.json`) or a checkpoint converted
    from one (its content metadata names the family)."""
    p = Path(path)
    if (p / "ema.safetensors").is_file() and (p / "llm_config.json").is_file():
        return True
    if not (p / ".metadata").is_file():
        return False
    try:
        return read_content_metadata(p).get("family") == FAMILY
    except CheckpointError:
        return False


def bagel_base_identity(folder: str | Path) -> dict[str, Any]:
    """What a LoRA checkpoint of a BAGEL run records about its base: the size and CRC-32 of the folder's
    `ema.safetensors` (the weights the adapters were trained on; the folder's path is not part of it, so a moved or
    copied folder still resumes, as a changed file does not)."""
    from megatron_omni.checkpoint import manifest

    weights = Path(folder) / "ema.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{folder} has no ema.safetensors: not a BAGEL folder")
    entry = manifest.file_entry(weights)
    return {"weights": "ema.safetensors", "crc32": entry["crc32"], "bytes": entry["size"]}


def read_bagel_configs(checkpoint: str | Path) -> dict[str, Any]:
    """The BAGEL config files ({'config', 'llm_config', 'vit_config'}) a converted checkpoint records."""
    meta = read_content_metadata(checkpoint)
    if meta.get("family") != FAMILY or "bagel_configs" not in meta:
        raise CheckpointError(f"{checkpoint} is not a BAGEL checkpoint (content metadata family "
                              f"{meta.get('family')!r})")
    return meta["bagel_configs"]


def _hf_shapes(m: DecoderMapping, shape: tuple[int, ...], heads: int, groups: int) -> list[tuple[int, ...]]:
    if m.kind == "copy":
        return [shape]
    if m.kind == "fuse_gate_up":
        return [(shape[0] // 2, *shape[1:])] * 2
    d = shape[0] // (heads + 2 * groups)
    return [(heads * d, *shape[1:]), (groups * d, *shape[1:]), (groups * d, *shape[1:])]


def mcore_to_bagel(source: str | Path, output: str | Path, *, bagel_source: str | Path | None = None,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> int:
    """Convert a BAGEL Megatron checkpoint back to a BAGEL folder; returns the number of tensors written to
    `ema.safetensors`. `bagel_source`: a BAGEL folder whose other files (`ae.safetensors`, tokenizer) are copied."""
    configs = read_bagel_configs(source)
    specs = checkpoint_tensor_specs(source)
    n_layers, heads, groups, qk_norm = _geometry(configs["llm_config"])
    mappings = all_mappings(n_layers, qk_norm)
    missing = [m.megatron for m in mappings if m.megatron not in specs]
    if missing:
        raise CheckpointError(f"{source}: missing tensors {missing[:8]} ({len(missing)})")
    frozen = sorted(k for k in specs if k.startswith(FROZEN))
    plan = [PlannedTensor(n, specs[m.megatron][1], s) for m in mappings
            for n, s in zip(m.hf, _hf_shapes(m, specs[m.megatron][0], heads, groups))]
    plan += [PlannedTensor(k[len(FROZEN):], specs[k][1], specs[k][0]) for k in frozen]
    if bagel_source is not None and not (Path(bagel_source) / "ae.safetensors").is_file():
        raise CheckpointError(f"{bagel_source} has no ae.safetensors to copy")
    by_key = {m.megatron: m for m in mappings}
    buckets = bucket_keys(specs, [[m.megatron] for m in mappings] + [[k] for k in frozen], bucket_bytes)
    with staged_output(output) as tmp, single_process_group():
        for key, name in CONFIG_FILES.items():
            (tmp / name).write_text(json.dumps(configs[key], indent=2))
        writer = SafetensorsStreamWriter(tmp / "ema.safetensors", plan)
        for bucket in load_full_tensors(source, buckets, specs):
            for key, full in bucket.items():
                if key.startswith(FROZEN):
                    writer.write(key[len(FROZEN):], full)
                    continue
                m = by_key[key]
                for name, t in zip(m.hf, megatron_shards_to_hf(m, [full], heads, groups)):
                    writer.write(name, t)
        writer.close()
        if bagel_source is not None:
            for f in sorted(Path(bagel_source).iterdir()):
                if f.is_file() and f.name != "ema.safetensors" and f.name not in CONFIG_FILES.values():
                    shutil.copy2(f, tmp / f.name)
    return len(plan)


@torch.no_grad()
def load_bagel_checkpoint(model, checkpoint: str | Path, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
    """Load a converted BAGEL checkpoint into this rank's `BagelMoT` shards at any TP/PP (collective over the
    job's ranks: every rank walks the same buckets of the checkpoint, reads the full tensors its own stage holds
    and keeps its tensor-parallel slices)."""
    from megatron.core import dist_checkpointing

    from megatron_omni.checkpoint.streaming import full_sharded_tensor
    from model_providers.bagel.provider import local_mappings

    cfg, tp = model.config, model.pg_collection.tp
    specs = checkpoint_tensor_specs(checkpoint)
    local = local_mappings(model)
    params = model.state_dict()
    by_global = {m.megatron: name for name, m in local.items()}
    absent = sorted(set(by_global) - set(specs))
    if absent:
        raise CheckpointError(f"{checkpoint}: missing tensors {absent[:8]} ({len(absent)})")
    # The same bucket sequence on every rank (the loads are collective); a rank requests only its stage's keys,
    # and ranks holding the same tensor read it alike (no single owner: access validation is off).
    keys = [m.megatron for m in all_mappings(*_geometry_of(cfg, model.arch.qk_norm))]
    for bucket in bucket_keys(specs, [[k] for k in keys], bucket_bytes):
        mine = [k for k in bucket if k in by_global]
        sharded = {k: full_sharded_tensor(k, torch.empty(specs[k][0], dtype=specs[k][1])) for k in mine}
        try:
            loaded = dist_checkpointing.load(sharded, str(checkpoint), validate_access_integrity=False)
        except Exception as exc:  # noqa: BLE001 - a damaged checkpoint is bad input
            raise CheckpointError(f"cannot read tensors {mine[:3]} from {checkpoint}: {exc}") from exc
        for key in mine:
            m = local[by_global[key]]
            hf = megatron_shards_to_hf(m, [loaded[key]], cfg.num_attention_heads, cfg.num_query_groups)
            shard = hf_to_megatron_shard(m, hf, cfg.num_attention_heads, cfg.num_query_groups, tp.rank(), tp.size())
            params[by_global[key]].copy_(shard)


def _geometry_of(cfg, qk_norm: bool) -> tuple[int, bool]:
    return cfg.num_layers, qk_norm


def bagel_sharded_state_dict(model) -> dict[str, Any]:
    """This rank's `ShardedStateDict` of a `BagelMoT` stage (the trainer's checkpoints), keyed by local name,
    each tensor under its global Megatron name: tp-split tensors sharded along their mapping's dim (the fused
    SwiGLU fc1 as Megatron-Core's gate/up factory, so it reshards over TP), the rest replicated over tp. The data
    is the parameter itself, so Megatron's optimizer maps its state onto these keys and loading writes in place."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from model_providers.bagel.provider import local_mappings

    pg = model.pg_collection
    tp_rank, tp_size, dp_rank = pg.tp.rank(), pg.tp.size(), pg.dp_cp.rank()
    params = model.state_dict(keep_vars=True)
    out: dict[str, Any] = {}
    for name, m in local_mappings(model).items():
        t = params[name]
        if m.tp_dim is None:
            sh = ShardedTensor.from_rank_offsets(m.megatron, t, replica_id=(0, tp_rank, dp_rank))
        else:
            sh = ShardedTensor.from_rank_offsets(m.megatron, t, (m.tp_dim, tp_rank, tp_size),
                                                 replica_id=(0, 0, dp_rank))
        out[name] = apply_swiglu_sharded_factory(sh, ()) if m.kind == "fuse_gate_up" else sh
    return out
