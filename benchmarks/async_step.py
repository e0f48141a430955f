"""Images/s of the same RL work (steps x images) run synchronously colocated and asynchronously disaggregated, on
the tiny pipeline, both in one run on the same two ranks (docs/async.md).

Two spawned gloo ranks, each pinned to its own CPU core (`os.sched_setaffinity`) with one torch thread:
- sync colocated, data parallel on both ranks (what a user runs on two devices): each rank rolls out half of the
  step's prompt groups with its embedded diffusers engine, updates its Megatron model replica (FlowGRPO: recomputed
  log-probs, clipped loss, Adam) with the gradients averaged over the two ranks (one flat all-reduce, as DDP does),
  syncs the weights into its engine through the bridge and checks the probe, step after step;
- async disaggregated 1 + 1 (`max_staleness=1`): rank 0 trains, rank 1 serves the rollout
  (`rollout.async_service`): step k+1 is requested before step k trains, weights are pushed through the bridge's
  distributed transport into the rollout's back buffer, swapped in between two requests and probe-checked.

The same prompts, seeds, sampler and update in both. After `--warmup` steps (excluded), it prints the seconds per
step of each phase and each pair's ratio; `--repeats` pairs alternate which mode goes first (drift in a shared
machine's load hits both). Last line: the median of the pairs' images/s async / sync with its spread. Data
parallelism halves both phases of so small a model, so on two equal cores the 1 + 1 split can at best tie it (the
overlap saves max(rollout, train) of rollout + train; halving both saves as much): disaggregation pays where the
phases need different layouts or memory (docs/async.md, the 20B table).
Usage: python benchmarks/async_step.py [--steps 8] [--warmup 2] [--prompts 4] [--group 4] [--size 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from diffusers import QwenImageTransformer2DModel  # noqa: E402

from megatron_omni.bridge import DiffusersTarget, WeightSync  # noqa: E402
from megatron_omni.bridge.qwen_image import megatron_sources  # noqa: E402
from megatron_omni.parallel import ParallelLayout, build_parallel_groups  # noqa: E402
from megatron_omni.parallel.platform import seed_everything  # noqa: E402
from megatron_omni.parallel.rank_pool import run_ranks, shutdown_pools  # noqa: E402
from megatron_omni.rollout.async_service import (  # noqa: E402
    AsyncSettings,
    RolloutClient,
    behaviour_version,
    check_staleness,
    push_weights,
)
from megatron_omni.rollout.async_service.harness import (  # noqa: E402
    PARAMS,
    build_pair,
    flowgrpo_update,
    probe_means,
    rollout_service,
    step_rows,
    trainer_model,
)
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine  # noqa: E402
from megatron_omni.rollout.probe import check_probe, probe_trajectory  # noqa: E402
from model_providers.qwen_image import provider  # noqa: E402
from model_providers.qwen_image.tiny_pipeline import (  # noqa: E402
    SMALL_TRANSFORMER,
    TinyPipelineConfig,
    make_tiny_pipeline,
)

SETTINGS = AsyncSettings(max_staleness=1, liveness_timeout_s=120.0, heartbeat_s=2.0)


def _pin(rank: int) -> int:
    cores = sorted(os.sched_getaffinity(0))
    core = cores[rank % len(cores)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    return core


class _DataParallelAdam(torch.optim.Adam):
    """Adam whose step first averages the gradients over `group` in one flat all-reduce (what DDP's bucket does)."""

    def __init__(self, params, group: dist.ProcessGroup, lr: float) -> None:
        super().__init__(params, lr=lr)
        self.group = group

    def step(self, closure=None):
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=self.group)
        flat /= dist.get_world_size(self.group)
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
        return super().step(closure)


