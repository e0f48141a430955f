"""Time of one AR-DiT RL step (the tiny hybrid's joint GRPO + FlowGRPO step: plan rollout, DiT rollout,
recomputed old log-probs, update, weight sync) against the torch reference hybrid at the same layout, on CPU.

- ours: `ARDiTTrainer` (Megatron-Core decoder and DiT, Megatron's DDP and Adam, the bridge's sync into the
  embedded rollout) at TP=1 on one rank; also TP=2 and CP=2 on two gloo ranks, with the share of the step spent in
  the decoder versus the DiT;
- the reference (what a user of the torch modules would run): the same hybrid as Hugging Face modules
  (transformers' Qwen2 decoder, the connector, diffusers' DiT), the same embedded rollout engine on them, the same
  rewards, advantages, losses and mini-batches, the old log-probs recomputed by those modules, torch's AdamW and
  gradient clipping; no weight sync (the rollout samples with the trained modules themselves). One rank, one
  thread, like ours at TP=1.

Each side runs one warm-up step, then `--steps` measured steps; `--repeats` pairs alternate which side goes first
(a shared machine's load hits both). Printed: per layout the median step and its decoder/DiT split, the TP=2 and
CP=2 step-time ratios to TP=1, and LAST the median of the pairs' step time reference / ours at TP=1 (> 1: ours is
faster).
Usage: python benchmarks/ar_dit_step.py [--steps 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_omni.parallel import rank_pool  # noqa: E402


def _steps(rank: int, world_size: int, layout: dict[str, int], steps: int) -> list[dict]:
    from tqdm import tqdm

    from examples.ar_dit.recipe import BrightnessAndLowTokens, tiny_config
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.ar_dit import ARDiTTrainer

    groups = build_parallel_groups(ParallelLayout(**layout))
    trainer = ARDiTTrainer(tiny_config(), groups, BrightnessAndLowTokens(vocab_size=128))
    out = []
    for step in tqdm(range(steps + 1), desc=f"{layout} rank {rank}", disable=rank != 0):
        metrics = trainer.train_step(step).metrics
        if step > 0:  # step 0 warms up (first-use allocations, lazy imports)
            out.append(metrics)
    return out


def _reference_steps(rank: int, world_size: int, steps: int) -> list[float]:
    """The torch reference hybrid's RL step times (seconds; the warm-up step excluded)."""
    import dataclasses
    import time

    import torch
    import torch.nn.functional as F

    from examples.ar_dit.recipe import BrightnessAndLowTokens, tiny_config
    from megatron_omni.algorithms.advantages import group_advantages
    from megatron_omni.algorithms.loss import flowgrpo_loss
    from megatron_omni.algorithms.token_loss import grpo_token_loss, joint_loss
    from megatron_omni.algorithms.transition import transition_step
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.rollout.diffusers_engines.ar_dit import ARDiTRolloutEngine, plan_positions
    from megatron_omni.trainer.skeleton import mini_batch_rows, step_prompts
    from model_providers import get_family

    c = tiny_config()
    seed_everything(c.seed)
    hybrid = get_family("ar_dit").reference_model(c.hybrid, seed=c.seed)
    engine = ARDiTRolloutEngine(hybrid)
    reward_fn = BrightnessAndLowTokens(vocab_size=hybrid.config.decoder["vocab_size"])
    decoder = list(hybrid.decoder.parameters())
    rest = [p for m in (hybrid.connector, hybrid.dit) for p in m.parameters()]
    opt = torch.optim.AdamW([{"params": decoder, "lr": c.lr * c.decoder_lr_scale}, {"params": rest, "lr": c.lr}],
                            betas=tuple(c.adam_betas), eps=c.adam_eps, weight_decay=c.weight_decay)

    def log_probs(traj):
        out = hybrid.decoder(input_ids=traj.tokens, output_hidden_states=True)
        cond = hybrid.connector(out.hidden_states[-1]).float()
        labels = torch.cat([traj.tokens[:, 1:], traj.tokens[:, -1:]], 1)
        lp = F.log_softmax(out.logits.float() / traj.temperature, dim=-1).gather(-1, labels[..., None])[..., 0]
        idx = plan_positions(traj.prompt_lens, traj.plan_mask.shape[1]).clamp(max=traj.tokens.shape[1] - 2)
        sub = dataclasses.replace(traj.image, prompt_embeds=cond)
        rows = torch.arange(len(traj))
        win = torch.stack([transition_step(sub, hybrid.dit, rows, j).log_prob
                           for j in range(traj.image.window_size)], dim=1)
        return lp.gather(1, idx) * traj.plan_mask, win

    times = []
    for step in range(steps + 1):
        t0 = time.perf_counter()
        prompts, gids, seeds = step_prompts(c.prompts, c.seed, step, c.prompts_per_step, c.group_size, 0, 1)
        traj = engine.generate(prompts, c.sampling, group_size=c.group_size, seeds=seeds, group_ids=gids)
        adv = group_advantages(reward_fn(traj).float(), traj.image.group_ids, std_mode=c.std_mode).advantages
        with torch.no_grad():
            old_tok, old_win = log_probs(traj)
        for rows in mini_batch_rows(len(traj), c.seed, step, c.mini_batches):
            sub = traj.select(rows)
            opt.zero_grad(set_to_none=True)
            tok_lp, win_lp = log_probs(sub)
            tok = grpo_token_loss(tok_lp, old_tok[rows], adv[rows], sub.plan_mask, c.token_clip, c.aggregation) \
                if c.token_weight > 0 else None
            win = flowgrpo_loss(win_lp, old_win[rows], adv[rows], c.window_clip) if c.window_weight > 0 else None
            loss, _ = joint_loss(tok, win, c.token_weight, c.window_weight)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(decoder + rest, c.clip_grad)
            opt.step()
        if step > 0:  # step 0 warms up
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3, help="ours/reference pairs at TP=1, the order alternating")
    args = parser.parse_args()
    med = {}
    layouts = {"tp=1": dict(tp=1), "tp=2": dict(tp=2), "cp=2": dict(ulysses=2)}
    for name, layout in layouts.items():
        if name == "tp=1":
            continue  # measured in the pairs below
        ranks = layout.get("tp", 1) * layout.get("ulysses", 1)
        metrics = rank_pool.run_ranks(_steps, ranks, layout, args.steps, timeout_s=900)[0]
        rank_pool.shutdown_pools()  # one layout's ranks at a time on the shared cores
        med[name] = {k: statistics.median(m[k] for m in metrics) for k in ("time_step", "time_decoder", "time_dit")}
    ours, ref, ratios = [], [], []
    for i in range(args.repeats):
        sides = ("ours", "reference") if i % 2 == 0 else ("reference", "ours")
        got = {}
        for side in sides:  # each on one rank process with one torch thread
            if side == "ours":
                got[side] = rank_pool.run_ranks(_steps, 1, dict(tp=1), args.steps, timeout_s=900)[0]
            else:
                got[side] = rank_pool.run_ranks(_reference_steps, 1, args.steps, timeout_s=900)[0]
            rank_pool.shutdown_pools()
        ours += got["ours"]
        ref += got["reference"]
        ratios.append(statistics.median(got["reference"]) / statistics.median(m["time_step"] for m in got["ours"]))
    med["tp=1"] = {k: statistics.median(m[k] for m in ours) for k in ("time_step", "time_decoder", "time_dit")}
    for name in ("tp=1", "tp=2", "cp=2"):
        count = len(ours) if name == "tp=1" else args.steps
        print(f"ours {name}: step {med[name]['time_step']:.3f} s (median of {count}), "
              f"decoder {med[name]['time_decoder']:.3f} s, DiT {med[name]['time_dit']:.3f} s")
    print(f"torch reference hybrid, 1 rank: step {statistics.median(ref):.3f} s (median of {len(ref)})")
    for name in ("tp=2", "cp=2"):
        print(f"step time ours {name} / ours tp=1: {med[name]['time_step'] / med['tp=1']['time_step']:.2f}")
    d, t = med["tp=1"]["time_decoder"], med["tp=1"]["time_dit"]
    print(f"decoder vs DiT share of our step (tp=1): decoder {100 * d / (d + t):.0f}% / DiT {100 * t / (d + t):.0f}%")
    print(f"step time torch reference / ours at tp=1 (same rank, same thread): {statistics.median(ratios):.2f} "
          f"(median of {len(ratios)} pairs; min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
