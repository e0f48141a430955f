"""The RL rules and LoRA on SD3.5 and FLUX.1 through the one trainer (the rank task of
`tests/distributed/test_image_vllm_omni.py::test_each_rule_trains_lora_at_cp_or_pp`, which shares that module's tiny
folders and 2-rank pool) (`FlowGRPOTrainer`; nothing in it names a
family): on each family's offline tiny pipeline (real diffusers engine, real Megatron model, real Megatron optimizer)
one trainer with LoRA adapters at a 2-rank layout (SD3.5: Ulysses CP 2, its 3 tiny blocks do not split over 2 stages;
FLUX.1: PP 2) runs one RL step of each rule `algorithm.name` selects: FlowGRPO, MixGRPO, GRPO-Guard
and DiffusionNFT (the configuration each step runs under is validated as a run's would be). Then the steps of each
other 2-rank layout (`OTHER_LAYOUTS`: the four rules at SD3.5 PP 2 on a 4-block variant of the tiny folder, one
FlowGRPO step at FLUX.1 Ulysses and ring CP 2). Last, one FlowGRPO step at `LAYOUTS` of each other `VARIANTS`: full
fine-tuning (no LoRA: every weight trained, the engine synced with the weights themselves; every weight with a
nonzero gradient moves) and LoRA in bf16 (against one rank in bf16, within bf16's measured bounds).

Each step must: give a finite, nonzero loss and gradient norm; recompute the rollout's log-probs (the SDE rules)
within the measured gap; change every adapter that receives a gradient and leave every base weight bit-identical;
and sync merged weights (`rollout.lora_sync=merge`: base + B A through the family's bridge) into the engine's own
transformer copy so that its transition means equal the trainer model's adapted ones within the dtypes' probe
tolerance (the trainer's own check, `check_engine`; the figure is returned and bounded here too). And it must equal
the same step of a single-rank trainer (cp 1, pp 1: the same seeds, so the same trajectory): loss, grad norm, every
adapter's gradient (DDP's `main_grad`, after the step) and its updated value, by model-wide name. The single-rank
trainers run at the end of the task, one per rank at once (each on its own 1-rank groups).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import torch

PROMPTS = ["a red cat", "a bowl of fruit"]
LAYOUTS = {"sd3": {"ulysses": 2}, "flux": {"pp": 2}}
GROUP = 2
# The trainers' settings beside the rules' (`_steps`' keywords): LoRA in fp32 (every layout), and one FlowGRPO step
# at `LAYOUTS` of each other: full fine-tuning (no LoRA) and LoRA with bf16 parameters and rollout
VARIANTS = {"lora": {}, "full": {"lora": False}, "bf16": {"dtype": "bf16"}}
RULES = ("flowgrpo", "mixgrpo", "grpo_guard", "diffusionnft")
# (layout, four_blocks, rules): one step of each rule in turn, as at `LAYOUTS`; `four_blocks`: on the family's tiny
# folder rebuilt with 4 blocks (SD3.5's 3 do not split over 2 stages)
OTHER_LAYOUTS = {"sd3": [({"pp": 2}, True, RULES)],
                 "flux": [({"ulysses": 2}, False, ("flowgrpo",)), ({"ring": 2}, False, ("flowgrpo",))]}
# Measured (fp32, tiny presets, 2 shared cores): trainer/rollout log-prob gap 0 (FLUX) and <= 2.4e-7 (SD3.5 with CFG
# 4.5); merged engine vs adapted trainer probe means <= 1e-6. Bounds leave an order of magnitude.
DLOGP_TOL = 1e-5
PROBE_TOL = 1e-5
# A step at a 2-rank layout against the single-rank step. Measured (both families, every rule and layout, load ~33):
# rollout log-probs 0 (the same trajectory), loss <= 4.8e-7 (DiffusionNFT's 7.0), grad norm <= 1.8e-7 relative,
# adapters' gradients <= 5.8e-6 of the largest, updated adapters <= 6.7e-4 of the largest B (Adam's first steps
# divide by |g|: the smallest gradients' last bits move them; a wrong gradient moves them by the whole step).
SINGLE_LOGP_TOL = 1e-6
SINGLE_GRAD_TOL = 1e-4
SINGLE_LOSS_TOL = 1e-5
SINGLE_ADAPTER_TOL = 1e-2
# Full fine-tuning (no LoRA, FlowGRPO at SD3.5's CP 2 / FLUX.1's PP 2): updated weights against the single-rank
# trainer's, relative to the step's largest update (Adam's first step: lr for every weight whose gradient is not
# tiny). Measured: SD3.5 1.1e-2, FLUX.1 2.3e-3 (load ~5). A wrong gradient moves a weight by a whole step.
SINGLE_FULL_TOL = 1e-1
# bf16 (LoRA, FlowGRPO, `model.params_dtype=rollout.dtype=bf16`) at `LAYOUTS` against one rank in bf16. Measured (load
# ~5): probe 3.5e-3 and trainer/rollout dlogp 4.7e-4 (SD3.5; FLUX.1 0); against one rank FLUX.1 PP 2 bit-exact
# (grad norm 3.5e-8), SD3.5 Ulysses CP 2: rollout log-probs 0, loss 0, grad norm 3.2e-4, gradients 7.8e-3, updated B
# 6.4e-2 in norm (elementwise up to 2 lr: Adam's step on a near-zero gradient flips sign with its last bf16 bits, so
# the elementwise bound is not applied). A wrong gradient gives ~1 in norm.
BF16_PROBE_TOL = 2e-2
BF16_DLOGP_TOL = 5e-3
BF16_GRAD_TOL = 5e-2
BF16_B_NORM_TOL = 0.3
FP8_KEYS = ("loss", "grad_norm", "train_rollout_dlogp", "train_rollout_dlogp_max", "is_weight_mean", "is_weight_max",
            "train_rollout_dlogp_after_is", "sync_probe_max_diff", "sync_probe_quant_diff", "sync_probe_quant_bound")


def four_block_folder(family: str, root: Path) -> str:
    """The family's tiny pipeline folder (seed 0) with a 4-block transformer (SD3.5: dual, plain | plain,
    context-pre-only), for PP 2."""
    if family != "sd3":
        raise ValueError(f"no 4-block variant is needed for {family!r}")
    from model_providers.sd3.presets import preset
    from model_providers.sd3.tiny_pipeline import TinySD3PipelineConfig, make_tiny_pipeline

    cfg = TinySD3PipelineConfig(transformer=dict(preset("tiny"), num_layers=4, dual_attention_layers=(0,)))
    return str(make_tiny_pipeline(root / "sd3-4-blocks", 0, cfg))


def layout_name(layout: dict) -> str:
    return "+".join(f"{k}{v}" for k, v in layout.items()) or "single"


def _config(family: str, rule: str, layout: dict, lora: bool = True, dtype: str = "fp32"):
    from megatron_omni.trainer.config import JobConfig

    cfg = JobConfig(prompts=PROMPTS, seed=3)
    cfg.model.family = family
    for k, v in layout.items():
        setattr(cfg.parallel, k, v)
    r = cfg.rollout
    r.height = r.width = 32
    r.num_steps = 4
    r.window_size = 2
    r.noise_level = 1.2
    r.max_sequence_length = 8
    r.prompts_per_step = len(PROMPTS)
    r.group_size = GROUP
    r.transformer = "engine"  # the engine samples with its own copy: the merged sync is exercised
    r.lora_sync = "merge" if lora else "auto"  # full fine-tuning syncs the weights themselves
    if family == "sd3":
        r.guidance_scale, r.negative_prompt = 4.5, ""
    cfg.model.lora.rank, cfg.model.lora.alpha = (4 if lora else 0), 8.0
    cfg.model.params_dtype = r.dtype = dtype
    cfg.optim.lr = 1e-2
    cfg.optim.mini_batches = 1
    cfg.algorithm.clip_range = 0.2
    cfg.algorithm.name = rule
    if rule == "mixgrpo":
        r.window_range = [0, 4]
        cfg.algorithm.mixgrpo = replace(cfg.algorithm.mixgrpo, steps_per_move=1)
    if rule == "diffusionnft":
        cfg.rollout.noise_level = 0.0
        cfg.algorithm.nft = replace(cfg.algorithm.nft, decay_cap=0.0, timestep_fraction=0.5)
    return cfg


def _steps(family: str, folder: str, layout: dict, rules: tuple[str, ...], world_size: int, groups,
           job_group=None, lora: bool = True, dtype: str = "fp32") -> dict:
    """One trainer at `layout` on `groups` runs one step of each of `rules` in turn (the trainer reads `algorithm`
    per step: the same model and adapters go on under the next rule). Returns per rule the step's figures, its
    adapters' (value, gradient) by model-wide name (`state`) and the rollout's log-probs."""
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    out: dict = {}
    trainer = None
    for step, rule in enumerate(rules):
        cfg = _config(family, rule, layout, lora, dtype)
        cfg.validate(world_size)
        if trainer is None:
            trainer = FlowGRPOTrainer(cfg, groups, folder, RewardFunction("jpeg_compressibility"), job_group=job_group)
        else:
            trainer.cfg = cfg
        named = dict(trainer.model.named_parameters())
        before = {k: v.detach().clone() for k, v in named.items()}
        result = trainer.train_step(step)
        m = result.metrics
        trainable = {k for k, v in named.items() if v.requires_grad}
        moved = {k for k, v in named.items() if not torch.equal(v.detach(), before[k])}
        glob = trainer.model.global_name
        out[rule] = {
            "loss": m["loss"], "grad_norm": m["grad_norm"], "dlogp_max": m.get("train_rollout_dlogp_max"),
            "probe": m["sync_probe_max_diff"], "trainable": len(trainable), "moved": len(moved),
            "moved_frozen": sorted(moved - trainable), "unmoved": sorted(glob(k) for k in trainable - moved),
            "zero_grad": sorted(glob(k) for k in trainable if not named[k].main_grad.any()),
            "lora_only": all(".lora_" in k for k in trainable),
            "update": max(float((named[k].detach() - before[k]).abs().max()) for k in trainable),
            "window": result.trajectory.window_start.tolist() if result.trajectory.log_probs.numel() else None,
            # after the step: DDP zeroes its grad buffers when the next update starts
            "state": {glob(k): (named[k].detach().clone(), named[k].main_grad.detach().clone()) for k in trainable},
            "log_probs": result.trajectory.log_probs.clone(),
        }
    trainer.close()
    return out


def _single_rank(rank: int, world_size: int, family: str, jobs: list[tuple[str, tuple[str, ...], str]]) -> dict:
    """Each job (folder, rules, variant: a key of `VARIANTS`) run by a single-rank trainer (cp 1, pp 1), job j on
    rank j % world_size, all at once (every rank builds every 1-rank grid, as group creation is collective).
    Returns every job's `_steps` by (folder, rule, variant), on every rank."""
    import torch.distributed as dist

    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.async_loop import MEGATRON_OPTIMIZER_WORLD_GATHERS

    solo, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world_size)])
    groups = [build_parallel_groups(ParallelLayout(), ranks=range(r, r + 1)) for r in range(world_size)][rank]
    mine = {}
    for j, (folder, rules, variant) in enumerate(jobs):
        if j % world_size == rank:
            mine.update({(folder, rule, variant): r for rule, r in
                         _steps(family, folder, {}, rules, 1, groups, solo, **VARIANTS[variant]).items()})
    # Megatron-Core's optimizer gathers its parameter-group keys over the whole job: a rank with fewer trainers to
    # build joins the others' gathers (as a disaggregated job's rollout ranks do)
    built = len(range(rank, len(jobs), world_size))
    for _ in range((len(range(0, len(jobs), world_size)) - built) * MEGATRON_OPTIMIZER_WORLD_GATHERS):
        dist.all_gather_object([None] * world_size, [])
    shares: list = [None] * world_size
    dist.all_gather_object(shares, mine)
    return {k: v for share in shares for k, v in share.items()}


