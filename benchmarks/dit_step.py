"""Forward + backward of a small DiT: our Megatron-Core model (TP=1, CPU) versus the diffusers transformer on the
same weights and inputs, in one process. `--family qwen_image` (default): the `small` Qwen-Image MMDiT on one
image; `--family wan`: the `small` Wan video DiT on one latent video (3D patch grid).

Prints the median time of each over several runs and, last, the ratio megatron / diffusers (target <= 1.0).
Usage: python benchmarks/dit_step.py [--family qwen_image|wan] [--preset small] [--runs 7] [--batch 2]
       [--grid F H W (patches)] [--text 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from megatron_omni.models.dit.embeddings import patchify_video, unpatchify_video
from megatron_omni.models.dit.model import DiTBatch
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from model_providers import get_family

DEFAULT_GRID = {"qwen_image": (1, 16, 16), "wan": (4, 8, 8)}


def _steps(family: str, model, ref, cfg: dict, batch: int, grid: tuple[int, int, int], text: int
           ) -> tuple[Callable[[], None], Callable[[], None]]:
    """(ours, diffusers'): one forward + backward each on the same inputs and loss weights."""
    g = torch.Generator().manual_seed(1)
    s_img = grid[0] * grid[1] * grid[2]
    sigma = torch.rand(batch, generator=g)
    if family == "qwen_image":
        latents = torch.randn(batch, s_img, cfg["in_channels"], generator=g)
        prompt = torch.randn(batch, text, cfg["joint_attention_dim"], generator=g)
        mask = torch.ones(batch, text, dtype=torch.bool)
        mask[0, text // 2:] = False
        weight = torch.randn(batch, s_img, cfg["patch_size"] ** 2 * cfg["out_channels"], generator=g)

        def ours() -> None:
            (model(DiTBatch(latents, prompt, mask, sigma, grid)) * weight).sum().backward()

        def theirs() -> None:
            out = ref(hidden_states=latents, encoder_hidden_states=prompt, encoder_hidden_states_mask=mask,
                      timestep=sigma, img_shapes=[[grid]] * batch).sample
            (out * weight).sum().backward()

        return ours, theirs
    patch = tuple(cfg["patch_size"])
    channels = cfg["in_channels"] * patch[0] * patch[1] * patch[2]
    tokens = torch.randn(batch, s_img, channels, generator=g)  # what the trainer feeds: packed 3D patches
    video = unpatchify_video(tokens, grid, patch)  # diffusers' input: the latent video
    prompt = torch.randn(batch, text, cfg["text_dim"], generator=g)
    prompt[0, text // 2:] = 0  # a shorter prompt, zero-padded as Wan's pipeline pads it
    weight = torch.randn(batch, s_img, channels, generator=g)
    weight_video = unpatchify_video(weight, grid, patch)

    def ours() -> None:
        (model(DiTBatch(tokens, prompt, None, sigma, grid)) * weight).sum().backward()

    def theirs() -> None:
        out = ref(hidden_states=video, timestep=sigma * 1000, encoder_hidden_states=prompt, return_dict=False)[0]
        (out * weight_video).sum().backward()

    assert torch.allclose(patchify_video(weight_video, patch), weight)
    return ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", choices=sorted(DEFAULT_GRID), default="qwen_image")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--grid", type=int, nargs=3, default=None, help="patch grid (frames, height, width)")
    ap.add_argument("--text", type=int, default=32)
    args = ap.parse_args()

    os.environ.setdefault("MASTER_PORT", "29571")
    os.environ.update(RANK="0", WORLD_SIZE="1")
    platform.init_distributed()
    groups = build_parallel_groups(ParallelLayout())
    platform.seed_everything(0)
    family = get_family(args.family)
    cfg = family.config(args.preset)
    torch.manual_seed(0)
    ref = _diffusers_class(args.family)(**cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.05)
    model = family.build_model(family.megatron_config(args.preset), groups)
    family.load_state(model, ref.state_dict())

    grid = tuple(args.grid or DEFAULT_GRID[args.family])
    ours, theirs = _steps(args.family, model, ref, cfg, args.batch, grid, args.text)

    def step(module: torch.nn.Module, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            module.zero_grad(set_to_none=True)
            fn()
        return run

    times: dict[str, list[float]] = {"megatron": [], "diffusers": []}
    steps = {"megatron": step(model, ours), "diffusers": step(ref, theirs)}
    for fn in steps.values():  # warm-up
        fn()
    for _ in tqdm(range(args.runs), desc="fwd+bwd pairs", unit="run"):
        for name, fn in steps.items():  # interleaved: same machine load
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_params = sum(p.numel() for p in ref.parameters())
    print(f"{args.family} preset {args.preset} ({n_params / 1e6:.2f}M params), batch {args.batch}, grid {grid} = "
          f"{grid[0] * grid[1] * grid[2]} image/video + {args.text} text tokens, {torch.get_num_threads()} threads, "
          f"{args.runs} runs")
    print(f"megatron  fwd+bwd median {med['megatron'] * 1e3:.1f} ms")
    print(f"diffusers fwd+bwd median {med['diffusers'] * 1e3:.1f} ms")
    print(f"ratio megatron/diffusers: {med['megatron'] / med['diffusers']:.3f}")
    platform.destroy_distributed()


def _diffusers_class(family: str):
    import diffusers

    return getattr(diffusers, get_family(family).diffusers_class)


if __name__ == "__main__":
    main()
