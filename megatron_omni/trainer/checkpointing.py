"""Training checkpoints in Megatron-Core's distributed checkpoint format (torch_dist), written atomically.

A checkpoint is one `dist_checkpointing` folder, `checkpoints/step_XXXXXX`, holding
- the model: every parameter as a `ShardedTensor` under its global Megatron name (the converter's format,
  so `mcore-to-hf` and `inspect` read a training checkpoint too), with the content metadata; an AR-DiT
  hybrid's trainer passes `checkpoint.sharded_state.ar_dit_sharded_state_dict` instead (its fused SwiGLU as
  Megatron-Core's gate/up factory, not the hybrid converter's separate `.gate`/`.up` tensors);
- the optimizer: Megatron's `optimizer.sharded_state_dict(model_sharded_state_dict)` (Adam moments as
  tensors in model space; the distributed optimizer's "fully_reshardable" format), so both reshard on
  load: a run saved at TP=2 resumes at TP=1 (or another data-parallel size) with the same weights and optimizer state;
- the RNG states of every rank (torch CPU generator, Python, NumPy, the model-parallel tracker) as one
  `ShardedObject` per rank; restored only when the job has the same world size (a different layout
  cannot continue the same random streams anyway);
- with `optim.ema_decay`, the EMA of the weights: the model's sharded tensors under `ema.` + name (so
  `mcore-to-hf --prefix ema.` exports it as a diffusers transformer); other frozen copies a trainer keeps
  (DiffusionNFT's lagging old policy) likewise under their own name + `.`;
- common state written once: scheduler, step, data position, metric history, world size;
- objects one rank alone holds (`objects=`: the asynchronous trainer root's in-flight steps, `ASYNC_IN_FLIGHT`),
  each one `ShardedObject` under its key.

It is written into `step_XXXXXX.tmp` and renamed when every rank has finished. Before the rename the
folder gets `RUN_ID` (the run that wrote it), `MANIFEST.json` (every file's size and CRC-32, see
`checkpoint.manifest`; each rank checksums the files it wrote) and last the `COMPLETE` marker (world size
inside), so a folder without it (a crash mid-save) is never resumed from, and a complete one whose files no
longer match their manifest (truncated, damaged) is skipped by name for the newest intact one. The last
`keep` complete checkpoints of the current run are kept; another run's are never touched. A save that fails
(a full disk) removes its partial folder and raises CheckpointWriteError; the previous checkpoint is intact.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.utils import add_prefix_for_sharding
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_omni.checkpoint import CheckpointError, manifest
from megatron_omni.checkpoint.sharded_state import model_sharded_state_dict, synchronous_write_results
from megatron_omni.trainer.checkpoint_folders import (
    COMPLETE,
    RUN_ID,
    checkpoint_dir,
    checkpoints_to_prune,
    damage,
    latest_complete,
)
from megatron_omni.trainer.config import ConfigError

ModelShardedState = Callable[[torch.nn.Module], ShardedStateDict]

# The distributed optimizer's state in model space (one tensor per parameter and moment, like the plain
# optimizer's), gathered over data parallel on save: it reloads at any TP/DP. (megatron-core 0.16.1 no longer
# supports the gather-free "fully_sharded_model_space"; "dp_reshardable" cannot change TP.)
OPTIMIZER_SHARDING = "fully_reshardable"
RNG_KEY = "trainer.rng_state"
# The asynchronous trainer root's steps sampled ahead of the checkpoint ({step: Trajectory}): a resume trains on
# them instead of sampling them again with a policy version it no longer holds.
ASYNC_IN_FLIGHT = "async.in_flight"
EMA_PREFIX = "ema."


class CheckpointWriteError(ConfigError):
    """A checkpoint could not be written (a full disk, no permission): like a bad input, one line and exit 2;
    the partial folder is gone and the previous checkpoint intact."""


def _reason(exc: BaseException) -> str:
    """The root OSError's text when there is one (Megatron and torch DCP wrap the writer's error)."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return f"{seen.strerror or seen} ({seen.filename})" if seen.filename else str(seen.strerror or seen)
        failures = getattr(seen, "failures", None)  # torch DCP's CheckpointException: {rank: the rank's error}
        if isinstance(failures, dict) and failures:
            first = next(iter(failures.values()))
            seen = first[0] if isinstance(first, tuple) else first
            continue
        seen = seen.__cause__ or seen.__context__
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


