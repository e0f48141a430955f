"""Rollout throughput at equal resources: our embedded engine (DiffusersRolloutEngine, step-wise batching) against
what a user would run instead, on the same prompts, seeds, steps, image size, batch, precision (fp32) and threads,
all in this process:

- diffusers' `QwenImagePipeline.__call__` with the whole batch (every sample one row, as flow_grpo samples): the
  ODE sampler, no log-probabilities (the least a sampler can do: a floor for the work per image);
- a flow_grpo-style loop from its equations (docs/design.md section 4, not our code; the SDE step is
  `benchmarks/flow_grpo_reference.py`, shared with the SD3 comparison test): the pipeline's
  prompt encoding, latents and sigma grid, then per step one transformer forward on the whole batch and the SDE
  step with its per-element mean log-probability on the noised window (the same window for every sample, as
  flow_grpo draws it), the window's latents and log-probs kept, the VAE decode at the end.

Ours samples the same window (`window_start` fixed) and records the same trajectory. The pipeline is the
`small` transformer preset (a few million parameters) built offline into a temp folder. Runs alternate the three
sides; each run's ratios are paired; medians. Printed LAST: ours / the flow_grpo-style loop and ours /
`QwenImagePipeline.__call__`. The vLLM-Omni engine's side is not here (it runs on GPU only; its engine module is
being moved).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/rollout.py [--runs 5] [--group 4] [--steps 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.flow_grpo_reference import flow_grpo_sde_step  # noqa: E402
from megatron_omni.rollout.base import SamplingParams  # noqa: E402
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine  # noqa: E402
from model_providers.qwen_image.tiny_pipeline import SMALL_TRANSFORMER, TinyPipelineConfig, make_tiny_pipeline  # noqa: E402

PROMPTS = ["OPEN 24 HOURS", "a red cat on a mat", "STOP", "hello world"]


@torch.no_grad()
def flow_grpo_loop(pipe, rows: list[str], seeds: list[int], size: int, steps: int, noise: float,
                   window: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """flow_grpo's sampling with log-probs, from its equations: images [N, 3, H, W] and log-probs [N, W]."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

    n, dev = len(rows), torch.device("cpu")
    embeds, mask = pipe.encode_prompt(prompt=rows, device=dev, num_images_per_prompt=1, max_sequence_length=64)
    latents = pipe.prepare_latents(n, pipe.transformer.config.in_channels // 4, size, size, embeds.dtype, dev,
                                   [torch.Generator().manual_seed(s) for s in seeds], None)
    side = size // pipe.vae_scale_factor // 2
    img_shapes = [[(1, side, side)]] * n
    cfg = pipe.scheduler.config
    mu = calculate_shift(latents.shape[1], cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                         cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, dev, sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    sig = pipe.scheduler.sigmas.float()  # [steps + 1], the last 0
    noise_gen = torch.Generator().manual_seed(seeds[0])
    kept, log_probs = [], []
    for i, t in enumerate(timesteps):
        v = pipe.transformer(hidden_states=latents, timestep=t.expand(n).to(latents.dtype) / 1000,
                             encoder_hidden_states_mask=mask, encoder_hidden_states=embeds, img_shapes=img_shapes,
                             return_dict=False)[0].float()
        x, s, dt = latents.float(), sig[i], sig[i + 1] - sig[i]
        if window[0] <= i < window[1]:
            nxt, _, lp = flow_grpo_sde_step(x, v, s, sig[i + 1], sig[1], noise,
                                            noise=torch.randn(x.shape, generator=noise_gen))
            kept.append((x, nxt))
            log_probs.append(lp)
        else:
            nxt = x + v * dt
        latents = nxt
    z = pipe._unpack_latents(latents, size, size, pipe.vae_scale_factor)
    vcfg = pipe.vae.config
    z = z * torch.tensor(vcfg.latents_std).view(1, vcfg.z_dim, 1, 1, 1) + \
        torch.tensor(vcfg.latents_mean).view(1, vcfg.z_dim, 1, 1, 1)
    images = (pipe.vae.decode(z, return_dict=False)[0][:, :, 0] / 2 + 0.5).clamp(0, 1)
    return images, torch.stack(log_probs, dim=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--group", type=int, default=4, help="samples per prompt (batch = 4 prompts x group)")
    parser.add_argument("--size", type=int, default=64, help="image height = width")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    window = (1, 3)  # the recipes' window of 2, at a fixed start so that every side noises the same steps
    if args.steps < window[1]:
        parser.error(f"--steps {args.steps} must be at least {window[1]}: the SDE window covers steps "
                     f"[{window[0]}, {window[1]})")
    if args.threads:
        torch.set_num_threads(args.threads)
    from diffusers import QwenImagePipeline

    params = SamplingParams(height=args.size, width=args.size, num_steps=args.steps, noise_level=1.2,
                            window_size=window[1] - window[0], window_start=window[0], window_range=(0, window[1]))
    rows = [p for p in PROMPTS for _ in range(args.group)]
    n, seeds = len(rows), list(range(len(rows)))
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_pipeline(Path(tmp) / "small", seed=0, config=TinyPipelineConfig(SMALL_TRANSFORMER))
        ours = DiffusersRolloutEngine(folder, max_batch_size=n)
        pipe = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
        pipe.set_progress_bar_config(disable=True)
        params_m = sum(p.numel() for p in ours.transformer.parameters()) / 1e6
        print(f"small transformer: {params_m:.2f}M parameters; batch {n} ({len(PROMPTS)} prompts x {args.group}) "
              f"of {args.size}px, {args.steps} steps, SDE window steps [{window[0]}, {window[1]}), fp32, torch "
              f"threads {torch.get_num_threads()}")

        def run_ours() -> float:
            t0 = time.perf_counter()
            traj = ours.generate(PROMPTS, params, group_size=args.group, seeds=seeds)
            assert traj.log_probs.shape == (n, window[1] - window[0]), traj.log_probs.shape
            return n / (time.perf_counter() - t0)

        def run_pipeline() -> float:
            t0 = time.perf_counter()
            out = pipe(prompt=rows, height=args.size, width=args.size, num_inference_steps=args.steps,
                       true_cfg_scale=1.0, output_type="pt",
                       generator=[torch.Generator().manual_seed(s) for s in seeds])
            assert out.images.shape[0] == n
            return n / (time.perf_counter() - t0)

        def run_flow_grpo() -> float:
            t0 = time.perf_counter()
            images, lp = flow_grpo_loop(pipe, rows, seeds, args.size, args.steps, 1.2, window)
            assert images.shape[0] == n and lp.shape == (n, window[1] - window[0])
            return n / (time.perf_counter() - t0)

        sides = {"ours": run_ours, "pipeline": run_pipeline, "flow_grpo": run_flow_grpo}
        for fn in sides.values():  # warm-up (first-call allocations, prompt caches)
            fn()
        ips: dict[str, list[float]] = {k: [] for k in sides}
        for i in tqdm(range(args.runs), desc="runs"):
            order = list(sides) if i % 2 == 0 else list(reversed(sides))  # drift in the load hits every side
            for k in order:
                ips[k].append(sides[k]())
    for k, label in (("pipeline", "QwenImagePipeline.__call__, whole batch (ODE, no log-probs)"),
                     ("flow_grpo", "flow_grpo-style SDE loop with log-probs, whole batch"),
                     ("ours", "ours: DiffusersRolloutEngine, step-wise batching (SDE window, log-probs)")):
        print(f"{label}: {statistics.median(ips[k]):.2f} images/s (runs: {', '.join(f'{x:.2f}' for x in ips[k])})")
    vs_loop = statistics.median(o / r for o, r in zip(ips["ours"], ips["flow_grpo"]))
    vs_pipe = statistics.median(o / r for o, r in zip(ips["ours"], ips["pipeline"]))
    print(f"images/s ratio, median of {args.runs} paired runs: ours / flow_grpo-style loop {vs_loop:.2f}; "
          f"ours / QwenImagePipeline.__call__ {vs_pipe:.2f}")


if __name__ == "__main__":
    main()
