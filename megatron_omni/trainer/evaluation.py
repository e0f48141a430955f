"""Held-out evaluation: fixed prompts and seeds sampled with the ODE (no noise), scored by the run's reward;
optionally also with the rollout's own stochastic sampler (its steps and SDE window), whose gap to the ODE
shows whether RL improves the sampler it is evaluated with or only the one it trains.

The same prompts and seeds before and after training make the images directly comparable; prompts that
also appear in the RL prompt list count as `seen`, the others as `unseen`, and `transfer` prompts are reported
apart, outside the held-out figure. The seeds are ones no RL step samples (`check_eval_seeds`), so a seen prompt
is held out too. Each record also carries the held-out figure's peak so far (`peak_reward_mean`, `peak_step`):
with the last record's own figure, a run that rises and falls back shows. Each evaluation is kept as an `.npz`
(uint8 images, rewards, prompts, seeds) so a resumed run can still draw the before/after grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megatron_omni.rollout.base import SamplingParams
from megatron_omni.trainer import atomic_files
from megatron_omni.trainer.metrics import first_frames
from megatron_omni.trainer.rewards import RewardFunction, RewardTerms


@dataclass
class EvalResult:
    """prompts / seeds: N each; images [N, 3, H, W] fp32 in [0, 1]; rewards [N] fp32; terms: a weighted reward's
    terms of the N samples (None for one scorer)."""

    prompts: list[str]
    seeds: list[int]
    images: torch.Tensor
    rewards: torch.Tensor
    terms: RewardTerms | None = None

    def mean(self, prompts: set[str] | None = None) -> float:
        """Mean reward over all samples, or over the samples whose prompt is in `prompts` (nan if none)."""
        keep = [i for i, p in enumerate(self.prompts) if prompts is None or p in prompts]
        return float(self.rewards[keep].mean()) if keep else float("nan")

    def summary(self, seen: set[str], transfer: set[str] | None = None) -> dict[str, float]:
        """{'reward_mean', 'seen_reward_mean', 'unseen_reward_mean'} over the prompts outside `transfer`, with
        `seen` the RL prompts; with `transfer` prompts also 'transfer_reward_mean' over them."""
        transfer = transfer or set()
        held_out = set(self.prompts) - transfer
        out = {"reward_mean": self.mean(held_out), "seen_reward_mean": self.mean(seen & held_out),
               "unseen_reward_mean": self.mean(held_out - seen)}
        if transfer:
            out["transfer_reward_mean"] = self.mean(transfer & set(self.prompts))
        if self.terms is not None:  # every term of the held-out samples, so a hacked term shows beside the sum
            keep = [i for i, p in enumerate(self.prompts) if p in held_out]
            for j, name in enumerate(self.terms.names):
                v = self.terms.values[keep, j]
                v = v[~v.isnan()]
                out[f"reward_term/{name}_mean"] = float(v.mean()) if v.numel() else float("nan")
        return out

    def save(self, path: Path) -> None:
        """Atomic `.npz` of this result (images as uint8)."""
        images = (self.images.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
        with atomic_files.replacing(path, suffix=".npz") as tmp:
            terms = {} if self.terms is None else {
                "term_names": np.array(self.terms.names), "term_weights": np.array(self.terms.weights),
                "term_values": self.terms.values.numpy()}
            np.savez_compressed(tmp, images=images, rewards=self.rewards.numpy(), prompts=np.array(self.prompts),
                                seeds=np.array(self.seeds, dtype=np.int64), **terms)

    @classmethod
    def load(cls, path: Path) -> EvalResult:
        data = np.load(path)
        terms = None
        if "term_names" in data:
            terms = RewardTerms([str(n) for n in data["term_names"]], [float(w) for w in data["term_weights"]],
                                torch.from_numpy(data["term_values"]))
        return cls(prompts=[str(p) for p in data["prompts"]], seeds=[int(s) for s in data["seeds"]],
                   images=torch.from_numpy(data["images"]).float() / 255.0,
                   rewards=torch.from_numpy(data["rewards"]).float(), terms=terms)


EVAL_SEED_BASE = 10_000_000


def eval_samples(prompts: list[str], seeds_per_prompt: int, seed: int) -> tuple[list[str], list[int]]:
    """Each prompt `seeds_per_prompt` times with fixed seeds (`check_eval_seeds`: none an RL step samples)."""
    rows = [(p, EVAL_SEED_BASE + seed * 1_000 + k) for p in prompts for k in range(seeds_per_prompt)]
    return [p for p, _ in rows], [s for _, s in rows]


def check_eval_seeds(seed: int, seeds_per_prompt: int, rl_samples: int) -> None:
    """Raise ValueError when an evaluation seed (`eval_samples`) is one an RL step samples: the run's RL seeds
    are `seed * SEED_STRIDE + i` for its `rl_samples` samples (`skeleton.step_prompts`), so a held-out image
    would be a training image."""
    from megatron_omni.trainer.skeleton import SEED_STRIDE

    lo, hi = seed * SEED_STRIDE, seed * SEED_STRIDE + rl_samples
    first = EVAL_SEED_BASE + seed * 1_000
    if first < hi and lo < first + seeds_per_prompt:
        raise ValueError(f"evaluation seeds [{first}, {first + seeds_per_prompt}) overlap the RL seeds [{lo}, {hi}) "
                         f"of seed={seed}: pick another seed or fewer steps")


def with_peak(record: dict[str, float], earlier: list[dict]) -> dict[str, float]:
    """`record` (an eval.jsonl record with `step` and `reward_mean`) plus the held-out figure's peak over
    `earlier` records and it: `peak_reward_mean` and the `peak_step` it was reached at (the first, on ties)."""
    best = max([*earlier, record], key=lambda r: (r["reward_mean"], -r["step"]))
    return {**record, "peak_reward_mean": best["reward_mean"], "peak_step": best["step"]}


def evaluate(engine, reward_fn: RewardFunction, prompts: list[str], seeds: list[int],
             params: SamplingParams, ode: bool = True) -> EvalResult:
    """Sample `prompts[i]` with `seeds[i]` on `engine` and score every image: by `params.ode()` (noise 0), or
    with `ode=False` by `params` as given (a stochastic window draws its start and noise from each seed)."""
    if len(prompts) != len(seeds):
        raise ValueError(f"{len(prompts)} prompts but {len(seeds)} seeds")
    if not ode and not params.stochastic:
        raise ValueError("ode=False needs stochastic params (noise_level > 0 and a window): these are the ODE")
    reward_fn.begin(len(prompts))
    traj = engine.generate(prompts, params.ode() if ode else params, group_size=1, seeds=seeds,
                           on_sample=reward_fn.on_sample)
    rewards = reward_fn.collect()
    terms = getattr(reward_fn, "terms", None)
    return EvalResult(prompts=list(prompts), seeds=list(seeds), images=traj.images.detach().cpu(), rewards=rewards,
                      terms=terms if terms is not None and len(terms.values) == len(rewards) else None)


def save_before_after_grid(before: EvalResult, after: EvalResult, path: Path, columns: int = 4,
                           per_prompt: int = 2, transfer: set[str] | None = None) -> str:
    """A PNG with (prompt, seed) samples before and after side by side, captioned with both rewards: the first
    `per_prompt` seeds of each prompt, `columns` pairs per row. The title's means are the held-out figure of
    eval.jsonl and the console (`EvalResult.summary`'s `reward_mean`: every sample whose prompt is not in
    `transfer`), so one run shows one figure. Returns the title."""
    if before.prompts != after.prompts or before.seeds != after.seeds:
        raise ValueError("before/after evaluations used different prompts or seeds")
    if per_prompt < 1:
        raise ValueError(f"per_prompt must be >= 1, got {per_prompt}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown: list[int] = []
    counts: dict[str, int] = {}
    for i, prompt in enumerate(before.prompts):
        counts[prompt] = counts.get(prompt, 0) + 1
        if counts[prompt] <= per_prompt:
            shown.append(i)
    n = len(shown)
    columns = max(1, min(columns, n))
    rows = (n + columns - 1) // columns
    fig, axes = plt.subplots(rows, 2 * columns, figsize=(1.5 * 2 * columns, 1.75 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for k, i in enumerate(shown):
        r, c = divmod(k, columns)
        for j, (res, tag) in enumerate(((before, "before"), (after, "after"))):
            ax = axes[r][2 * c + j]
            ax.imshow(first_frames(res.images)[i].clamp(0, 1).permute(1, 2, 0).numpy())
            ax.set_title(f"{tag} {res.rewards[i]:.2f}\n{res.prompts[i][:18]}", fontsize=6)
    held_out = set(before.prompts) - (transfer or set())
    count = sum(p in held_out for p in before.prompts)
    title = (f"held-out reward over {count} samples: before {before.mean(held_out):.3f} -> after "
             f"{after.mean(held_out):.3f} (shown: {n})")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    atomic_files.save_figure(fig, path, dpi=110)
    return title