def rng_state() -> dict[str, Any]:
    """This rank's random states: torch CPU generator, Python, NumPy and Megatron's model-parallel tracker."""
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "tracker": get_cuda_rng_tracker().get_states()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _ensure_optimizer_state(optimizer: Any) -> None:
    """The distributed optimizer describes its state from existing moment tensors (and, without apex/TE,
    a recorded step): a fresh one gets Megatron's placeholder state first (one zero-gradient step; the load
    then overwrites parameters, moments and step)."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and not opt.optimizer.state:
            opt._init_optimizer_states_with_dummy_values()


def _unshare_adam_steps(optimizer: Any) -> None:
    """Give every parameter its own Adam step counter again. Without apex/TE, megatron-core's distributed
    optimizer restores torch Adam's per-parameter `step` as one tensor shared by all parameters; torch
    increments each parameter's counter in place, so the shared one would advance once per parameter per
    step and Adam's bias correction after a resume would not be the uninterrupted run's."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer):
            for state in opt.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()


def _sharded_training_state(model: torch.nn.Module, optimizer: Any, is_loading: bool,
                            sharded_state: ModelShardedState) -> ShardedStateDict:
    if is_loading:
        _ensure_optimizer_state(optimizer)
    model_sd = sharded_state(model)
    optim_sd = optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                            metadata={"distrib_optim_sharding_type": OPTIMIZER_SHARDING})
    return {"model": model_sd, "optimizer": optim_sd}


def _copy_sharded_state(copy: torch.nn.Module, sharded_state: ModelShardedState, name: str) -> ShardedStateDict:
    """A frozen copy's sharded tensors (the EMA's, `ema`): the model's layout, keys prefixed with `name.`."""
    state = sharded_state(copy)
    add_prefix_for_sharding(state, name + ".")
    return state


def _copies(ema: torch.nn.Module | None, copies: dict[str, torch.nn.Module] | None) -> dict[str, torch.nn.Module]:
    """Every frozen copy a checkpoint holds besides the model, by name (the EMA as `ema`)."""
    out = dict(copies or {})
    if "ema" in out or "model" in out:
        raise ValueError("a frozen copy may not be named 'ema' (pass it as ema=) or 'model'")
    return {**({"ema": ema} if ema is not None else {}), **out}


def _rng_object(state: Any, world: int, rank: int) -> ShardedObject:
    return ShardedObject(RNG_KEY, state, (world,), (rank,), replica_id=0)


def _own_object(key: str, value: Any) -> ShardedObject:
    """An object that one rank alone holds (the whole of it, one shard)."""
    return ShardedObject(key, value, (1,), (0,), replica_id=0)


