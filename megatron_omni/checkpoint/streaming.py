"""Bounded-memory writing and reading of full-tensor Megatron distributed checkpoints in one process.

Conversions run as a single process (a 1-rank process group) and save full tensors as ShardedTensors
whose global shape is the full shape, so any TP/PP/CP layout loads them.

Writing: `dist_checkpointing.save` wants every tensor in memory when it is called. Here the sharded state
dict holds shape-only ("meta") placeholders and `StreamingSaveStrategy` — a torch_dist save strategy, so
Megatron still validates, writes common.pt, metadata.json and the DCP metadata — produces each tensor
only when torch DCP's writer asks for its bytes (`SavePlanner.resolve_data`). DCP's file writer keeps
the tensors of one output file alive until the file is closed, so tensors are grouped into files of at
most `max_file_bytes`, each written by its own DCP write call (within one call DCP's file loop would keep a file's
last tensor alive while the next file's first is produced): peak memory is one file's worth, or the largest tensor,
whatever the model size.

Reading: `load_full_tensors` reads groups of keys whose total size is at most `bucket_bytes` and yields the
tensors group by group, through torch DCP's public `load` with Megatron's own pieces (its key grouping, its
PyTorch-side ShardedTensor wrappers, its `MCoreLoadPlanner`, which checks global shapes), so a checkpoint saved
at any layout is read as `dist_checkpointing.load` would read it. DCP's file reader `torch.load`s each stored
chunk into fresh memory and then copies it into the requested tensor, so a tensor briefly exists twice: for a
tensor bigger than a bucket (SD3.5's 0.45 GB sincos table `pos_embed`) that doubled the peak. The reader passed
to `load` is `DirectFileSystemReader`: it reads a stored chunk that is the whole requested tensor straight into
it instead (`torch.load` to the meta device gives the storage's offset in the file without reading it); other
requests take DCP's own path. (`dist_checkpointing.load` takes no reader, hence `dcp.load` here.)
"""

from __future__ import annotations

import contextlib
import queue
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
    CachedMetadataFileSystemReader,
)
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner,
    MCoreSavePlanner,
    _replace_state_dict_keys_with_sharded_keys,
    mcore_to_pyt_state_dict,
)
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.futures import Future

from megatron_omni.checkpoint.errors import CheckpointError

DEFAULT_FILE_BYTES = 256 * 2**20
DEFAULT_BUCKET_BYTES = 256 * 2**20
_READ_CHUNK = 64 * 2**20  # bytes per readinto: bounds the file object's own buffering


@contextlib.contextmanager
def single_process_group() -> Iterator[None]:
    """A one-rank default process group for the duration (reused if one already exists).

    No backend is named: torch then gives CPU tensors gloo and, where present, CUDA tensors NCCL; the
    conversion only moves CPU tensors.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise CheckpointError(f"conversion runs in one process; this job has {dist.get_world_size()} ranks")
        yield
        return
    with tempfile.TemporaryDirectory(prefix="megatron-omni-pg-") as tmp:
        dist.init_process_group(init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def full_sharded_tensor(key: str, data: torch.Tensor) -> ShardedTensor:
    """A ShardedTensor holding the whole tensor (global shape = local shape), written by this rank."""
    return ShardedTensor.from_rank_offsets(key, data, replica_id=0)


# ------------------------------------------------------------------------------------------------ writing


def _item_bytes(item: WriteItem) -> int:
    td = item.tensor_data
    n = 1
    for s in td.chunk.sizes:
        n *= s
    return n * td.properties.dtype.itemsize


class _BoundedFileWriter(FileSystemWriter):
    """DCP's file writer with files of bounded size, written by one thread in plan order."""

    def __init__(self, path: str, max_file_bytes: int) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)
        self.max_file_bytes = max_file_bytes

    def write_data(self, plan: SavePlan, planner: SavePlanner):  # noqa: ANN201 - torch's Future type
        buckets: list[list[WriteItem]] = [[]]
        size = 0
        for item in plan.items:
            n = _item_bytes(item) if item.type != WriteItemType.BYTE_IO else 0
            if buckets[-1] and size + n > self.max_file_bytes:
                buckets.append([])
                size = 0
            buckets[-1].append(item)
            size += n
        # One DCP write call per file: DCP's file loop keeps the last tensor of a file in a local variable until
        # the next file's first tensor has been produced, so in one call a big tensor that ends a file (SD3.5's
        # 0.45 GB sincos table) was still alive beside the next one; a returned call holds nothing.
        results = []
        for i, bucket in enumerate(buckets):
            file_name = f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}"
            file_queue: queue.Queue = queue.Queue()
            file_queue.put((self.fs.concat_path(self.path, file_name), file_name, bucket))
            results += self._write_data(planner, file_queue).wait()
        done: Future = Future()
        done.set_result(results)
        return done


