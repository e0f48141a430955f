"""Megatron-Core distributed checkpoints of a DiT (`MMDiTModel`, `WanModel`: any family's `megatron_module`) at any
TP/PP/CP layout.

Every tensor is saved under its global Megatron name (block index over all pipeline stages, from the model's
family's mapping), as a `ShardedTensor` placed at its tensor-parallel offset along the mapping's
`tp_dim`. Replicated copies carry replica ids so exactly one rank writes each byte:
`replica_id = (pp_rank if the tensor is on every stage else 0, tp_rank if replicated over tp else 0,
rank in dp x cp)`; Megatron writes only the all-zero replica. A checkpoint saved at one layout therefore
loads at any other (the torch_dist format reshards on load).

The checkpoint's content metadata (`dist_checkpointing.load_content_metadata`) records what the tensors
are: model family, the full diffusers config, and the layout it was saved at. The converter and the
trainer both write it, so `mcore-to-hf` and `inspect` work on either.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async

from megatron_omni.checkpoint.errors import CheckpointError
from megatron_omni.models.dit.model import DiTStage
from model_providers import shards
from model_providers.registry import family_of_model

CONTENT_KEY = "megatron_omni_model"
FORMAT_VERSION = 1
AR_DIT_CONTENT_KEY = "megatron_omni_ar_dit"
# 2: one layout for converter and training checkpoints (`ar_dit_sharded_state_dict`); 1 stored the decoder's
# SwiGLU fc1 as two tensors (.gate, .up) and only the converter wrote it.
AR_DIT_FORMAT_VERSION = 2


def content_metadata(family: str, diffusers_config: dict[str, Any], layout: dict[str, int],
                     **extra: Any) -> dict[str, Any]:
    """The content metadata to pass to `dist_checkpointing.save(..., content_metadata=...)`."""
    return {CONTENT_KEY: {"format_version": FORMAT_VERSION, "family": family,
                          "diffusers_config": dict(diffusers_config), "layout": dict(layout), **extra}}


def read_content_metadata(checkpoint_dir: str | Path) -> dict[str, Any]:
    """Our entry of a checkpoint's content metadata: family, diffusers_config, layout."""
    ckpt = str(checkpoint_dir)
    require_dist_checkpoint(ckpt)
    try:
        meta = dist_checkpointing.load_content_metadata(ckpt)
    except Exception as exc:  # noqa: BLE001 - any unreadable common state is bad input
        raise CheckpointError(f"cannot read the content metadata of {ckpt}: {exc}") from exc
    entry = (meta or {}).get(CONTENT_KEY)
    if not entry:
        raise CheckpointError(f"{ckpt} carries no {CONTENT_KEY!r} content metadata (family and diffusers "
                              f"config); pass the diffusers config.json explicitly")
    return entry


def require_dist_checkpoint(checkpoint_dir: str | Path) -> None:
    """Raise unless `checkpoint_dir` is a Megatron distributed checkpoint folder."""
    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder")
    if not dist_checkpointing.check_is_distributed_checkpoint(str(path)):
        raise CheckpointError(f"{path} is not a Megatron distributed checkpoint (no metadata.json)")
    if not (path / ".metadata").is_file():
        raise CheckpointError(f"{path} has no torch_dist .metadata file: incomplete checkpoint")


def model_layout(model: DiTStage) -> dict[str, int]:
    """The layout a model was built for (recorded in the checkpoint for `inspect`)."""
    pg = model.pg_collection
    return {"tp": pg.tp.size(), "pp": pg.pp.size(), "cp": pg.cp.size(), "dp": pg.dp.size()}


