"""The streaming safetensors reader/writer agree with the safetensors library, byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_omni.checkpoint.errors import CheckpointError
from megatron_omni.checkpoint.safetensors_io import (
    PlannedTensor,
    SafetensorsFolder,
    ShardedSafetensorsWriter,
    parse_size,
    plan_shards,
    read_header,
    read_tensor,
)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.bias": torch.randn(3, generator=g).to(torch.bfloat16),
        "c.half": torch.randn(2, 3, 4, generator=g).to(torch.float16),
        "d.ids": torch.arange(6, dtype=torch.int64),
        "e.empty": torch.zeros(0, 4),
        "f.scalar": torch.tensor(1.5),
    }


def test_reader_reads_library_files(tmp_path: Path) -> None:
    tensors = _tensors()
    save_file(tensors, tmp_path / "x.safetensors")
    entries = read_header(tmp_path / "x.safetensors")
    assert set(entries) == set(tensors)
    for name, t in tensors.items():
        got = read_tensor(entries[name])
        assert got.dtype == t.dtype and got.shape == t.shape and torch.equal(got, t), name


def test_writer_output_reads_back_with_the_library(tmp_path: Path) -> None:
    tensors = _tensors()
    plan = [PlannedTensor(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()]
    writer = ShardedSafetensorsWriter(tmp_path, plan, max_shard_bytes=100)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    index = json.loads((tmp_path / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    seen = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(tmp_path / file, "pt") as f:
            for k in f.keys():
                seen[k] = f.get_tensor(k)
    for name, t in tensors.items():
        assert seen[name].dtype == t.dtype and torch.equal(seen[name], t), name
    folder = SafetensorsFolder(tmp_path)
    assert torch.equal(folder.read("b.bias"), tensors["b.bias"])


def test_writer_rejects_out_of_plan_tensors(tmp_path: Path) -> None:
    plan = [PlannedTensor("a", torch.float32, (2,)), PlannedTensor("b", torch.float32, (3,))]
    writer = ShardedSafetensorsWriter(tmp_path, plan, max_shard_bytes=1 << 20)
    with pytest.raises(CheckpointError, match="planned 'a'"):
        writer.write("b", torch.zeros(3))
    writer.write("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match="torch.float16"):
        writer.write("b", torch.zeros(3, dtype=torch.float16))
    with pytest.raises(CheckpointError, match="1 of 2 tensors"):
        writer.close()


@pytest.mark.parametrize("cut", [4, 60, 1])
def test_truncated_file_is_named(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "diffusion_pytorch_model.safetensors"
    save_file(_tensors(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - cut] if cut > 1 else data[:4])
    with pytest.raises(CheckpointError, match="truncated.*diffusion_pytorch_model.safetensors"):
        SafetensorsFolder(tmp_path)


def test_index_pointing_at_a_missing_file(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, tmp_path / "part1.safetensors")
    index = {"weight_map": {"a": "part1.safetensors", "b": "part2.safetensors"}}
    (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="part2.safetensors does not exist"):
        SafetensorsFolder(tmp_path)


def test_plan_shards_and_sizes() -> None:
    plan = [PlannedTensor(str(i), torch.float32, (n,)) for i, n in enumerate([10, 10, 30, 1, 1])]
    shards = plan_shards(plan, max_shard_bytes=80)
    assert [[t.name for t in s] for s in shards] == [["0", "1"], ["2"], ["3", "4"]]
    assert parse_size("10GB") == 10**10 and parse_size("256MiB") == 256 * 2**20 and parse_size("1000") == 1000
    with pytest.raises(CheckpointError, match="cannot parse size"):
        parse_size("ten")