class _ProducingPlanner(MCoreSavePlanner):
    """Megatron's save planner, except tensor bytes come from `produce(key)` when the writer needs them."""

    def __init__(self, produce: Callable[[str], torch.Tensor], **kwargs) -> None:
        super().__init__(**kwargs)
        self.produce = produce

    def resolve_data(self, write_item: WriteItem):  # noqa: ANN201 - tensor or BytesIO
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        key = write_item.index.fqn
        tensor = self.produce(key)
        props = write_item.tensor_data.properties
        if tensor.dtype != props.dtype or tuple(tensor.shape) != tuple(write_item.tensor_data.size):
            raise CheckpointError(f"tensor {key}: produced {tensor.dtype} {tuple(tensor.shape)}, planned "
                                  f"{props.dtype} {tuple(write_item.tensor_data.size)}")
        return tensor.contiguous()


class StreamingSaveStrategy(SaveShardedStrategy):
    """A torch_dist save strategy for full tensors produced on demand (one process).

    The sharded state dict passed to `dist_checkpointing.save` must hold `full_sharded_tensor(key,
    torch.empty(shape, dtype=dtype, device="meta"))` placeholders; `produce(key)` returns the real tensor.
    """

    def __init__(self, produce: Callable[[str], torch.Tensor], max_file_bytes: int = DEFAULT_FILE_BYTES) -> None:
        super().__init__("torch_dist", 1)
        self.produce = produce
        self.max_file_bytes = max_file_bytes

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict, checkpoint_dir: Path) -> None:  # noqa: ANN001 - Megatron's signature
        if dist.get_world_size() != 1:
            raise CheckpointError("StreamingSaveStrategy writes full tensors from a single process")
        grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
        pyt_state_dict = mcore_to_pyt_state_dict(grouped, False)
        planner = _ProducingPlanner(self.produce, dedup_replicated_tensors=False, flatten_state_dict=False)
        dcp.save(pyt_state_dict, storage_writer=_BoundedFileWriter(str(checkpoint_dir), self.max_file_bytes),
                 planner=planner)


def save_streaming(checkpoint_dir: str | Path, specs: dict[str, tuple[tuple[int, ...], torch.dtype]],
                   produce: Callable[[str], torch.Tensor], content_metadata: dict,
                   max_file_bytes: int = DEFAULT_FILE_BYTES) -> None:
    """Write a full-tensor distributed checkpoint of `specs` ({key: (shape, dtype)}) into an existing,
    empty folder; `produce(key)` is called once per key, as late as possible."""
    sharded = {k: full_sharded_tensor(k, torch.empty(shape, dtype=dtype, device="meta"))
               for k, (shape, dtype) in specs.items()}
    dist_checkpointing.save(sharded, str(checkpoint_dir), sharded_strategy=StreamingSaveStrategy(produce,
                            max_file_bytes), content_metadata=content_metadata)


# ------------------------------------------------------------------------------------------------ reading


