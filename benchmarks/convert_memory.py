"""Peak memory of checkpoint conversion versus checkpoint size: a synthetic Qwen-Image transformer of at
least 2 GB (a shape between `small` and `20b`, written on the fly; `--family sd3`: an SD3.5-Medium-width
transformer with dual attention in its first half of the blocks; `--family flux`: a FLUX.1-dev-width transformer with
twice as many single- as double-stream blocks, as FLUX.1-dev) converted diffusers -> Megatron ->
diffusers by our streaming converter, and by the plain approach (load every tensor, then save) as the
reference, each conversion in a fresh process so its peak RSS is its own.

Prints, per direction, the median over runs of wall time, GB/s and peak RSS (and the part above the
process's RSS after imports), then last the ratio peak-RSS / checkpoint-size of our converter (the worse
direction; target < 0.5).

Usage: python benchmarks/convert_memory.py [--family qwen_image|sd3|flux] [--gb 2.0] [--runs 3] [--no-reference]
    [--workdir DIR]
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

# A Qwen-Image-like shape (24 heads x 128 in 20b): 12 heads x 128, the 20b text width and latent channels.
BASE = dict(patch_size=2, in_channels=64, out_channels=16, attention_head_dim=128, num_attention_heads=12,
            joint_attention_dim=3584, axes_dims_rope=(16, 56, 56))


# SD3.5-Medium's width (24 heads x 64) and text/pooled widths; dual attention in the first half of the blocks.
SD3_BASE = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, attention_head_dim=64,
                num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
                pooled_projection_dim=2048, pos_embed_max_size=384, qk_norm="rms_norm")
# FLUX.1-dev's width (24 heads x 128), text and pooled widths and guidance embedding.
FLUX_BASE = dict(patch_size=1, in_channels=64, out_channels=None, attention_head_dim=128, num_attention_heads=24,
                 joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
CLASSES = {"qwen_image": "QwenImageTransformer2DModel", "sd3": "SD3Transformer2DModel",
           "flux": "FluxTransformer2DModel"}


def _shape(family: str, layers: int) -> dict:
    if family == "sd3":
        return dict(SD3_BASE, num_layers=layers, dual_attention_layers=tuple(range(layers // 2)))
    if family == "flux":
        return dict(FLUX_BASE, num_layers=layers, num_single_layers=2 * layers)
    return dict(BASE, num_layers=layers)


def _config_for(gb: float, family: str = "qwen_image") -> dict:
    from model_providers import get_family

    shapes = get_family(family).megatron_shapes
    layers = 1
    while sum(math.prod(s) for s in shapes(_shape(family, layers)).values()) * 2 < gb * 1e9:
        layers += 1
    return _shape(family, layers)


def write_synthetic(folder: Path, config: dict, family: str = "qwen_image") -> int:
    """A diffusers transformer folder of random bf16 weights, written one tensor at a time."""
    import json

    import torch
    from tqdm import tqdm

    from megatron_omni.checkpoint.safetensors_io import PlannedTensor, ShardedSafetensorsWriter
    from model_providers import get_family

    fam = get_family(family)
    shapes = fam.megatron_shapes(config)
    plan = []
    for m in fam.mappings_for(config):
        s = shapes[m.megatron]
        for name in m.hf:
            plan.append(PlannedTensor(name, torch.bfloat16, (s[0] // 3, *s[1:]) if m.kind == "fuse_qkv" else s))
    folder.mkdir(parents=True)
    cfg = dict(config, _class_name=CLASSES[family], _diffusers_version="0.40.0")
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    writer = ShardedSafetensorsWriter(folder, plan, max_shard_bytes=10 * 10**9)  # diffusers' default
    g = torch.Generator().manual_seed(0)
    for t in tqdm(plan, desc="synthetic checkpoint", unit="tensor"):
        writer.write(t.name, (torch.randn(t.shape, generator=g) * 0.02).to(t.dtype))
    writer.close()
    return sum(t.nbytes for t in plan)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss() -> int:
    """This process's own peak RSS in bytes (`VmHWM`). Not `getrusage(RUSAGE_SELF).ru_maxrss`: a spawned child
    starts by (v)fork + exec, and Linux keeps the pre-exec memory's high-water mark in it, so a conversion's child
    would report at least the benchmark process's peak (it wrote the synthetic checkpoint), not its own."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no VmHWM line")


def _child(kind: str, src: str, dst: str, result: mp.Queue) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    from megatron_omni.checkpoint import convert
    from megatron_omni.checkpoint.streaming import single_process_group

    base = _rss()
    start = time.perf_counter()
    if kind == "ours:hf-to-mcore":
        convert.hf_to_mcore(src, dst, progress=False)
    elif kind == "ours:mcore-to-hf":
        convert.mcore_to_hf(src, dst, progress=False)
    elif kind == "reference:hf-to-mcore":
        from megatron_omni.parallel.megatron_cpu_shims import apply_cpu_shims

        apply_cpu_shims()  # Megatron's default save strategy synchronises CUDA
        with single_process_group():
            _reference_hf_to_mcore(src, dst)
    else:
        with single_process_group():
            _reference_mcore_to_hf(src, dst)
    seconds = time.perf_counter() - start
    result.put((seconds, peak_rss(), base))