def save_checkpoint(run_dir: Path, step: int, model: torch.nn.Module | None, optimizer: Any, scheduler: Any,
                    common: dict[str, Any], keep: int, content_metadata: dict[str, Any] | None = None,
                    sharded_state: ModelShardedState = model_sharded_state_dict,
                    ema: torch.nn.Module | None = None, run_id: str | None = None,
                    copies: dict[str, torch.nn.Module] | None = None,
                    objects: dict[str, Any] | None = None) -> Path:
    """Collective: save model, optimizer, scheduler, RNG states, `common` (step, data position, metric
    history: rank 0's copy is written), the `ema` copy of the model if given and the other frozen `copies` by
    name, as the checkpoint after `step` steps; prune to the last `keep`.
    `sharded_state` gives the model's ShardedStateDict (default: the MMDiT's; the AR-DiT hybrid passes
    `ar_dit_sharded_state_dict`). `run_id`: recorded in the checkpoint; pruning then removes only
    checkpoints of that run (None: those without a run id). `model` None (optimizer and scheduler None too): this
    rank holds no training state (a rollout rank of a disaggregated job) and joins with its RNG states.

    Returns the final folder (complete when this returns on any rank).
    """
    if keep < 1:
        raise ValueError(f"checkpoint.keep={keep}: at least one checkpoint must be kept")
    rank, world = dist.get_rank(), dist.get_world_size()
    final = checkpoint_dir(run_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a crash during an earlier save of this step
        tmp.mkdir(parents=True)
    dist.barrier()
    # model None: a rank without training state (a rollout rank of a disaggregated job) joins the collective
    # save with its RNG states only.
    state = ({} if model is None else
             _sharded_training_state(model, optimizer, is_loading=False, sharded_state=sharded_state))
    state["rng"] = _rng_object(rng_state(), world, rank)
    for name, copy in _copies(ema, copies).items():
        state[name] = _copy_sharded_state(copy, sharded_state, name)
    for key, value in (objects or {}).items():
        state[key] = _own_object(key, value)
    state["world_size"] = world
    # Every rank passes rank 0's copy (the one written): per-rank timings in the metric history would
    # otherwise make Megatron's validation warn that the ranks' common state differs.
    shared = [common, scheduler.state_dict() if scheduler is not None else None]
    dist.broadcast_object_list(shared, src=0)
    state["common"], state["scheduler"] = shared
    try:
        synchronous_write_results()
        dist_checkpointing.save(state, str(tmp), content_metadata=content_metadata)
        # Each rank checksums the data files it wrote (torch DCP names them __<rank>_<n>.distcp), in parallel.
        mine = manifest.entries(tmp, [n for n in manifest.content_files(tmp) if n.startswith(f"__{rank}_")])
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            if run_id is not None:
                (tmp / RUN_ID).write_text(run_id + "\n")
            manifest.write_manifest(tmp, {k: v for part in gathered for k, v in part.items()})
            marker = tmp / (COMPLETE + ".partial")
            marker.write_text(f"{world}\n")
            os.replace(marker, tmp / COMPLETE)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    except BaseException as exc:  # SIGTERM's SystemExit and KeyboardInterrupt too: no partial folder is left
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, (KeyboardInterrupt, SystemExit)):  # torch DCP's CheckpointException is a BaseException
            previous = latest_complete(run_dir)
            raise CheckpointWriteError(
                f"could not write checkpoint {final}: {_reason(exc)}; the partial checkpoint was removed, "
                f"{'the previous one ' + str(previous) + ' is intact' if previous else 'no earlier checkpoint'}"
            ) from exc
        raise
    dist.barrier()
    if rank == 0:
        for old in checkpoints_to_prune(run_dir, run_id, keep, final):
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


