"""Streaming reads and writes of diffusers safetensors folders: one tensor in memory at a time.

`safetensors.safe_open` maps whole files, so reading every tensor of a file leaves all of it resident
(measured: RSS grows to the file size). Reading goes through plain `readinto` at the offsets of the
header instead, and writing lays the header out first (every shape and dtype is known before any tensor
exists) and appends tensor bytes as they come. Files stay standard safetensors: the tests read what is
written here with the safetensors library, and this reader with files the library wrote.

Folder layout follows diffusers: `diffusion_pytorch_model.safetensors`, or numbered shards
`diffusion_pytorch_model-0000i-of-0000n.safetensors` plus `diffusion_pytorch_model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from megatron_omni.checkpoint.errors import CheckpointError

WEIGHTS_PREFIX = "diffusion_pytorch_model"
_MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: `file`, absolute byte range [begin, end)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def nbytes_of(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor."""
    return math.prod(shape) * dtype.itemsize


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors of one safetensors file, checked against the file's real size (truncation)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"truncated safetensors file {path}: {size} bytes, no header")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"truncated or corrupt safetensors file {path}: header of {n} bytes, file of {size}"
                )
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"safetensors file {path} does not exist") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"corrupt safetensors header in {path}: {exc}") from exc
    header.pop("__metadata__", None)
    data_start = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"corrupt safetensors entry {name!r} in {path}: {info!r}") from exc
        if end - begin != nbytes_of(shape, dtype):
            raise CheckpointError(
                f"corrupt safetensors entry {name!r} in {path}: {end - begin} bytes for {dtype} {shape}"
            )
        if data_start + end > size:
            raise CheckpointError(
                f"truncated safetensors file {path}: tensor {name!r} ends at byte {data_start + end}, "
                f"the file has {size}"
            )
        entries[name] = TensorEntry(name, dtype, shape, path, data_start + begin, data_start + end)
    return entries


def read_tensor(entry: TensorEntry) -> torch.Tensor:
    """Read one tensor from disk into fresh memory."""
    buf = torch.empty(entry.nbytes, dtype=torch.uint8)
    with open(entry.file, "rb") as f:
        f.seek(entry.begin)
        got = f.readinto(memoryview(buf.numpy())) if entry.nbytes else 0
    if got != entry.nbytes:
        raise CheckpointError(f"truncated safetensors file {entry.file}: short read of tensor {entry.name!r}")
    return buf.view(entry.dtype).reshape(entry.shape)


class SafetensorsFolder:
    """The weights of a diffusers model folder: index (if any) and shard headers, read lazily per tensor."""

    def __init__(self, folder: str | Path, prefix: str = WEIGHTS_PREFIX) -> None:
        self.folder = Path(folder)
        index_path = self.folder / f"{prefix}.safetensors.index.json"
        single = self.folder / f"{prefix}.safetensors"
        self.entries: dict[str, TensorEntry] = {}
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
                raise CheckpointError(f"cannot read the weight index {index_path}: {exc}") from exc
            self.files = sorted({self.folder / f for f in weight_map.values()})
            for file in self.files:
                for name, entry in read_header(file).items():
                    if weight_map.get(name) != file.name:
                        raise CheckpointError(f"{file} holds tensor {name!r}, which {index_path.name} does not "
                                              f"map to it")
                    self.entries[name] = entry
            absent = sorted(set(weight_map) - set(self.entries))
            if absent:
                raise CheckpointError(f"{index_path.name} lists tensors absent from their files: {absent[:5]}")
        elif single.is_file():
            self.files = [single]
            self.entries = read_header(single)
        else:
            found = sorted(p.name for p in self.folder.glob("*.safetensors"))
            raise CheckpointError(
                f"{self.folder} has no {single.name} nor {index_path.name}"
                + (f" (found {found})" if found else "")
            )

    def read(self, name: str) -> torch.Tensor:
        """Tensor `name` ([shape] in its stored dtype)."""
        if name not in self.entries:
            raise CheckpointError(f"tensor {name!r} is not in {self.folder}")
        return read_tensor(self.entries[name])

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())