def checkpoint_tensor_specs(checkpoint_dir: str | Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (global shape, dtype)} of every tensor in a distributed checkpoint, without reading data."""
    try:
        meta = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
    except Exception as exc:  # noqa: BLE001 - corrupt metadata is bad input
        raise CheckpointError(f"cannot read the tensor metadata of {checkpoint_dir}: {exc}") from exc
    return {k: (tuple(st.global_shape), st.dtype) for k, st in meta.items()}


def bucket_keys(specs: dict[str, tuple[tuple[int, ...], torch.dtype]], keys: list[list[str]],
                bucket_bytes: int) -> list[list[str]]:
    """Concatenate the key groups `keys` (kept whole: e.g. the tensors one conversion step needs) into
    buckets of about `bucket_bytes`."""
    out: list[list[str]] = [[]]
    size = 0
    for group in keys:
        n = sum(torch.Size(specs[k][0]).numel() * specs[k][1].itemsize for k in group)
        if out[-1] and size + n > bucket_bytes:
            out.append([])
            size = 0
        out[-1].extend(group)
        size += n
    return [b for b in out if b]


class DirectFileSystemReader(CachedMetadataFileSystemReader):
    """Megatron's torch_dist file reader, except that a stored chunk which is the whole requested tensor (a full
    tensor saved by the converter, a replicated one saved by training) is read from the file straight into the
    requested tensor, without DCP's intermediate copy. Anything else (a slice of a chunk, a compressed chunk, a
    non-contiguous target, a big-endian host) goes through DCP's reader. `direct_bytes` counts what the direct path
    read."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self.direct_bytes = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):  # noqa: ANN201 - torch's Future type
        rest = []
        for req in plan.items:
            if not (req.type == LoadItemType.TENSOR and self._read_direct(req, planner)):
                rest.append(req)
        return super().read_data(LoadPlan(rest, plan.storage_data, plan.planner_data), planner)

    def _read_direct(self, req: ReadItem, planner: LoadPlanner) -> bool:
        item_md = self.storage_data[req.storage_index]
        if item_md.transform_descriptors or sys.byteorder != "little" or any(req.storage_offsets) \
                or any(req.dest_offsets):
            return False
        target = planner.resolve_tensor(req).detach()
        if not target.is_contiguous() or tuple(target.shape) != tuple(req.lengths):
            return False
        path = self.fs.concat_path(self.path, item_md.relative_path)
        with self.fs.create_stream(path, "rb") as stream:
            stored = torch.load(self._slice_file(stream, item_md), map_location="meta", weights_only=True)
            offset = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
            if (offset is None or stored.dtype != target.dtype or tuple(stored.shape) != tuple(target.shape)
                    or not stored.is_contiguous() or stored.storage_offset() != 0):
                return False
            dst = memoryview(target.reshape(-1).view(torch.uint8).numpy())
            stream.seek(item_md.offset + offset)
            done = 0
            while done < len(dst):
                got = stream.readinto(dst[done:done + _READ_CHUNK])
                if not got:
                    raise CheckpointError(f"truncated data file {path}: short read of {req.dest_index.fqn}")
                done += got
        planner.commit_tensor(req, target)
        self.direct_bytes += len(dst)
        return True


def load_full_tensors(checkpoint_dir: str | Path, buckets: list[list[str]],
                      specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> Iterator[dict[str, torch.Tensor]]:
    """Yield {key: full tensor} bucket by bucket (one process).

    Nothing here keeps a reference to a yielded bucket, so it is freed as soon as the caller drops it,
    before the next bucket is read: at most one bucket is alive.
    """
    for bucket in buckets:
        yield _load_bucket(str(checkpoint_dir), bucket, specs)


def _load_bucket(ckpt: str, bucket: list[str],
                 specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    sharded = {k: full_sharded_tensor(k, torch.empty(specs[k][0], dtype=specs[k][1])) for k in bucket}
    # What Megatron's torch_dist load strategy does for ShardedTensors, with our reader passed to DCP's public
    # load: the same key grouping, the same PyTorch-side wrappers (so a chunk saved at any TP/PP layout is found
    # by its global offsets) and the same planner (global shapes checked against the stored metadata).
    grouped, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded)
    pyt_state_dict = mcore_to_pyt_state_dict(grouped, is_loading=True)
    planner = MCoreLoadPlanner(shapes_validation_sharded_tensors=list(sharded.values()))
    try:
        dcp.load(pyt_state_dict, storage_reader=DirectFileSystemReader(ckpt), planner=planner)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP's exception is a BaseException
        names = ", ".join(bucket[:3]) + (" ..." if len(bucket) > 3 else "")
        raise CheckpointError(f"cannot read tensors {names} from {ckpt} (damaged or truncated data file?): "
                              f"{type(exc).__name__}: {exc}") from exc
    return {k: sharded[k].data for k in bucket}  # DCP read into each ShardedTensor's own tensor