@torch.no_grad()
def load_checkpoint(folder: Path, model: torch.nn.Module | None, optimizer: Any, scheduler: Any,
                    sharded_state: ModelShardedState = model_sharded_state_dict,
                    ema: torch.nn.Module | None = None, identity: dict[str, Any] | None = None,
                    copies: dict[str, torch.nn.Module] | None = None,
                    objects: tuple[str, ...] = ()) -> dict[str, Any]:
    """Collective: load a complete checkpoint saved at any layout into this rank's model and optimizer
    shards, the scheduler, the `ema` copy and the other frozen `copies` if given (the checkpoint must hold
    them); restore the RNG states
    when the world size matches. Returns `common`. `sharded_state`: as for `save_checkpoint` (the one the
    checkpoint was saved with). `identity`: what the checkpoint's `common["identity"]` must equal (a LoRA
    run's settings and base, `check_identity`), checked before any tensor is read. `model` None (optimizer and
    scheduler None too): a rank without training state (a disaggregated job's rollout rank) joins for its RNG
    states. `objects`: keys saved with `save_checkpoint(objects=...)` that this rank reads; when given they come back
    under the returned dict's "objects" (the checkpoint must hold them)."""
    folder = Path(folder)
    if not (folder / COMPLETE).is_file():
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker)")
    problem = damage(folder)
    if problem is not None:
        raise CheckpointError(problem)
    rank, world = dist.get_rank(), dist.get_world_size()
    saved = dist_checkpointing.load_common_state_dict(str(folder))
    if identity is not None:
        check_identity(saved["common"].get("identity"), identity, folder)
    state = ({} if model is None else
             _sharded_training_state(model, optimizer, is_loading=True, sharded_state=sharded_state))
    same_world = saved["world_size"] == world
    if same_world:
        state["rng"] = _rng_object(None, world, rank)
    for key in objects:
        state[key] = _own_object(key, None)
    held = _copies(ema, copies)
    for name, copy in held.items():
        state[name] = _copy_sharded_state(copy, sharded_state, name)
    available = dist_checkpointing.load_tensors_metadata(str(folder))
    wanted = [t.key for t in nested_values(state) if isinstance(t, ShardedTensor)]
    missing = sorted(k for k in wanted if k not in available)
    if any(k.startswith(EMA_PREFIX) for k in missing):
        raise RuntimeError(f"{folder} holds no EMA of the weights (saved without optim.ema_decay); this job keeps "
                           f"one: resume it with optim.ema_decay=0 or start it anew")
    for name in held:
        if any(k.startswith(name + ".") for k in missing):
            raise RuntimeError(f"{folder} holds no {name} copy of the weights, which this job keeps (saved with "
                               "other algorithm settings?); start it anew")
    if missing:
        raise RuntimeError(f"{folder} lacks {len(missing)} tensors this job needs, e.g. {missing[:4]} (saved with "
                           f"another optim.distributed_optimizer setting or another model?)")
    loaded = dist_checkpointing.load(state, str(folder))
    asked = {"objects": {key: loaded[key] for key in objects}} if objects else {}
    if model is None:
        if same_world:
            set_rng_state(loaded["rng"])
        return {**saved["common"], **asked}
    for name, module in (("model", model), *held.items()):
        result = module.load_state_dict({k: loaded[name][k] for k in state[name]}, strict=False)
        # A LoRA run's sharded state holds the adapters only: its frozen base comes from the pipeline folder
        # (whose identity the run loop checks), so only parameters that train must be in the checkpoint.
        trained = {n for n, p in module.named_parameters() if p.requires_grad} or None
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")
                   and (trained is None or k in trained)]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"loading {folder} ({name}): missing {missing}, unexpected {result.unexpected_keys}")
    optimizer.load_state_dict(loaded["optimizer"])
    _unshare_adam_steps(optimizer)
    scheduler.load_state_dict(loaded["scheduler"])
    if same_world:
        set_rng_state(loaded["rng"])
    elif rank == 0:
        print(f"{folder} was saved by {saved['world_size']} ranks, this job has {world}: weights and optimizer "
              f"state resharded, random streams start fresh")
    return {**loaded["common"], **asked}


def read_common(folder: Path) -> dict[str, Any]:
    """A checkpoint's common state (step, data position, metric history, ...), read on this rank alone."""
    return dist_checkpointing.load_common_state_dict(str(folder))["common"]


def check_identity(saved: dict[str, Any] | None, current: dict[str, Any], folder: Path) -> None:
    """A checkpoint's recorded identity (`saved`, from its common state; None for one written before
    identities were recorded) against this job's; raises ConfigError naming what differs."""
    saved = saved or {}
    for key in sorted(set(saved) | set(current)):
        if saved.get(key) != current.get(key):
            raise ConfigError(f"--resume {folder}: its {key} is {saved.get(key)!r}, this job's is "
                              f"{current.get(key)!r}; resume with the same settings and base, or start a new run")


def read_checkpoint_tensors(folder: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The full (unsharded) tensors of a checkpoint, read in this process without process groups:
    {"model": {megatron name: tensor}, "optimizer": {"exp_avg.<name>" | "exp_avg_sq.<name>": tensor}}.
    For tests and inspection of small models (everything is held in memory at once)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(folder)
    if not (folder / COMPLETE).is_file():
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker)")
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(str(folder), os.path.join(tmp, "full.pt"))
        flat = torch.load(os.path.join(tmp, "full.pt"), weights_only=False)
    out: dict[str, dict[str, torch.Tensor]] = {"model": {}, "optimizer": {}}
    for key, value in flat.items():
        if not torch.is_tensor(value):
            continue  # per-rank RNG objects
        if key.startswith("optimizer.state."):
            out["optimizer"][key.removeprefix("optimizer.state.")] = value
        else:
            out["model"][key] = value
    return out