def _sync_colocated(pair, pipeline: str, args, dp_groups) -> dict:
    """Every rank: rollout of its half of the step's prompt groups, data-parallel update, in-process sync + probe,
    one after the other."""
    seed_everything(0)
    model = provider.build_model(provider.transformer_config(pair.hf_config, tp=1), dp_groups)
    ref = QwenImageTransformer2DModel.from_pretrained(Path(pipeline) / "transformer", local_files_only=True)
    provider.load_hf_state_dict(model, ref.state_dict())
    opt = _DataParallelAdam(model.parameters(), dp_groups.dp, lr=1e-3)
    engine = DiffusersRolloutEngine(pipeline, max_batch_size=args.batch)
    sync = WeightSync(pair.plan, sources=megatron_sources(model), target=DiffusersTarget(engine.transformer))
    probe = probe_trajectory(pair.hf_config)
    params = replace(PARAMS, height=args.size, width=args.size, num_steps=args.sampling_steps)
    rank, world = dist.get_rank(), dist.get_world_size()
    t = {"rollout": 0.0, "train": 0.0, "sync": 0.0}
    for k in range(args.steps):
        if k == args.warmup:
            t = dict.fromkeys(t, 0.0)
            start = time.perf_counter()
        rows, seeds = step_rows(k, args.prompts, args.group)
        share = len(rows) // world  # whole prompt groups per rank: the group advantages stay on one rank
        rows, seeds = rows[rank * share:(rank + 1) * share], seeds[rank * share:(rank + 1) * share]
        t0 = time.perf_counter()
        traj = engine.generate(rows, params, group_size=1, seeds=seeds)
        t1 = time.perf_counter()
        flowgrpo_update(model, opt, traj, args.group)
        t2 = time.perf_counter()
        sync.sync()
        check_probe(engine.probe(probe), probe_means(model, pair.hf_config), 1e-4, f"after step {k}")
        t3 = time.perf_counter()
        t["rollout"] += t1 - t0
        t["train"] += t2 - t1
        t["sync"] += t3 - t2
    t["wall"] = time.perf_counter() - start
    return t


def _async_trainer(pair, pipeline: str, args) -> dict:
    model, opt, sync = trainer_model(pair, pipeline)
    client = RolloutClient(pair.groups, SETTINGS)
    params = replace(PARAMS, height=args.size, width=args.size, num_steps=args.sampling_steps)
    s = SETTINGS.max_staleness
    rows, seeds = step_rows(0, args.prompts, args.group)
    client.request(0, 0, rows, seeds, params)
    t = {"train": 0.0, "push": 0.0, "wait": 0.0}
    lags, gen, swap = [], [], []
    for k in range(args.steps):
        if k == args.warmup:
            t = dict.fromkeys(t, 0.0)
            start = time.perf_counter()
        if k + 1 < args.steps:
            rows, seeds = step_rows(k + 1, args.prompts, args.group)
            client.request(k + 1, behaviour_version(k + 1, s), rows, seeds, params)
        t0 = time.perf_counter()
        traj = client.collect(k)
        t1 = time.perf_counter()
        gen.append(max(client.last_seconds.values()))
        swap.append(max(client.last_swap_seconds.values()))
        lags += check_staleness(traj, k, s, k).tolist()
        flowgrpo_update(model, opt, traj, args.group)
        t2 = time.perf_counter()
        if k + 1 < args.steps:
            push_weights(k + 1, sync, probe_means(model, pair.hf_config), client)
        t3 = time.perf_counter()
        t["wait"] += t1 - t0
        t["train"] += t2 - t1
        t["push"] += t3 - t2
    t["wall"] = time.perf_counter() - start
    stats = client.close()
    return {**t, "lags": lags, "generate_s": gen, "swap_s": swap, "rollout": stats}


