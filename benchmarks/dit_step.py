"""Forward + backward of the `small` Qwen-Image transformer: our Megatron-Core model (TP=1, CPU) versus
diffusers' `QwenImageTransformer2DModel` on the same weights and inputs, in one process.

Prints the median time of each over several runs and, last, the ratio megatron / diffusers (target <= 1.0).
Usage: python benchmarks/dit_step.py [--preset small] [--runs 7] [--batch 2] [--grid 1 16 16] [--text 32]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from diffusers import QwenImageTransformer2DModel
from tqdm import tqdm

from megatron_omni.models.dit.model import DiTBatch
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from model_providers.qwen_image import provider


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--grid", type=int, nargs=3, default=(1, 16, 16))
    ap.add_argument("--text", type=int, default=32)
    args = ap.parse_args()

    os.environ.setdefault("MASTER_PORT", "29571")
    os.environ.update(RANK="0", WORLD_SIZE="1")
    platform.init_distributed()
    groups = build_parallel_groups(ParallelLayout())
    platform.seed_everything(0)
    cfg = provider.hf_config(args.preset)
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.05)
    model = provider.build_model(provider.transformer_config(args.preset), groups)
    provider.load_hf_state_dict(model, ref.state_dict())

    grid = tuple(args.grid)
    s_img = grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(args.batch, s_img, cfg["in_channels"], generator=g)
    prompt = torch.randn(args.batch, args.text, cfg["joint_attention_dim"], generator=g)
    mask = torch.ones(args.batch, args.text, dtype=torch.bool)
    mask[0, args.text // 2:] = False
    sigma = torch.rand(args.batch, generator=g)
    weight = torch.randn(args.batch, s_img, cfg["patch_size"] ** 2 * cfg["out_channels"], generator=g)

    def step_ours() -> None:
        model.zero_grad(set_to_none=True)
        (model(DiTBatch(latents, prompt, mask, sigma, grid)) * weight).sum().backward()

    def step_ref() -> None:
        ref.zero_grad(set_to_none=True)
        out = ref(hidden_states=latents, encoder_hidden_states=prompt, encoder_hidden_states_mask=mask,
                  timestep=sigma, img_shapes=[[grid]] * args.batch).sample
        (out * weight).sum().backward()

    times: dict[str, list[float]] = {"megatron": [], "diffusers": []}
    step_ours(), step_ref()  # warm-up
    for _ in tqdm(range(args.runs), desc="fwd+bwd pairs", unit="run"):
        for name, fn in (("megatron", step_ours), ("diffusers", step_ref)):  # interleaved: same machine load
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    n_params = provider.parameter_count(args.preset)
    print(f"preset {args.preset} ({n_params / 1e6:.2f}M params), batch {args.batch}, {s_img} image + "
          f"{args.text} text tokens, {torch.get_num_threads()} threads, {args.runs} runs")
    print(f"megatron  fwd+bwd median {med['megatron'] * 1e3:.1f} ms")
    print(f"diffusers fwd+bwd median {med['diffusers'] * 1e3:.1f} ms")
    print(f"ratio megatron/diffusers: {med['megatron'] / med['diffusers']:.3f}")
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