# ------------------------------------------------------------------------------------------------ writing


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written: name, dtype, shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape, self.dtype)


class SafetensorsStreamWriter:
    """Writes one safetensors file whose tensors arrive one by one, in the order given up front."""

    def __init__(self, path: Path, tensors: list[PlannedTensor], metadata: dict[str, str] | None = None) -> None:
        self.path = path
        self.plan = tensors
        self.next = 0
        header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
        offset = 0
        for t in tensors:
            if t.dtype not in DTYPE_NAMES:
                raise CheckpointError(f"tensor {t.name!r}: dtype {t.dtype} has no safetensors name")
            header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the tensor data starts 8-byte aligned, as the library writes it
        self.file = open(path, "wb")  # noqa: SIM115 - closed in close()
        self.file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append tensor `name` ([shape] of the plan, same dtype)."""
        if self.next >= len(self.plan):
            raise CheckpointError(f"{self.path.name}: unexpected tensor {name!r} after the planned ones")
        want = self.plan[self.next]
        if name != want.name or tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise CheckpointError(
                f"{self.path.name}: got {name!r} {tensor.dtype} {tuple(tensor.shape)}, planned {want.name!r} "
                f"{want.dtype} {want.shape}"
            )
        if want.nbytes:
            self.file.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        self.next += 1

    def close(self) -> None:
        """Flush to disk; every planned tensor must have been written."""
        if self.next != len(self.plan):
            self.file.close()
            raise CheckpointError(f"{self.path.name}: only {self.next} of {len(self.plan)} tensors were written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


def shard_names(n: int, prefix: str = WEIGHTS_PREFIX) -> list[str]:
    """diffusers' file names for `n` shards (a single file is not numbered)."""
    if n == 1:
        return [f"{prefix}.safetensors"]
    return [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Split `tensors`, in order, into shards of at most `max_shard_bytes` (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


class ShardedSafetensorsWriter:
    """A diffusers weights folder written tensor by tensor in plan order: shards plus index json."""

    def __init__(self, folder: Path, tensors: list[PlannedTensor], max_shard_bytes: int,
                 prefix: str = WEIGHTS_PREFIX) -> None:
        self.folder = folder
        self.prefix = prefix
        self.shards = plan_shards(tensors, max_shard_bytes)
        self.names = shard_names(len(self.shards), prefix)
        self.total = sum(t.nbytes for t in tensors)
        self.weight_map = {t.name: fname for shard, fname in zip(self.shards, self.names) for t in shard}
        self.current: SafetensorsStreamWriter | None = None
        self.shard_index = -1

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Append the next tensor of the plan."""
        while self.current is None or self.current.next == len(self.current.plan):
            if self.current is not None:
                self.current.close()
            self.shard_index += 1
            if self.shard_index >= len(self.shards):
                raise CheckpointError(f"unexpected tensor {name!r}: every planned tensor was written")
            self.current = SafetensorsStreamWriter(self.folder / self.names[self.shard_index],
                                                   self.shards[self.shard_index])
        self.current.write(name, tensor)

    def close(self) -> None:
        """Close the last shard and write the index (only for more than one shard, as diffusers does)."""
        if self.current is not None:
            self.current.close()
        if self.shard_index != len(self.shards) - 1:
            raise CheckpointError(f"only {self.shard_index + 1} of {len(self.shards)} shards were written")
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(self.weight_map.items()))}
            (self.folder / f"{self.prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    def abort(self) -> None:
        """Close an open file after a failure (the caller removes the folder)."""
        if self.current is not None and not self.current.file.closed:
            self.current.file.close()


def parse_size(text: str) -> int:
    """'10GB', '512MB', '2GiB', '1000' -> bytes."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper()
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num) * units[unit]
    except (ValueError, KeyError):
        raise CheckpointError(f"cannot parse size {text!r} (examples: 10GB, 512MiB)") from None
    if value <= 0:
        raise CheckpointError(f"size {text!r} must be positive")
    return int(value)