def _bench(rank: int, world_size: int, pipeline: str, args) -> dict:
    core = _pin(rank)
    pair = build_pair(pipeline, world_size)
    dp_groups = build_parallel_groups(ParallelLayout(tp=1))  # the colocated job: data parallel over both ranks
    out: dict = {"core": core, "sync": [], "async": []}
    for i in range(args.repeats):
        # alternate which goes first, so drift in the machine's load hits both
        for mode in (("sync", "async") if i % 2 == 0 else ("async", "sync")):
            dist.barrier()
            if mode == "sync":  # synchronous, colocated, data parallel over both ranks
                out["sync"].append(_sync_colocated(pair, pipeline, args, dp_groups))
            elif mode == "async" and pair.role == "rollout":  # asynchronous: rank 1 rolls out, rank 0 trains
                service, _ = rollout_service(pair, pipeline, SETTINGS, max_batch_size=args.batch)
                service.serve()
            elif mode == "async":
                out["async"].append(_async_trainer(pair, pipeline, args))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--size", type=int, default=64, help="image height and width")
    ap.add_argument("--sampling-steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=8, help="samples per rollout forward")
    ap.add_argument("--repeats", type=int, default=3, help="sync/async pairs, the order alternating")
    ap.add_argument("--transformer", choices=("tiny", "small"), default="small",
                    help="the tiny pipeline's transformer: its default, or the ~10M-parameter one of train_step.py")
    args = ap.parse_args()
    if not 0 <= args.warmup < args.steps:
        ap.error(f"--warmup {args.warmup} must be in [0, --steps {args.steps})")
    if args.prompts % 2:
        ap.error(f"--prompts {args.prompts} must be even: the colocated side splits the prompt groups over 2 ranks")
    with tempfile.TemporaryDirectory() as tmp:
        config = TinyPipelineConfig(SMALL_TRANSFORMER) if args.transformer == "small" else None
        pipeline = str(make_tiny_pipeline(Path(tmp) / "tiny", seed=0, config=config))
        trainer, rollout = run_ranks(_bench, 2, pipeline, args, timeout_s=1800)
        shutdown_pools()  # the ranks exit cleanly now: nothing of theirs is reported after the last line
    n = args.steps - args.warmup
    images = n * args.prompts * args.group
    print(f"work: {n} timed steps x {args.prompts * args.group} images ({args.size}x{args.size}, "
          f"{args.sampling_steps} sampling steps), warm-up {args.warmup}, {args.repeats} repeats, order "
          f"alternating; "
          f"trainer on core {trainer['core']}, rollout on core {rollout['core']}")
    ratios = []
    for i, (s, a) in enumerate(zip(trainer["sync"], trainer["async"])):
        r = a["rollout"][1]
        print(f"[{i}] sync colocated dp2: {s['wall'] / n:.2f} s/step = rollout {s['rollout'] / n:.2f} + train "
              f"{s['train'] / n:.2f} + sync/probe {s['sync'] / n:.2f} (rank 0; each rank half the images)")
        # the rollout side's busy time in the timed window: generating the steps trained in it (Result.seconds)
        busy = sum(a["generate_s"][k] + a["swap_s"][k] for k in range(args.warmup, args.steps))
        print(f"[{i}] async disagg. 1+1: {a['wall'] / n:.2f} s/step; trainer: train {a['train'] / n:.2f} + push "
              f"{a['push'] / n:.2f} + waiting for rollouts {a['wait'] / n:.2f}; rollout: generate "
              f"{sum(a['generate_s'][args.warmup:]) / n:.2f} + swap/probe {sum(a['swap_s'][args.warmup:]) / n:.2f}; "
              f"idle: trainer side {a['wait'] / a['wall']:.0%}, rollout side {max(0.0, 1 - busy / a['wall']):.0%}; "
              f"staleness max {max(a['lags'])}; rollout requests {r['requests']}, swaps {r['swaps']}")
        print(f"[{i}] images/s: sync colocated dp2 {images / s['wall']:.2f}, async 1+1 {images / a['wall']:.2f}; "
              f"ratio {s['wall'] / a['wall']:.2f}")
        ratios.append(s["wall"] / a["wall"])
    print(f"images/s async 1+1 / sync colocated dp2 (same 2 cores): {statistics.median(ratios):.2f} (median of "
          f"{len(ratios)}; "
          f"min {min(ratios):.2f}, max {max(ratios):.2f})")


if __name__ == "__main__":
    main()
