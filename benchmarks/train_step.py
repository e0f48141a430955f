"""Images/s of one full FlowGRPO step: our trainer (Megatron-Core model, TP=1, CPU) versus a single-process
diffusers implementation of the same step written here the way flow_grpo does it (pipeline components,
a batched SDE sampling loop, per-step log-probs, torch AdamW with grad clipping).

Ours runs its defaults at TP=1: the engine samples with the trainer's Megatron module (`rollout.transformer=
auto`; the reference's sampling uses the diffusers transformer it trains). Same pipeline (the `small`
transformer, ~10M parameters), same prompts, group size, sampling steps,
window, mini-batches and reward (JPEG compressibility), same torch thread count, in one process. After
warm-up steps, the two sides alternate (which one goes first alternates too, so drift in the machine's load
hits both); each pair gives a ratio, and the script prints each side's median step time with its spread,
both sides' phases, and, last, the median of the per-pair ratios ours/reference in images/s (target >= 1.0)
with its spread. On a shared machine the spread is the honest error bar.
Usage: python benchmarks/train_step.py [--runs 5] [--warmup 1] [--threads 2] [--size 64]
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_omni.parallel import platform  # noqa: E402
from megatron_omni.trainer.config import JobConfig  # noqa: E402
from model_providers.qwen_image.tiny_pipeline import (  # noqa: E402
    SMALL_TRANSFORMER,
    TinyPipelineConfig,
    make_tiny_pipeline,
)

PROMPTS = ["a photo of a cat", "a red cube", "a city at night", "a bowl of fruit"]


def jpeg_reward(images: torch.Tensor) -> torch.Tensor:
    out = []
    for im in images:
        arr = (im.clamp(0, 1).permute(1, 2, 0) * 255).round().to(torch.uint8).numpy()
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG", quality=95)
        out.append(-buf.tell() / 1000)
    return torch.tensor(out)


class ReferenceFlowGRPO:
    """flow_grpo's step with diffusers parts: sample with SDE log-probs, score, then PPO-clip updates."""

    def __init__(self, folder: Path, cfg: JobConfig) -> None:
        from diffusers import QwenImagePipeline

        self.cfg = cfg
        self.pipe = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
        self.pipe.set_progress_bar_config(disable=True)
        self.tr = self.pipe.transformer
        self.opt = torch.optim.AdamW(self.tr.parameters(), lr=cfg.optim.lr, betas=(0.9, 0.999),
                                     weight_decay=cfg.optim.weight_decay, eps=1e-8)

    @staticmethod
    def sde_step(x, v, s, s_next, s1, a, prev=None, gen=None):
        # flow_grpo's sde_step_with_logprob (sde_type="sde"), per-element mean log-prob.
        s_safe = torch.where(s == 1, s1, s)
        std = a * torch.sqrt(s / (1 - s_safe))
        dt = s_next - s
        b = lambda t: t.view(-1, 1, 1)  # noqa: E731
        mean = x + (v + b(std**2 / (2 * s)) * (x + b(1 - s) * v)) * b(dt)
        if prev is None:
            prev = mean + b(std * torch.sqrt(-dt)) * torch.randn(x.shape, generator=gen)
        var = b((std * torch.sqrt(-dt)) ** 2)
        lp = -((prev.detach() - mean) ** 2) / (2 * var) - torch.log(b(std * torch.sqrt(-dt))) - 0.5 * torch.log(
            torch.tensor(2 * torch.pi))
        return prev, lp.mean(dim=(1, 2))

    def step(self, step: int) -> dict[str, float]:
        """One RL step; returns its phase times (s)."""
        t, t0 = {}, time.perf_counter()
        cfg, r = self.cfg, self.cfg.rollout
        prompts = [PROMPTS[(step * r.prompts_per_step + i) % len(PROMPTS)] for i in range(r.prompts_per_step)]
        prompts = [p for p in prompts for _ in range(r.group_size)]
        n = len(prompts)
        with torch.no_grad():
            emb, mask = self.pipe.encode_prompt(prompts)
            h = w = r.height // 16
            lat = torch.randn(n, h * w, self.tr.config.in_channels, generator=torch.Generator().manual_seed(step))
            from megatron_omni.algorithms.schedule import ShiftConfig, qwen_image_sigmas

            sig = qwen_image_sigmas(r.num_steps, h * w, ShiftConfig.from_scheduler_config(self.pipe.scheduler.config))
            gen = torch.Generator().manual_seed(step + 1)
            rec = []
            for i in range(r.num_steps):
                s = sig[i].expand(n)
                v = self.tr(hidden_states=lat, encoder_hidden_states=emb, encoder_hidden_states_mask=mask,
                            timestep=s, img_shapes=[[(1, h, w)]] * n, return_dict=False)[0]
                a = r.noise_level if i < r.window_size else 0.0
                if a > 0:
                    nxt, lp = self.sde_step(lat, v, s, sig[i + 1].expand(n), sig[1].expand(n), a, gen=gen)
                    rec.append((lat, nxt, lp, s, sig[i + 1].expand(n)))
                else:
                    nxt = lat + v * (sig[i + 1] - sig[i])
                lat = nxt
            images = self.pipe.vae.decode(
                self.pipe._unpack_latents(lat, r.height, r.width, self.pipe.vae_scale_factor).to(self.pipe.vae.dtype),
                return_dict=False)[0][:, :, 0]
            images = (images / 2 + 0.5).clamp(0, 1)
        t["rollout"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        rewards = jpeg_reward(images)
        t["reward"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        g = rewards.view(-1, r.group_size)
        adv = ((g - g.mean(1, keepdim=True)) / (rewards.std() + 1e-4)).clamp(-5, 5).flatten()
        for rows in torch.randperm(n).chunk(cfg.optim.mini_batches):
            self.opt.zero_grad()
            for x, nxt, old, s, s_next in rec:
                v = self.tr(hidden_states=x[rows], encoder_hidden_states=emb[rows],
                            encoder_hidden_states_mask=mask[rows], timestep=s[rows],
                            img_shapes=[[(1, h, w)]] * len(rows), return_dict=False)[0]
                _, lp = self.sde_step(x[rows], v, s[rows], s_next[rows], sig[1].expand(len(rows)), r.noise_level,
                                      prev=nxt[rows])
                ratio = torch.exp(lp - old[rows])
                eps = cfg.algorithm.clip_range
                loss = torch.maximum(-adv[rows] * ratio, -adv[rows] * ratio.clamp(1 - eps, 1 + eps)).mean()
                (loss / len(rec)).backward()
            torch.nn.utils.clip_grad_norm_(self.tr.parameters(), cfg.optim.clip_grad)
            self.opt.step()
        t["train"] = time.perf_counter() - t0
        return t


def _spread(values: list[float]) -> str:
    """median [min..max] of a list of timings or ratios."""
    return f"{statistics.median(values):.3f} [{min(values):.3f}..{max(values):.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="measured step pairs (ours, reference)")
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured step pairs first")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both sides (default: torch's)")
    ap.add_argument("--size", type=int, default=64)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.update(RANK="0", WORLD_SIZE="1")
    platform.init_distributed()
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    with tempfile.TemporaryDirectory() as tmp:
        folder = make_tiny_pipeline(Path(tmp) / "small", seed=0, config=TinyPipelineConfig(SMALL_TRANSFORMER))
        cfg = JobConfig(prompts=PROMPTS, run_dir=str(Path(tmp) / "run"))
        cfg.rollout.height = cfg.rollout.width = args.size
        cfg.rollout.num_steps = 6
        cfg.rollout.window_size = 2
        cfg.rollout.window_range = [0, cfg.rollout.window_size]  # the reference trains the first window
        # flow_grpo trains against the log-probs recorded while sampling: the same work is our bypass mode.
        cfg.algorithm.old_logprob = "bypass"
        ours = FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout()), folder,
                               RewardFunction("jpeg_compressibility"))
        ref = ReferenceFlowGRPO(folder, cfg)
        n = cfg.rollout.prompts_per_step * cfg.rollout.group_size

        def run_ours(step: int) -> dict[str, float]:
            metrics = ours.train_step(step).metrics
            return {k[5:]: v for k, v in metrics.items() if k.startswith("time_") and k != "time_step"}

        sides = {"ours": run_ours, "reference": ref.step}
        times: dict[str, list[float]] = {"ours": [], "reference": []}
        phases: dict[str, dict[str, list[float]]] = {"ours": {}, "reference": {}}
        ratios = []
        for pair in tqdm(range(args.warmup + args.runs), desc="RL step pairs", unit="pair"):
            order = ["ours", "reference"] if pair % 2 == 0 else ["reference", "ours"]
            took = {}
            for name in order:
                t0 = time.perf_counter()
                phase = sides[name](pair)
                took[name] = time.perf_counter() - t0
                if pair >= args.warmup:
                    for k, v in phase.items():
                        phases[name].setdefault(k, []).append(v)
            if pair >= args.warmup:
                for name in took:
                    times[name].append(took[name])
                ratios.append(took["reference"] / took["ours"])
        print(f"{n} images per step ({cfg.rollout.prompts_per_step} prompts x {cfg.rollout.group_size}), "
              f"{args.size}px, {cfg.rollout.num_steps} sampling steps, window {cfg.rollout.window_size}, "
              f"{cfg.optim.mini_batches} mini-batches, {torch.get_num_threads()} threads (both sides), "
              f"{args.warmup} warm-up + {args.runs} measured pairs, alternating order; ours samples with "
              + ("the trainer's Megatron module (rollout.transformer=auto, one-rank replica)" if ours.shares_model
                 else "the engine's diffusers copy"))
        for name in ("ours", "reference"):
            print(f"{name:9s} by phase, median s: "
                  + ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases[name].items()))
        for name in ("ours", "reference"):
            print(f"{name:9s} s/step median [min..max] {_spread(times[name])}  "
                  f"{n / statistics.median(times[name]):.2f} images/s")
        print(f"ratio ours/reference (images/s), median of pairs [min..max]: {_spread(ratios)}")
    platform.destroy_distributed()


if __name__ == "__main__":
    main()
