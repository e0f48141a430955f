"""diffusers <-> Megatron conversion in one process: bit-exact round trips, dtype casts, dry runs, inspect,
and every bad input failing with a message that names the problem and leaving nothing behind.

The helpers at the top (diffusers folders with random weights, per-tensor hashes, a random config) are
also used by the distributed and end-to-end checkpoint tests.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from diffusers import QwenImageTransformer2DModel
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch_strategies
from safetensors import safe_open
from safetensors.torch import save_file
from torch.multiprocessing.reductions import StorageWeakRef

from megatron_omni.checkpoint import streaming
from megatron_omni.checkpoint.convert import hf_to_mcore, mcore_to_hf
from megatron_omni.checkpoint.errors import CheckpointError
from megatron_omni.checkpoint.sharded_state import content_metadata, read_content_metadata
from megatron_omni.checkpoint.streaming import (
    DirectFileSystemReader,
    checkpoint_tensor_specs,
    load_full_tensors,
    save_streaming,
    single_process_group,
)
from megatron_omni.checkpoint.summary import format_summary, inspect_checkpoint
from model_providers.qwen_image import provider
from tools.checkpoint.convert import main

# ------------------------------------------------------------------------------------------------ helpers


def random_config(seed: int) -> dict[str, Any]:
    """A random small Qwen-Image shape whose heads and blocks split over tp=2 and pp=2."""
    r = random.Random(seed)
    axes = tuple(2 * r.randint(1, 4) for _ in range(3))
    return dict(patch_size=r.choice([1, 2]), in_channels=4 * r.randint(1, 3), out_channels=r.randint(2, 5),
                num_layers=2 * r.randint(1, 2), attention_head_dim=sum(axes), num_attention_heads=2 * r.randint(1, 3),
                joint_attention_dim=r.choice([8, 20, 36]), axes_dims_rope=axes)


def random_model(model_cls: type, config: dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32):
    """`model_cls(**config)` (a diffusers transformer) with random non-zero weights (adaLN starts at zero
    otherwise), a function of the seed only."""
    torch.manual_seed(seed)
    model = model_cls(**config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model.to(dtype).eval()


def diffusers_model(config: str | dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32):
    """diffusers' Qwen-Image transformer with random non-zero weights."""
    return random_model(QwenImageTransformer2DModel, provider.hf_config(config), seed, dtype)


def write_diffusers(folder: Path, config: str | dict[str, Any], seed: int = 0, dtype: torch.dtype = torch.float32,
                    max_shard_size: str = "100KB") -> Path:
    """A diffusers transformer folder (sharded safetensors + index) written by diffusers itself."""
    diffusers_model(config, seed, dtype).save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def assert_round_trip_byte_exact(src: Path, work: Path, family: str, class_name: str,
                                 hf_config: Callable[[dict], dict]) -> None:
    """A sharded diffusers folder `src` through `hf-to-mcore` and back (`mcore-to-hf`) under `work`: the checkpoint
    names `family` and `class_name`, every tensor comes back byte-identical and the config equal (as `hf_config`
    normalises it)."""
    assert len(list(src.glob("*.safetensors"))) > 1  # sharded, with an index
    assert main(["hf-to-mcore", str(src), str(work / "mcore"), "--no-progress"]) == 0
    meta = read_content_metadata(work / "mcore")
    source_config = json.loads((src / "config.json").read_text())
    assert meta["family"] == family and meta["diffusers_config"]["_class_name"] == class_name
    assert main(["mcore-to-hf", str(work / "mcore"), str(work / "back"), "--no-progress"]) == 0
    assert tensor_hashes(work / "back") == tensor_hashes(src)
    assert hf_config(json.loads((work / "back" / "config.json").read_text())) == hf_config(source_config)