def _against(got: dict, ref: dict) -> dict:
    """A step at a 2-rank layout against the single-rank step (this rank's adapters: a stage's under PP)."""
    state, want = got.pop("state"), ref["state"]
    logp, want_logp = got.pop("log_probs"), ref["log_probs"]
    common = [n for n in state if n in want]
    scale = max(float(g.abs().max()) for _, g in want.values())
    # LoRA: B starts at 0, so its largest value is how far the steps moved it; full fine-tuning: the step's update
    lora_b = [float(want[n][0].abs().max()) for n in want if ".lora_b" in n.lower()]
    return {
        "names": sorted(state), "ref_names": sorted(want),
        "grad_rel": max(float((state[n][1] - want[n][1]).abs().max()) for n in common) / scale,
        "adapter": max(float((state[n][0] - want[n][0]).abs().max()) for n in common),
        "adapter_moved": max(lora_b) if lora_b else ref["update"],
        # the updated B (LoRA) against the single-rank trainer's, in norm: ||B - B_1|| / ||B_1|| (B_1 = its update)
        "b_norm_rel": (math.sqrt(sum(float((state[n][0].float() - want[n][0].float()).square().sum())
                                     for n in common if ".lora_b" in n.lower()))
                       / max(math.sqrt(sum(float(want[n][0].float().square().sum())
                                           for n in common if ".lora_b" in n.lower())), 1e-30)),
        "grad_norm_rel": abs(got["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"],
        "loss": abs(got["loss"] - ref["loss"]),
        "rollout_logp": (math.inf if logp.shape != want_logp.shape
                         else float((logp - want_logp).abs().amax()) if logp.numel() else 0.0),
    }


def other_key(layout: dict, rule: str) -> str:
    """A step's key at one of `OTHER_LAYOUTS` (`pp2`: FlowGRPO, `pp2/mixgrpo`: another rule)."""
    return layout_name(layout) + ("" if rule == "flowgrpo" else f"/{rule}")


def rules(rank: int, world_size: int, family: str, pipeline_dir: str, layout: dict,
          others: list[tuple[dict, str, tuple[str, ...]]]) -> dict:
    """The rules at `layout`, FP8 (FLUX.1), the steps of each of `others` ((layout, folder, rules)), then the
    single-rank steps they are compared with (`single` per rule / layout and rule)."""
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer
    from megatron_omni.trainer.rewards import RewardFunction

    seconds = {}
    t0 = time.perf_counter()
    out = _steps(family, pipeline_dir, layout, RULES, world_size, build_parallel_groups(ParallelLayout(**layout)))
    seconds["rules"] = time.perf_counter() - t0
    if family == "flux":  # FP8 rollout (FLUX.1): the engine's own copy fake-quantized, LoRA merged
        t0 = time.perf_counter()
        cfg = _config(family, "flowgrpo", layout)
        cfg.rollout.quantization, cfg.algorithm.is_cap = "fp8", 2.0
        cfg.validate(world_size)
        fp8 = FlowGRPOTrainer(cfg, build_parallel_groups(ParallelLayout(**layout)), pipeline_dir,
                              RewardFunction("jpeg_compressibility"))
        out["fp8"] = {k: v for k, v in fp8.train_step(0).metrics.items() if k in FP8_KEYS}
        out["fp8"]["quantized"] = fp8.engine.quantizer is not None
        fp8.close()
        seconds["fp8"] = time.perf_counter() - t0
    folders = {}  # key -> (folder, rule)
    jobs = {pipeline_dir: RULES}  # the single-rank trainers: one per folder, the longest rule sequence it needs
    for other, folder, other_rules in others:
        t0 = time.perf_counter()
        steps = _steps(family, folder, other, other_rules, world_size, build_parallel_groups(ParallelLayout(**other)))
        for rule, r in steps.items():
            out[other_key(other, rule)] = r
            folders[other_key(other, rule)] = (folder, rule, "lora")
        # the same sequence of rules from the same start, so a prefix of another's is the same steps
        if len(other_rules) > len(jobs.get(folder, ())):
            assert jobs.get(folder, ()) == other_rules[:len(jobs.get(folder, ()))], (folder, other_rules)
            jobs[folder] = other_rules
        seconds[layout_name(other)] = time.perf_counter() - t0
    for variant in [v for v in VARIANTS if v != "lora"]:  # one FlowGRPO step at `layout`
        t0 = time.perf_counter()
        out[variant] = _steps(family, pipeline_dir, layout, ("flowgrpo",), world_size,
                              build_parallel_groups(ParallelLayout(**layout)), **VARIANTS[variant])["flowgrpo"]
        folders[variant] = (pipeline_dir, "flowgrpo", variant)
        seconds[variant] = time.perf_counter() - t0
    t0 = time.perf_counter()
    single = _single_rank(rank, world_size, family, [(f, rs, "lora") for f, rs in jobs.items()]
                          + [(pipeline_dir, ("flowgrpo",), v) for v in VARIANTS if v != "lora"])
    seconds["single"] = time.perf_counter() - t0
    for rule in RULES:
        out[rule]["single"] = _against(out[rule], single[(pipeline_dir, rule, "lora")])
    for name, key in folders.items():
        out[name]["single"] = _against(out[name], single[key])
    out["seconds"] = seconds
    return out


def _check_step(r: dict, rule: str, what: str, lora: bool = True, bf16: bool = False) -> None:
    s = r["single"]
    shown = {k: v for k, v in r.items() if k not in ("single", "zero_grad")}
    print(f"{what}: {shown}\n  against the single-rank step: "
          f"{({k: v for k, v in s.items() if 'names' not in k})}")
    assert math.isfinite(r["loss"]), (what, r)  # a PPO surrogate at ratio 1 over centred advantages is 0
    assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0.0, (what, r)
    assert r["lora_only"] == lora and r["trainable"] > 0, (what, r)
    assert r["moved_frozen"] == [], (what, r["moved_frozen"])
    # Adam does not move a weight whose gradient is 0 (full fine-tuning: a weight the loss does not reach)
    # (LoRA in fp32: AdamW's decay moves A even at a zero gradient; in bf16 that move is below a bf16 step)
    assert (r["unmoved"] == []) if lora and not bf16 else set(r["unmoved"]) <= set(r["zero_grad"]), (what, r)
    assert r["probe"] <= (BF16_PROBE_TOL if bf16 else PROBE_TOL), (what, r)
    if rule == "diffusionnft":
        assert r["dlogp_max"] is None or math.isnan(r["dlogp_max"]), (what, r)
    else:
        assert r["dlogp_max"] <= (BF16_DLOGP_TOL if bf16 else DLOGP_TOL), (what, r)
    assert s["rollout_logp"] <= SINGLE_LOGP_TOL, (what, s)  # the same trajectory
    grad_tol = BF16_GRAD_TOL if bf16 else SINGLE_GRAD_TOL
    assert s["grad_norm_rel"] <= grad_tol and s["grad_rel"] <= grad_tol, (what, s)
    assert s["loss"] <= SINGLE_LOSS_TOL, (what, s)
    if bf16:
        assert s["b_norm_rel"] <= BF16_B_NORM_TOL, (what, s)
        return
    assert s["adapter"] <= (SINGLE_ADAPTER_TOL if lora else SINGLE_FULL_TOL) * s["adapter_moved"], (what, s)


def check_rules(outs: list[dict], family: str) -> None:
    """Assert what `rules` returned on every rank."""
    for rank, out in enumerate(outs):
        print(f"{family} rank {rank} seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in out["seconds"].items()))
        steps = [(rule, rule) for rule in RULES] + [(rule, other_key(o, rule)) for o, _, rs in OTHER_LAYOUTS[family]
                                                    for rule in rs]
        for rule, key in steps:
            _check_step(out[key], rule, f"{family} rank {rank} {key}")
        _check_step(out["full"], "flowgrpo", f"{family} rank {rank} full fine-tuning", lora=False)
        _check_step(out["bf16"], "flowgrpo", f"{family} rank {rank} bf16", bf16=True)
    # the ranks' adapters (a stage's each under PP; every weight under full fine-tuning) are the single-rank trainer's
    for key in [k for _, k in steps] + ["full", "bf16"]:
        names = [set(out[key]["single"]["names"]) for out in outs]
        want = set(outs[0][key]["single"]["ref_names"])
        assert all(n <= want for n in names) and set().union(*names) == want, (key, names, want)
    # MixGRPO: every sample of step 1 starts its window where the schedule has moved it (one step per move)
    for out in outs:
        for key in [k for _, k in steps if k.endswith("mixgrpo")]:
            assert out[key]["window"] == [1] * 4, (key, out[key]["window"])
    if family == "flux":  # FP8 rollout: a gap the trainer measures and corrects with truncated importance weights
        m = outs[-1]["fp8"]
        print(f"{family} fp8: {m}")
        assert m["quantized"] and 0 < m["sync_probe_quant_diff"] <= m["sync_probe_quant_bound"], m
        assert m["sync_probe_max_diff"] <= PROBE_TOL, m  # the unquantized view holds the merged weights
        assert 0 < m["train_rollout_dlogp"] < 1e-2 and m["train_rollout_dlogp_max"] >= m["train_rollout_dlogp"], m
        assert 0 < m["is_weight_mean"] <= m["is_weight_max"] <= 2.0, m
        assert m["train_rollout_dlogp_after_is"] <= m["train_rollout_dlogp"], m
        assert math.isfinite(m["loss"]) and m["grad_norm"] > 0, m
