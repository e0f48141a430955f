"""How much of the reward time the streaming client hides behind rollout (issue 7).

Rollout: a denoising loop (10-step Euler ODE, the Qwen-Image recipe's step count) of diffusers'
`QwenImageTransformer2DModel` at the `small` preset (model_providers/qwen_image/presets.py), one sample at a
time, on one torch thread. Each final latent becomes an RGB image deterministically: a fixed random 16->3
projection, upsampled, with the word the prompt asks for rendered into it, so the OCR reader has real text
to read (an untrained model draws none).

Reward: the OCR scorer in a reward server in its own process (1 worker, 1 thread), over HTTP.

Resources: the reward runs on its own device, as on the GPU clusters (reward GPUs apart from the training
GPUs). On CPU that is its own core: with 2 or more CPUs this process (rollout) is pinned to the first and
the server (`--cpus`) to the others; `--no-pin` shares all cores between them.

Two ways to run the same step, interleaved over several runs (median reported):
- synchronous: generate all images, then score them all (step = rollout + reward);
- overlapped: submit each image to the server as soon as it is generated, gather after the last.

Printed: both step times, the rollout and reward times of the synchronous step, the ideal saving
min(rollout, reward) / (rollout + reward), the achieved saving (sync - overlapped) / sync, and LAST the
achieved fraction of the ideal (target >= 0.8), from the median step times.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/reward_overlap.py [--samples 16] [--runs 7] [--no-pin]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
from diffusers import QwenImageTransformer2DModel
from PIL import Image, ImageDraw, ImageFont
from tqdm import tqdm

from megatron_omni.reward.client import RewardClient
from megatron_omni.reward.launcher import RewardServerProcess
from model_providers.qwen_image.presets import preset

WORDS = ["HELLO", "OPEN", "SALE", "CAFE", "TAXI", "HOTEL", "BOOKS", "EXIT", "PIZZA", "BANK", "ZOO", "GYM"]
LATENT_CHANNELS = 16
TEXT_TOKENS = 8


class TinyRollout:
    """A pixel-space denoising loop of a small QwenImageTransformer2DModel, one image per call."""

    def __init__(self, *, image_size: int, latent_size: int, steps: int, seed: int = 0):
        torch.manual_seed(seed)
        config = preset("small")
        assert config["out_channels"] == LATENT_CHANNELS
        self.model = QwenImageTransformer2DModel(**config).eval()
        self.image_size, self.latent_size, self.steps = image_size, latent_size, steps
        g = torch.Generator().manual_seed(seed + 1)
        self.to_rgb = torch.randn(3, LATENT_CHANNELS, generator=g) / LATENT_CHANNELS**0.5
        self.text = {w: torch.randn(1, TEXT_TOKENS, config["joint_attention_dim"], generator=g) for w in WORDS}
        self.font = ImageFont.truetype("DejaVuSans-Bold.ttf", max(10, image_size // 6))

    @torch.no_grad()
    def generate(self, index: int, word: str) -> Image.Image:
        """Image (image_size x image_size RGB) of sample `index` asked to show `word`."""
        h = self.latent_size // 2
        g = torch.Generator().manual_seed(1000 + index)
        x = torch.randn(1, h * h, 4 * LATENT_CHANNELS, generator=g)
        enc = self.text[word]
        mask = torch.ones(1, TEXT_TOKENS, dtype=torch.long)
        sigmas = torch.linspace(1.0, 0.0, self.steps + 1)
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            v = self.model(x, enc, mask, s.reshape(1), img_shapes=[(1, h, h)], return_dict=False)[0]
            x = x + (s_next - s) * v
        # Unpack 2x2 patches (diffusers' _pack_latents order) -> (C, H, W) latent.
        lat = x.view(1, h, h, LATENT_CHANNELS, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(LATENT_CHANNELS, 2 * h, 2 * h)
        rgb = torch.sigmoid(torch.einsum("kc,chw->khw", self.to_rgb, lat))
        rgb = torch.nn.functional.interpolate(rgb[None], size=(self.image_size,) * 2, mode="bilinear")[0]
        field = (rgb.permute(1, 2, 0).numpy() * 255).astype(np.float32)
        text = Image.new("L", (self.image_size,) * 2, 255)
        draw = ImageDraw.Draw(text)
        w = draw.textlength(word, font=self.font)
        draw.text(((self.image_size - w) / 2, self.image_size * 0.4), word, fill=0, font=self.font)
        ink = np.asarray(text, np.float32)[..., None] / 255.0
        img = 0.45 * field + 0.55 * 255 * ink  # dark text over a model-generated colour field
        return Image.fromarray(img.clip(0, 255).astype(np.uint8))


def sync_step(rollout: TinyRollout, client: RewardClient, n: int) -> tuple[float, float, list[float]]:
    """Generate all, then score all; returns (rollout_s, reward_s, rewards)."""
    t0 = time.perf_counter()
    images = [rollout.generate(i, WORDS[i % len(WORDS)]) for i in range(n)]
    t1 = time.perf_counter()
    for i, im in enumerate(images):
        client.submit(i, im, f'a shop sign that says "{WORDS[i % len(WORDS)]}"')
    rewards = client.gather()
    return t1 - t0, time.perf_counter() - t1, rewards


def overlapped_step(rollout: TinyRollout, client: RewardClient, n: int) -> tuple[float, float, list[float]]:
    """Submit each image as soon as it exists; returns (step_s, rollout_s, rewards)."""
    t0 = time.perf_counter()
    for i in range(n):
        word = WORDS[i % len(WORDS)]
        client.submit(i, rollout.generate(i, word), f'a shop sign that says "{word}"')
    t1 = time.perf_counter()
    rewards = client.gather()
    return time.perf_counter() - t0, t1 - t0, rewards


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=16, help="images per step")
    p.add_argument("--runs", type=int, default=7, help="pairs of steps (sync + overlapped, order alternating)")
    p.add_argument("--steps", type=int, default=10, help="denoising steps per image")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--latent-size", type=int, default=16, help="latent side (tokens = (side/2)^2)")
    p.add_argument("--no-pin", action="store_true", help="let the rollout and the reward server share all CPUs")
    a = p.parse_args()
    torch.set_num_threads(1)  # one core for the rollout, one for the reward worker
    cpus = sorted(os.sched_getaffinity(0))
    extra_args = []
    if not a.no_pin and len(cpus) >= 2:
        extra_args = ["--cpus", ",".join(map(str, cpus[1:]))]
        print(f"rollout pinned to CPU {cpus[0]}, reward server to CPUs {cpus[1:]}")

    rollout = TinyRollout(image_size=a.image_size, latent_size=a.latent_size, steps=a.steps)
    with RewardServerProcess("ocr", workers=1, max_queue=4 * a.samples, max_batch=16, extra_args=extra_args) as srv:
        if extra_args:
            os.sched_setaffinity(0, {cpus[0]})  # after the server started: it must not inherit this
        with RewardClient(srv.url, timeout_s=300) as client:
            sync_step(rollout, client, 2)  # warm both sides (first forward, first OCR, connections)
            ts, rs, ws, to, ro = [], [], [], [], []
            load_before = os.getloadavg()[0]
            ref_rewards = None
            for r in tqdm(range(a.runs), desc="runs (sync + overlapped)"):
                order = ("sync", "ovl") if r % 2 == 0 else ("ovl", "sync")
                for mode in order:
                    if mode == "sync":
                        r_s, w_s, rew = sync_step(rollout, client, a.samples)
                        ts.append(r_s + w_s)
                        rs.append(r_s)
                        ws.append(w_s)
                    else:
                        t_o, r_o, rew = overlapped_step(rollout, client, a.samples)
                        to.append(t_o)
                        ro.append(r_o)
                    if ref_rewards is None:
                        ref_rewards = rew
                    elif rew != ref_rewards:
                        raise RuntimeError(f"rewards differ between runs: {rew} vs {ref_rewards}")
    load_after = os.getloadavg()[0]
    t_sync, t_ovl = statistics.median(ts), statistics.median(to)
    r_med, w_med = statistics.median(rs), statistics.median(ws)
    ideal = min(r_med, w_med) / (r_med + w_med)
    achieved = (t_sync - t_ovl) / t_sync
    # Per pair (two steps back to back, under about the same outside load): shows the spread.
    pair_fractions = [((t_s - t_o) / t_s) / (min(r_s, w_s) / (r_s + w_s)) for t_s, t_o, r_s, w_s in zip(ts, to, rs, ws)]
    print(f"samples per step: {a.samples}, image {a.image_size}px, {a.steps} steps, runs: {a.runs}")
    print(f"mean OCR reward: {np.mean(ref_rewards):.3f} (identical in every run and mode)")
    print(f"rollout time (sync step): {r_med:.3f} s   reward time (sync step): {w_med:.3f} s")
    print(f"rollout time inside the overlapped step: {statistics.median(ro):.3f} s")
    print(f"load average (1 min) before/after: {load_before:.1f}/{load_after:.1f} on {os.cpu_count()} cores")
    if max(load_before, load_after) > (os.cpu_count() or 1) + 1:
        # Under outside load the overlapped step (two busy processes) gets a larger CPU share than each
        # phase of the synchronous step (one busy process), and load spikes land on either mode.
        print("WARNING: the machine is loaded by other work; the figures below are unreliable")
    print(f"step time synchronous: {t_sync:.3f} s   overlapped: {t_ovl:.3f} s")
    print(f"ideal saving min(rollout, reward)/(rollout + reward): {ideal:.3f}")
    print(f"achieved saving (sync - overlapped)/sync: {achieved:.3f}")
    print(f"per-pair fractions of the ideal (spread): {' '.join(f'{f:.2f}' for f in pair_fractions)}")
    print(f"achieved fraction of the ideal saving (from the median times): {achieved / ideal:.2f}")


if __name__ == "__main__":
    main()