def write_raw(folder: Path, config: dict[str, Any], state: dict[str, torch.Tensor]) -> Path:
    """A diffusers-layout folder with exactly `state` (for bad inputs diffusers would not write)."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, folder / "diffusion_pytorch_model.safetensors")
    return folder


def tensor_hashes(folder: Path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """{name: (dtype, shape, sha256 of the bytes)} of every tensor, read with the safetensors library."""
    out = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for k in f.keys():
                t = f.get_tensor(k).contiguous()
                digest = hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()
                out[k] = (str(t.dtype), tuple(t.shape), digest)
    return out


def _listing(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _class_config(config: str | dict[str, Any]) -> dict[str, Any]:
    cfg = dict(provider.hf_config(config), _class_name="QwenImageTransformer2DModel")
    cfg["axes_dims_rope"] = list(cfg["axes_dims_rope"])
    return cfg


# -------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("config,dtype", [("tiny", torch.float32), (random_config(7), torch.bfloat16)],
                         ids=["tiny-fp32", "random-bf16"])
def test_round_trip_is_byte_identical(tmp_path: Path, config, dtype) -> None:
    src = write_diffusers(tmp_path / "hf", config, dtype=dtype)
    r1 = hf_to_mcore(src, tmp_path / "mcore", progress=False, max_file_bytes=64 * 1024)
    assert len(list((tmp_path / "mcore").glob("*.distcp"))) > 1  # the file bound applies
    r2 = mcore_to_hf(tmp_path / "mcore", tmp_path / "back", progress=False, max_shard_bytes=150_000)
    assert r1.bytes == r2.bytes == sum(f.stat().st_size for f in src.glob("*.safetensors")) - _headers(src)
    assert tensor_hashes(tmp_path / "back") == tensor_hashes(src), config
    assert (tmp_path / "back" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    back = QwenImageTransformer2DModel.from_pretrained(tmp_path / "back")
    assert back.config.num_layers == provider.hf_config(config)["num_layers"]
    assert _listing(tmp_path) == ["back", "hf", "mcore"]  # no temporary folders left


def _peak_rss_since_reset() -> Callable[[], int]:
    """Reset this process's peak RSS (`VmHWM`, Linux's clear_refs 5); the returned function gives the peak since
    then minus the RSS at the reset, in bytes."""
    def status(field: str) -> int:
        line = next(ln for ln in Path("/proc/self/status").read_text().splitlines() if ln.startswith(field))
        return int(line.split()[1]) * 1024

    Path("/proc/self/clear_refs").write_text("5")
    base = status("VmRSS:")
    return lambda: status("VmHWM:") - base


def _module_attrs(module) -> dict[str, int]:  # noqa: ANN001
    return {k: id(v) for k, v in vars(module).items()}


def test_a_tensor_bigger_than_the_read_bucket_is_held_once(tmp_path: Path, monkeypatch) -> None:
    # SD3.5's sincos table is one tensor above the 256 MiB bucket: DCP's reader torch.loads a stored chunk into
    # fresh memory and copies it into the requested tensor, so reading it took twice its size (the mcore ->
    # diffusers peak of 0.67 x the checkpoint). The direct reader reads it into the requested tensor.
    big = torch.randn(4096, 4096)  # 64 MiB, fp32
    specs = {"t.big": (tuple(big.shape), big.dtype), "t.small": ((3, 5), torch.bfloat16)}
    small = torch.randn(3, 5).to(torch.bfloat16)
    with single_process_group():
        save_streaming(tmp_path, specs, {"t.big": big, "t.small": small}.__getitem__, {"family": "test"})
        assert checkpoint_tensor_specs(tmp_path) == specs
        readers: list[DirectFileSystemReader] = []
        mcore_attrs = _module_attrs(mcore_torch_strategies)
        during: list[dict[str, int]] = []

        class Recording(DirectFileSystemReader):
            def __init__(self, path) -> None:  # noqa: ANN001
                super().__init__(path)
                readers.append(self)

            def read_data(self, plan, planner):  # noqa: ANN001, ANN201
                during.append(_module_attrs(mcore_torch_strategies))
                return super().read_data(plan, planner)

        monkeypatch.setattr(streaming, "DirectFileSystemReader", Recording)
        peak = _peak_rss_since_reset()
        (bucket,) = list(load_full_tensors(tmp_path, [["t.big", "t.small"]], specs))
        grown = peak()
    assert torch.equal(bucket["t.big"], big) and torch.equal(bucket["t.small"], small)
    assert grown < 1.4 * big.nbytes, f"reading a {big.nbytes >> 20} MiB tensor took {grown >> 20} MiB"
    assert [r.direct_bytes for r in readers] == [big.nbytes + small.nbytes]
    assert during == [mcore_attrs]  # read through DCP's own API: no Megatron attribute replaced, even for the call


def test_a_written_tensor_is_freed_before_the_next_file_is_produced(tmp_path: Path) -> None:
    # DCP's file loop keeps a file's last tensor in a local until the next file's first tensor exists: SD3.5's
    # 0.45 GB table ends a file, so diffusers -> Megatron held it beside the next tensor (0.515 x the checkpoint).
    specs = {f"t.{i}": ((256, 64), torch.float32) for i in range(3)}
    torch.manual_seed(0)
    values = {k: torch.randn(s) for k, (s, _) in specs.items()}
    alive: dict[str, StorageWeakRef] = {}  # the storage: DCP holds detached aliases, not the tensor object
    seen: dict[str, list[str]] = {}

    def produce(key: str) -> torch.Tensor:
        seen[key] = [k for k, ref in alive.items() if not ref.expired()]
        t = values[key].clone()  # memory only the writer holds
        alive[key] = StorageWeakRef(t.untyped_storage())
        return t

    with single_process_group():
        save_streaming(tmp_path, specs, produce, {"family": "test"}, max_file_bytes=64 * 2**10)  # a file each
        assert len(list(tmp_path.glob("*.distcp"))) == 3
        assert seen == {"t.0": [], "t.1": [], "t.2": []}, seen
        (loaded,) = load_full_tensors(tmp_path, [sorted(specs)], specs)
    assert all(torch.equal(loaded[k], values[k]) for k in specs)


def _headers(folder: Path) -> int:
    return sum(8 + int.from_bytes(f.read_bytes()[:8], "little") for f in folder.glob("*.safetensors"))


def test_dtype_cast_and_inspect(tmp_path: Path) -> None:
    src = write_diffusers(tmp_path / "hf", "tiny")
    hf_to_mcore(src, tmp_path / "mcore", dtype="bf16", progress=False)
    info = inspect_checkpoint(tmp_path / "mcore")
    assert info["family"] == "qwen_image" and info["preset"] == "tiny" and set(info["dtypes"]) == {"bfloat16"}
    assert info["parameters"] == provider.parameter_count("tiny")
    assert "tp=1" in format_summary(info)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "fp32", dtype="fp32", progress=False)
    ref = diffusers_model("tiny").state_dict()
    with safe_open(tmp_path / "fp32" / "diffusion_pytorch_model.safetensors", "pt") as f:
        for k in f.keys():
            got = f.get_tensor(k)
            assert got.dtype == torch.float32 and torch.equal(got, ref[k].to(torch.bfloat16).float()), k
    hf_info = inspect_checkpoint(src)
    assert hf_info["parameters"] == info["parameters"] and hf_info["format"] == "diffusers transformer"


def test_dry_run_writes_nothing(tmp_path: Path) -> None:
    src = write_diffusers(tmp_path / "hf", "tiny")
    result = hf_to_mcore(src, tmp_path / "mcore", dry_run=True, progress=False)
    assert result.dry_run and not (tmp_path / "mcore").exists()
    assert any("linear_qkv.weight  <-  transformer_blocks.0.attn.to_q.weight" in line for line in result.plan)
    assert len(result.plan) == len(provider.megatron_shapes("tiny"))


# --------------------------------------------------------------------------------------------- bad input


def _state(config="tiny") -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in diffusers_model(config).state_dict().items()}


def _bad_sources(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Each bad diffusers folder and the text its error must contain."""
    cfg = _class_config("tiny")
    out = {}
    state = _state()
    missing = dict(state)
    missing.pop("transformer_blocks.1.attn.to_k.weight")
    out["missing"] = (write_raw(tmp / "missing", cfg, missing),
                      "missing tensors.*transformer_blocks.1.attn.to_k.weight")
    extra = dict(state, **{"transformer_blocks.0.attn.extra.weight": torch.zeros(2)})
    out["extra"] = (write_raw(tmp / "extra", cfg, extra), "unexpected tensors.*transformer_blocks.0.attn.extra.weight")
    shape = dict(state, **{"proj_out.weight": torch.zeros(3, 64)})
    out["shape"] = (write_raw(tmp / "shape", cfg, shape), r"proj_out.weight in .* has shape \(3, 64\)")
    out["family"] = (write_raw(tmp / "family", dict(cfg, _class_name="HunyuanDiT2DModel"), state),
                     "unknown model family.*HunyuanDiT2DModel")
    trunc = write_raw(tmp / "truncated", cfg, state)
    f = trunc / "diffusion_pytorch_model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    out["truncated"] = (trunc, "truncated safetensors file .*diffusion_pytorch_model.safetensors")
    out["variant"] = (write_raw(tmp / "variant", dict(cfg, guidance_embeds=True), state), "guidance_embeds")
    return out