def _reference_hf_to_mcore(src: str, dst: str) -> None:
    """The plain way: every diffusers tensor in memory, fused, then one `dist_checkpointing.save`."""
    import json

    from megatron.core import dist_checkpointing
    from safetensors.torch import load_file

    from megatron_omni.checkpoint.sharded_state import content_metadata
    from megatron_omni.checkpoint.streaming import full_sharded_tensor
    from model_providers.qwen_image import mapping

    cfg = json.loads((Path(src) / "config.json").read_text())
    hf = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        hf.update(load_file(f))
    sharded = {m.megatron: full_sharded_tensor(m.megatron, mapping.hf_to_megatron(
        m, [hf.pop(n) for n in m.hf], cfg["num_attention_heads"])) for m in mapping.all_mappings(cfg["num_layers"])}
    Path(dst).mkdir()
    dist_checkpointing.save(sharded, dst, content_metadata=content_metadata("qwen_image", cfg, {}))


def _reference_mcore_to_hf(src: str, dst: str) -> None:
    """The plain way: `dist_checkpointing.load` of every tensor, split, one `save_file`."""
    import torch
    from megatron.core import dist_checkpointing
    from safetensors.torch import save_file

    from megatron_omni.checkpoint.sharded_state import read_content_metadata
    from megatron_omni.checkpoint.streaming import checkpoint_tensor_specs, full_sharded_tensor
    from model_providers.qwen_image import mapping

    cfg = read_content_metadata(src)["diffusers_config"]
    specs = checkpoint_tensor_specs(src)
    request = {k: full_sharded_tensor(k, torch.empty(s, dtype=d)) for k, (s, d) in specs.items()}
    loaded = dist_checkpointing.load(request, src)
    out = {}
    for m in mapping.all_mappings(cfg["num_layers"]):
        for name, t in zip(m.hf, mapping.megatron_to_hf(m, loaded.pop(m.megatron), cfg["num_attention_heads"])):
            out[name] = t.contiguous()
    Path(dst).mkdir()
    save_file(out, Path(dst) / "diffusion_pytorch_model.safetensors")


def run(kind: str, src: Path, dst: Path) -> tuple[float, int, int]:
    """One conversion in a fresh process: (seconds, peak RSS bytes, RSS after imports)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(kind, str(src), str(dst), q))
    p.start()
    p.join()
    if p.exitcode != 0:
        raise RuntimeError(f"{kind} failed with exit code {p.exitcode}")
    return q.get()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(CLASSES), default="qwen_image")
    ap.add_argument("--gb", type=float, default=2.0, help="minimum checkpoint size in GB (1e9 bytes)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--no-reference", action="store_true", help="skip the load-everything reference")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temporary one)")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="convert-bench-", dir=args.workdir))
    try:
        config = _config_for(args.gb, args.family)
        size = write_synthetic(work / "hf", config, args.family)
        width = config["num_attention_heads"] * config["attention_head_dim"]
        print(f"checkpoint: {args.family}, {config['num_layers']} blocks, width {width}, bf16, {size / 1e9:.2f} GB")
        if args.family != "qwen_image" and not args.no_reference:
            print(f"the load-everything reference is Qwen-Image's: --family {args.family} measures ours only")
            args.no_reference = True
        kinds = ["ours:hf-to-mcore", "ours:mcore-to-hf"]
        if not args.no_reference:
            kinds += ["reference:hf-to-mcore", "reference:mcore-to-hf"]
        results: dict[str, list[tuple[float, int, int]]] = {k: [] for k in kinds}
        for i in range(args.runs):
            for kind in kinds:
                if kind.startswith("reference") and i > 0:
                    continue  # one run: it needs memory for the whole model, twice
                to_mcore = kind.endswith("hf-to-mcore")
                src = work / "hf" if to_mcore else work / "mcore"
                dst = work / ("mcore" if to_mcore else "back")
                if to_mcore and (work / "mcore").exists():
                    shutil.rmtree(work / "mcore")
                if not to_mcore and dst.exists():
                    shutil.rmtree(dst)
                if not to_mcore and not (work / "mcore").exists():
                    run("ours:hf-to-mcore", work / "hf", work / "mcore")
                results[kind].append(run(kind, src, dst))
                if not to_mcore:
                    shutil.rmtree(dst)
        ratios = {}
        for kind, rs in results.items():
            sec = statistics.median(r[0] for r in rs)
            peak = statistics.median(r[1] for r in rs)
            base = statistics.median(r[2] for r in rs)
            ratios[kind] = peak / size
            print(f"{kind:<24} {len(rs)} run(s): {sec:6.1f} s, {size / 1e9 / sec:5.2f} GB/s, peak RSS "
                  f"{peak / 1e9:5.2f} GB ({(peak - base) / 1e9:5.2f} GB above the {base / 1e9:.2f} GB after "
                  f"imports), peak/size {peak / size:.3f}")
        worst = max(ratios["ours:hf-to-mcore"], ratios["ours:mcore-to-hf"])
        print(f"checkpoint size {size / 1e9:.2f} GB")
        print(f"peak-RSS / checkpoint-size (ours, worse direction; target < 0.5): {worst:.3f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