def model_sharded_state_dict(model: DiTStage, prefix: str = "") -> ShardedStateDict:
    """This rank's `ShardedStateDict` of `model`, keyed by local parameter name.

    Each value is a ShardedTensor of key `prefix + global Megatron name`, global shape = the full
    tensor, local data = this rank's shard (the parameter itself, so loading writes in place).
    """
    pg = model.pg_collection
    tp_rank, tp_size = pg.tp.rank(), pg.tp.size()
    pp_rank = pg.pp.rank()
    dp_rank = pg.dp_cp.rank()
    family = family_of_model(model)
    mappings = shards.local_mappings(model, family.mappings_for(model.config))
    out: ShardedStateDict = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue  # the local spec has none; TE's FP8 metadata is not part of the weights
        m = mappings[name]
        pp_replica = pp_rank if m.stage == "all" else 0
        key = prefix + m.megatron
        if m.tp_dim is None:
            out[name] = ShardedTensor.from_rank_offsets(key, tensor, replica_id=(pp_replica, tp_rank, dp_rank))
        else:
            out[name] = ShardedTensor.from_rank_offsets(key, tensor, (m.tp_dim, tp_rank, tp_size),
                                                        replica_id=(pp_replica, 0, dp_rank))
    return out


def synchronous_write_results() -> None:
    """Collect Megatron's checkpoint write results in this process (call before `dist_checkpointing.save`).

    Megatron-Core's torch_dist writer hands its results through a queue made by a *spawned*
    `multiprocessing.Manager` the first time a process saves, so that an asynchronous save (run in another process)
    can reach it. A spawned process re-imports the caller's `__main__` (the trainer entry point: torch and
    megatron-core again), 5-13 s on two cores, and the first save waits for it. Our saves are synchronous: the
    writer puts and gets its results in the saving process itself (`write_preloaded_data_multiproc` puts,
    `retrieve_write_results` gets), so a plain in-process queue carries them with nothing started. An asynchronous
    save (none here) would need Megatron's own queue back."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def save_model_checkpoint(model: DiTStage, checkpoint_dir: str | Path, family: str,
                          diffusers_config: dict[str, Any], prefix: str = "") -> None:
    """Save `model` (all ranks call this) with its content metadata. The folder is created here."""
    ckpt = str(checkpoint_dir)
    if dist.get_rank() == 0:
        os.makedirs(ckpt, exist_ok=True)
    dist.barrier()
    synchronous_write_results()
    dist_checkpointing.save(
        model_sharded_state_dict(model, prefix), ckpt,
        content_metadata=content_metadata(family, diffusers_config, model_layout(model)),
    )


@torch.no_grad()
def load_model_checkpoint(model: DiTStage, checkpoint_dir: str | Path, prefix: str = "") -> None:
    """Load a checkpoint saved at any layout into this rank's shards of `model` (all ranks call this)."""
    ckpt = str(checkpoint_dir)
    require_dist_checkpoint(ckpt)
    sharded = model_sharded_state_dict(model, prefix)
    available = dist_checkpointing.load_tensors_metadata(ckpt)
    missing = sorted(st.key for st in sharded.values() if st.key not in available)
    if missing:
        raise CheckpointError(f"{ckpt} lacks tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    for st in sharded.values():
        if tuple(available[st.key].global_shape) != tuple(st.global_shape):
            raise CheckpointError(f"{ckpt}: tensor {st.key} has shape {tuple(available[st.key].global_shape)}, "
                                  f"the model expects {tuple(st.global_shape)}")
    loaded = dist_checkpointing.load(sharded, ckpt)
    # load() also returns the checkpoint's common state (its content metadata): keep the parameters only.
    result = model.load_state_dict({k: loaded[k] for k in sharded}, strict=False)
    missing_params = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing_params or result.unexpected_keys:
        raise CheckpointError(f"loading {ckpt}: missing {missing_params}, unexpected {result.unexpected_keys}")


def ar_dit_sharded_state_dict(model: Any) -> ShardedStateDict:
    """This rank's `ShardedStateDict` of an AR-DiT hybrid (`ARDiTModel`, pp = 1), keyed by local name: decoder
    tensors under `decoder.` + their global Megatron name, the fused SwiGLU fc1 as Megatron-Core's gate/up
    factory (global tensor [gate; up], so it reshards over TP like the other tp-split tensors); the connector
    replicated; the DiT as `model_sharded_state_dict` under `dit.`. Each value's data is the parameter itself,
    so Megatron's optimizer maps its state onto these keys and loading writes in place."""
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    from model_providers.ar_dit.decoder_provider import local_mappings as decoder_mappings

    pg = model.pg_collection
    tp_rank, tp_size, dp_rank = pg.tp.rank(), pg.tp.size(), pg.dp_cp.rank()
    out: ShardedStateDict = {}
    params = model.decoder.state_dict(keep_vars=True)
    for name, m in decoder_mappings(model.decoder).items():
        key, t = "decoder." + m.megatron, params[name]
        if m.tp_dim is None:
            sh = ShardedTensor.from_rank_offsets(key, t, replica_id=(0, tp_rank, dp_rank))
        else:
            sh = ShardedTensor.from_rank_offsets(key, t, (m.tp_dim, tp_rank, tp_size), replica_id=(0, 0, dp_rank))
        out["decoder." + name] = apply_swiglu_sharded_factory(sh, ()) if m.kind == "fuse_gate_up" else sh
    return out | ar_dit_connector_and_dit_sharded(model)


def ar_dit_connector_and_dit_sharded(model: Any) -> ShardedStateDict:
    """The connector (replicated, under `connector.`) and the DiT (`model_sharded_state_dict` under `dit.`) of
    an AR-DiT hybrid, keyed by local name: the part both hybrid checkpoint formats share."""
    pg = model.pg_collection
    tp_rank, dp_rank = pg.tp.rank(), pg.dp_cp.rank()
    out: ShardedStateDict = {}
    for name, t in model.connector.state_dict(keep_vars=True).items():
        out["connector." + name] = ShardedTensor.from_rank_offsets("connector." + name, t,
                                                                   replica_id=(0, tp_rank, dp_rank))
    for name, sh in model_sharded_state_dict(model.dit, prefix="dit.").items():
        out["dit." + name] = sh
    return out


def ar_dit_content_metadata(hybrid_config: dict[str, Any]) -> dict[str, Any]:
    """Content metadata of an AR-DiT checkpoint (converter or trainer): the hybrid config."""
    return {AR_DIT_CONTENT_KEY: {"format_version": AR_DIT_FORMAT_VERSION, "config": dict(hybrid_config)}}


def read_ar_dit_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    """The hybrid config an AR-DiT checkpoint records; raises CheckpointError for anything else."""
    ckpt = str(checkpoint_dir)
    require_dist_checkpoint(ckpt)
    entry = (dist_checkpointing.load_content_metadata(ckpt) or {}).get(AR_DIT_CONTENT_KEY)
    if not entry:
        raise CheckpointError(f"{ckpt} is not an AR-DiT checkpoint (no {AR_DIT_CONTENT_KEY!r} content metadata)")
    if entry.get("format_version") != AR_DIT_FORMAT_VERSION:
        raise CheckpointError(f"{ckpt} has AR-DiT format version {entry.get('format_version')}, this code reads "
                              f"{AR_DIT_FORMAT_VERSION}: convert it again from its Hugging Face folder")
    return entry["config"]


@torch.no_grad()
def load_ar_dit_weights(model: Any, checkpoint_dir: str | Path) -> None:
    """Collective: this rank's shards of an AR-DiT hybrid's weights from a converter or training checkpoint
    saved at any tp (a training checkpoint's optimizer state is not read). Raises CheckpointError naming a
    missing or mis-shaped tensor."""
    ckpt = str(checkpoint_dir)
    read_ar_dit_config(ckpt)
    sharded = ar_dit_sharded_state_dict(model)
    available = dist_checkpointing.load_tensors_metadata(ckpt)
    for sh in sharded.values():
        if sh.key not in available:
            raise CheckpointError(f"{ckpt} lacks tensor {sh.key}")
        shape = getattr(sh, "global_shape", None)  # a SwiGLU factory's global shape is checked by the load
        if shape is not None and tuple(available[sh.key].global_shape) != tuple(shape):
            raise CheckpointError(f"{ckpt}: {sh.key} has shape {tuple(available[sh.key].global_shape)}, the model "
                                  f"expects {tuple(shape)}")
    loaded = dist_checkpointing.load(sharded, ckpt)  # also returns the checkpoint's content metadata
    result = model.load_state_dict({k: loaded[k] for k in sharded}, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise CheckpointError(f"loading {ckpt}: missing {missing}, unexpected {result.unexpected_keys}")