def test_bad_diffusers_inputs(tmp_path: Path) -> None:
    sources = _bad_sources(tmp_path / "src")
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    for name, (src, message) in sources.items():
        with pytest.raises(CheckpointError, match=message):
            hf_to_mcore(src, out_parent / name, progress=False)
        assert _listing(out_parent) == [], name  # neither output nor temporary folder


def test_bad_outputs(tmp_path: Path) -> None:
    src = write_diffusers(tmp_path / "hf", "tiny")
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    with pytest.raises(CheckpointError, match="full is not empty"):
        hf_to_mcore(src, full, progress=False)
    assert _listing(full) == ["keep.txt"]
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match="a_file is not a folder"):
        hf_to_mcore(src, blocker / "out", progress=False)
    with pytest.raises(CheckpointError, match="parent folder .* does not exist"):
        hf_to_mcore(src, tmp_path / "no" / "such" / "out", progress=False)
    with pytest.raises(CheckpointError, match="unknown dtype"):
        hf_to_mcore(src, tmp_path / "x", dtype="int8", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()  # an existing empty folder is a valid target
    hf_to_mcore(src, empty, progress=False)
    assert (empty / "metadata.json").is_file()
    assert _listing(tmp_path) == ["a_file", "empty", "full", "hf"]


def test_bad_megatron_inputs(tmp_path: Path) -> None:
    src = write_diffusers(tmp_path / "hf", "tiny")
    hf_to_mcore(src, tmp_path / "good", progress=False)
    shapes = provider.megatron_shapes("tiny")
    specs = {k: (s, torch.float32) for k, s in shapes.items()}
    cfg = _class_config("tiny")

    def save(name: str, keep: dict, config: dict) -> Path:
        path = tmp_path / name
        path.mkdir()
        with single_process_group():
            save_streaming(path, keep, lambda k: torch.zeros(keep[k][0]), content_metadata("qwen_image", config, {}))
        return path

    missing = save("missing", {k: v for k, v in specs.items() if k != "layers.1.img.linear_fc2.weight"}, cfg)
    extra = save("extra", dict(specs, **{"layers.9.img.adaln.weight": ((2,), torch.float32)}), cfg)
    shape = save("shape", specs, dict(cfg, joint_attention_dim=cfg["joint_attention_dim"] + 8))
    trunc = tmp_path / "truncated"
    trunc.mkdir()
    for f in (tmp_path / "good").iterdir():
        data = f.read_bytes()
        (trunc / f.name).write_bytes(data[: len(data) // 2] if f.suffix == ".distcp" else data)
    plain = tmp_path / "plain"
    plain.mkdir()
    cases = {
        missing: "missing tensors.*layers.1.img.linear_fc2.weight",
        extra: "unexpected tensors.*layers.9.img.adaln.weight",
        shape: r"txt_norm.weight has shape \(24,\), the config implies \(32,\)",
        trunc: r"damaged checkpoint .*truncated: __0_0\.distcp has \d+ bytes",
        plain: "not a Megatron distributed checkpoint",
    }
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    for ckpt, message in cases.items():
        with pytest.raises(CheckpointError, match=message):
            mcore_to_hf(ckpt, out_parent / ckpt.name, progress=False)
        assert _listing(out_parent) == [], ckpt.name

    # A training checkpoint also holds optimizer state: outside the model's names, so not "unexpected".
    trained = save("trained", dict(specs, **{"optimizer.state.exp_avg.img_in.weight": (shapes["img_in.weight"],
                                                                                      torch.float32)}), cfg)
    mcore_to_hf(trained, tmp_path / "exported", progress=False)
    assert len(tensor_hashes(tmp_path / "exported")) == len(tensor_hashes(src))

    other = write_diffusers(tmp_path / "other", random_config(3))
    pipe = tmp_path / "pipe"
    pipe.mkdir()
    (pipe / "model_index.json").write_text(json.dumps({"transformer": ["diffusers", "QwenImageTransformer2DModel"]}))
    other.rename(pipe / "transformer")
    with pytest.raises(CheckpointError, match="differs from the checkpoint"):
        mcore_to_hf(tmp_path / "good", out_parent / "pipe", pipeline_source=pipe, progress=False)
    with pytest.raises(CheckpointError, match="not a pipeline folder"):
        mcore_to_hf(tmp_path / "good", out_parent / "pipe", pipeline_source=src, progress=False)
    assert _listing(out_parent) == []
