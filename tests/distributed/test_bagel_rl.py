"""BAGEL RL's rollout and recompute agree: our `FlowGRPOBagelPipeline` (vLLM-Omni 0.30's BAGEL pipeline with our SDE
window, in a spawned gloo rank as the other in-process vLLM-Omni tests) records trajectories whose window log-probs
our Megatron BAGEL (`trainer.bagel.window_log_probs`) reproduces, with BAGEL's text CFG; a weight update reaches
the rollout through the bridge (the family's weight part at rollout tp 1, its coverage ledger naming a tensor the
rollout left unwritten; the pipeline's loader refuses a missing, unknown or misshapen tensor by name); our
`text_cfg` is vLLM-Omni's `_combine_cfg`. One rank job, one tiny folder. And (two ranks): an update at tp 2 keeps the
replicated tensors (the per-head QK norms above all) equal on both tp ranks.

Measured (fp32 rollout and recompute, CFG 4.0, 2 samples x 2 window steps): first-step |dlogp| and the largest
over the window 0.0 and 1.2e-7 (2.4e-7 in the recipe's CPU run); bf16 rollout (vLLM-Omni's code as shipped,
CPU bf16 autocast) against the fp32 recompute: 7.3e-4 (`bf16_dlogp`, asserted < 1e-2). 60 s (one rank, loaded
machine).

The two jobs are independent: the two-rank job starts in a thread first and runs beside the one-rank job (three
single-thread ranks on the machine's cores instead of one job after the other)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks

PROMPTS = [[1, 17, 42, 99, 7, 2], [1, 5, 6, 2]]
SEEDS = [3, 4]
FP32_TOL = 1e-5
PP_TOL = 1e-5  # pp 2 against pp 1 (tp 2), relative: loss and grad norm (measured 1.2e-7 and 2.7e-6)
# pp 2 against pp 1 (tp 2): the weights after 2 Adam updates at lr 2e-2 (each moves an entry by up to ~lr); measured
# 5.6e-4: Adam's normalisation amplifies the fp32 rounding of near-zero gradient entries
PP_WEIGHT_TOL = 2e-3
PP_EMA_TOL = 5e-4  # the EMA (decay 0.9) of those weights, pp 2 against pp 1: measured 1.1e-4
# pp 2 (or cp 2) against pp 1 after the first update: the reward mean (-kB of JPEG; measured 1e-3 on an AVX2 CPU,
# 0 on AVX-512) and the loss and grad norm (`_close`: absolute below 1; measured 1.7e-5 of a 0.062 grad norm on AVX2)
PP_LATER_REWARD, PP_LATER_TOL = 5e-3, 2e-4
PP_LORA_TOL = 1e-4  # LoRA adapters after 2 updates (lr 2e-2), pp 2 against tp 2: measured 8.1e-6


def _checks(rank: int, world_size: int, folder: str) -> dict:
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.rollout.vllm_omni.bagel import BagelSampling, open_bagel_pipeline
    from megatron_omni.trainer.bagel import window_log_probs
    from model_providers.bagel import provider

    provider.write_bagel_folder(folder, "tiny", seed=3)
    cfg, state = provider.read_bagel_folder(folder)
    cfg["ae"] = provider.bagel_config("tiny")["ae"]
    groups = build_parallel_groups(ParallelLayout(tp=1))
    seed_everything(0, tp_rank=0)
    model = provider.build_model(cfg, groups).eval()
    provider.load_bagel_state(model, state)
    tok = cfg["tokens"]
    markers = torch.tensor([tok["start_of_image"], tok["end_of_image"]])
    params = BagelSampling(num_timesteps=5, noise_level=1.0, window_size=2, window_range=(0, 2), cfg_text_scale=4.0,
                           height=32, width=32)
    ids = [torch.tensor(p) for p in PROMPTS]
    out: dict = {}
    with open_bagel_pipeline(cfg, folder, torch.float32) as pipe:
        traj = pipe.generate(ids, params, SEEDS, [0, 1])
        with torch.no_grad():
            ours = window_log_probs(model, traj, markers)
        out["first_step"] = float((ours[:, 0] - traj.log_probs[:, 0]).abs().max())
        out["window"] = float((ours - traj.log_probs).abs().max())
        out["cfg_scales"] = traj.cfg_scales.tolist()
        out["shapes"] = (tuple(traj.latents.shape), tuple(traj.images.shape))
        # the same seeds sample the same trajectory
        again = pipe.generate(ids, params, SEEDS, [0, 1])
        out["repeat_equal"] = torch.equal(again.next_latents, traj.next_latents)
        # MixGRPO's fixed window (`window_start`): every sample steps the SDE on steps 2, 3 (the last two), the
        # recompute reproduces it, and its last next latents are the clean latents recorded for DiffusionNFT;
        # DiffusionNFT's ODE rollout (noise 0) records no window, and its clean latents are the Euler integral of our
        # model's guided velocity from the sample's initial noise (the CFG interval as the rollout applies it)
        import dataclasses

        from megatron_omni.algorithms.window import sample_window_start
        from megatron_omni.rollout.vllm_omni.bagel import flow_schedule
        from megatron_omni.trainer.bagel import velocity

        fixed = pipe.generate(ids, dataclasses.replace(params, window_start=2, window_range=(0, 4)), SEEDS, [0, 1])
        sched = flow_schedule(params.num_timesteps, params.timestep_shift)
        with torch.no_grad():
            out["fixed_window"] = float((window_log_probs(model, fixed, markers) - fixed.log_probs).abs().max())
        out["fixed_sigmas"] = torch.equal(fixed.sigmas, sched[2:4].expand(2, -1))
        out["fixed_final"] = torch.equal(fixed.next_latents[:, -1], fixed.final_latents)
        ode = pipe.generate(ids, dataclasses.replace(params, noise_level=0.0), SEEDS, [0, 1])
        out["ode_window"] = tuple(ode.log_probs.shape)
        euler = []
        with torch.no_grad():
            for i, seed in enumerate(SEEDS):
                gen = torch.Generator().manual_seed(seed)
                sample_window_start(params.num_steps, params.window_size, params.window_bounds(), gen)
                x = torch.randn(ode.final_latents.shape[1:], generator=gen)
                _, kv, _ = model.stage_text(ids[i])
                for k in range(params.num_steps):
                    t = float(sched[k])
                    scale = params.cfg_text_scale if params.cfg_interval[0] < t <= params.cfg_interval[1] else 1.0
                    v = velocity(model, kv, ids[i].shape[0], markers, x, ode.grid, t, scale, 0.0)
                    x = x + (float(sched[k + 1]) - t) * v
                euler.append(x)
        out["ode_euler"] = float((torch.stack(euler) - ode.final_latents).abs().max())
        # a weight update of the generation expert reaches the rollout; the recompute agrees with the new rollout
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith(("llm2vae.", "decoder.layers.0.mlp_gen.")) or name.endswith("linear_qkv_gen.weight"):
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
        from megatron_omni.bridge import WeightSync
        from megatron_omni.bridge.family_sync import family_plans
        from megatron_omni.rollout.vllm_omni.bagel import BagelWeightTarget
        from model_providers import get_family

        fam = get_family("bagel")
        (part, plan), = family_plans(fam, cfg, trainer_tp=1, rollout_kind="vllm_omni", rollout_tp=1,
                                     mode="full").items()
        sources = fam.megatron_sources(model)[part]
        stats = WeightSync(plan, sources=sources, target=pipe.weight_target(), tp_group=groups.tp, tp_rank=0).sync()
        out["sync_buckets"] = stats.buckets
        after = pipe.generate(ids, params, SEEDS, [0, 1])
        out["served"] = _served_checks(folder, cfg, state, ids, params, traj, after, plan, sources, groups)
        with torch.no_grad():
            ours_after = window_log_probs(model, after, markers)
        out["update_moved"] = float((after.next_latents - traj.next_latents).abs().max())
        # the KL term's reference: the initial weights in a copy of their own; against the trained model the KL of
        # the window transitions is > 0, against itself exactly 0
        from megatron_omni.trainer.bagel import window_kl, window_transitions

        ref = provider.build_model(cfg, groups).eval()
        provider.load_bagel_state(ref, state)
        with torch.no_grad():
            _, ref_means, ref_stds = window_transitions(ref, after, markers)
            _, means, stds = window_transitions(model, after, markers)
        out["kl_self"] = float(window_kl(ref_means, ref_means, ref_stds).abs().max())
        out["kl_trained"] = float(window_kl(means, ref_means, stds).min())
        out["kl_std_equal"] = torch.equal(stds, ref_stds)
        # `model.bagel_experts=both`: with the prompt's pass under autograd (`text_grad`) the window log-probs reach
        # the understanding expert through the prompt's KV cache as well as through the image query's two marker
        # tokens (its tokens too); the gradient equals a central finite difference, the markers' share alone does not
        w = dict(ref.named_parameters())["decoder.layers.0.self_attention.linear_qkv.weight"]
        window_transitions(ref, after, markers)[0].sum().backward()
        markers_only, w.grad = w.grad.clone(), None
        window_transitions(ref, after, markers, text_grad=True)[0].sum().backward()
        i, eps = int(w.grad.abs().argmax()), 1e-2

        def window_sum(delta: float) -> float:
            with torch.no_grad():
                w.view(-1)[i] += delta
                total = float(window_transitions(ref, after, markers)[0].double().sum())
                w.view(-1)[i] -= delta
            return total

        out["und_grad"] = (float(w.grad.view(-1)[i]), float(markers_only.view(-1)[i]),
                           (window_sum(eps) - window_sum(-eps)) / (2 * eps))
        out["after_window"] = float((ours_after - after.log_probs).abs().max())
        # refusals, by name, before anything is written
        full = provider.export_bagel_state(model)
        errors = {}
        stray = "language_model.model.layers.9.mlp.up_proj.weight"
        for what, bad in (("missing", {k: v for k, v in full.items() if k != "llm2vae.bias"}),
                          ("unknown", {**full, stray: full["llm2vae.bias"]}),
                          ("shape", {**full, "vae2llm.weight": full["vae2llm.weight"][:, :1]})):
            try:
                pipe.load_weights(bad)
                errors[what] = None
            except ValueError as exc:
                errors[what] = str(exc)


        class Dropping(BagelWeightTarget):  # a rollout loader that silently skips one tensor
            def load_full(self, items):
                return super().load_full([(n, t) for n, t in items if n != "llm2vae.bias"])

        try:
            WeightSync(plan, sources=sources, target=Dropping(pipe), tp_group=groups.tp, tp_rank=0).sync()
            errors["bridge_unwritten"] = None
        except Exception as exc:  # noqa: BLE001 - the message is what is checked
            errors["bridge_unwritten"] = str(exc)
        # at rollout tp 2 each rollout rank receives every BAGEL tensor whole (its vLLM loaders keep the shard)
        (plan2,) = family_plans(fam, cfg, trainer_tp=2, rollout_kind="vllm_omni", rollout_tp=2, mode="full").values()
        whole = set(provider.bagel_shapes(cfg))
        out["rollout_tp2_whole"] = set(plan2.rank_params(0)) == set(plan2.rank_params(1)) == whole
        out["errors"] = errors
        still = pipe.generate(ids, params, SEEDS, [0, 1])
        out["refusal_kept_weights"] = torch.equal(still.next_latents, after.next_latents)
        # LoRA on the generation expert (the trainer's default targets): adapters with a non-zero B, merged into the
        # rollout's modules through the bridge (`MergedSources`), give rollout log-probs the adapted recompute
        # reproduces; a plain model loaded with the merged weights computes what the adapted one does
        from megatron_omni.bridge.lora_sync import MergedSources, merged_linears
        from megatron_omni.models.lora import adapters, adapters_disabled, add_lora
        from megatron_omni.trainer.bagel import BAGEL_LORA_TARGETS

        adapted = add_lora(model, BAGEL_LORA_TARGETS, 4, 8.0, seed=0, global_name=model.global_name)
        with torch.no_grad():
            for a in adapters(model).values():
                a.lora_b.normal_(0, 0.2, generator=torch.Generator().manual_seed(9))
        merged = MergedSources(fam.megatron_sources(model)[part], merged_linears(model, model.global_name))
        WeightSync(plan, sources=merged, target=pipe.weight_target(), tp_group=groups.tp, tp_rank=0).sync()
        lora_traj = pipe.generate(ids, params, SEEDS, [0, 1])
        with torch.no_grad():
            out["lora_window"] = float((window_log_probs(model, lora_traj, markers) - lora_traj.log_probs).abs().max())
            plain = provider.build_model(cfg, groups).eval()
            provider.load_bagel_state(plain, provider.export_bagel_state(
                plain, {k: merged[k] for k in fam.megatron_sources(model)[part]}))
            out["lora_merge_parity"] = float((window_log_probs(plain, lora_traj, markers)
                                              - window_log_probs(model, lora_traj, markers)).abs().max())
        out["lora_moved"] = float((lora_traj.next_latents - after.next_latents).abs().max())
        out["lora_linears"] = sorted(adapted)
        out["lora_trainable"] = sorted({n.split(".lora.")[0] for n, p in model.named_parameters() if p.requires_grad})
        # vLLM-Omni's CFG combination equals ours: text CFG, and text + image CFG with the image-free branch of a
        # text-to-image request (the text-conditioned velocity, as vLLM-Omni's pipeline builds its cfg_img context)
        from vllm_omni.diffusion.models.bagel.bagel_transformer import Bagel

        from megatron_omni.models.bagel.model import text_cfg

        g = torch.Generator().manual_seed(1)
        vc, vu = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
        ref = Bagel._combine_cfg(vc, vu, None, 4.0, 1.0, "global", 0.0)
        out["cfg_equal"] = float((text_cfg(vc, vu, 4.0, 0.0) - ref).abs().max())
        ref_img = Bagel._combine_cfg(vc, vu, vc, 4.0, 1.5, "global", 0.0)
        out["img_cfg_equal"] = float((text_cfg(vc, vu, 4.0, 0.0, 1.5, vc) - ref_img).abs().max())
        # image CFG 1.5 (vLLM-Omni's default cfg_img_scale) through its generate_image (the image branch's KV: the
        # prompt's): the rollout moves, and the recompute (no third forward) reproduces its log-probs
        img = pipe.generate(ids[:1], dataclasses.replace(params, cfg_img_scale=1.5), SEEDS[:1], [0])
        with torch.no_grad():
            out["img_cfg_window"] = float((window_log_probs(model, img, markers) - img.log_probs).abs().max())
        out["img_cfg_moved"] = float((img.next_latents - lora_traj.next_latents[:1]).abs().max())
    with open_bagel_pipeline(cfg, folder, torch.bfloat16) as pipe16:
        pipe16.load_weights(provider.export_bagel_state(model))
        t16 = pipe16.generate(ids, params, SEEDS, [0, 1])
        with torch.no_grad(), adapters_disabled(model):  # the base weights (the LoRA check above added adapters)
            out["bf16_dlogp"] = float((window_log_probs(model, t16, markers) - t16.log_probs).abs().max())
    return out


def _served_checks(folder: str, cfg: dict, state: dict, ids: list, params, before, after, plan, sources,
                   groups) -> dict:
    """vLLM-Omni's own engine serving our BAGEL class from a worker process (`rollout.vllm_omni_process=engine`,
    `bagel_served.ServedBagelPipeline`), against the in-process pipeline: the trajectory of the same seeds, before
    and after the same bridge sync (here through the workers' bucketed update), a partial update refused by name,
    sleep and wake-up keeping the weights."""
    import os

    from megatron_omni.bridge import WeightSync
    from megatron_omni.rollout.vllm_omni.bagel_served import ServedBagelPipeline
    from model_providers.bagel import provider

    fields = ("latents", "next_latents", "log_probs", "sigmas", "cfg_scales", "images", "final_latents")

    def diff(a, b) -> float:
        return max(float((getattr(a, f) - getattr(b, f)).abs().max()) for f in fields)

    out: dict = {}
    served = ServedBagelPipeline(folder, cfg, torch.float32, tp=1)
    try:
        out["report"] = {k: v for k, v in served._rpc("platform_report")[0][0].items()
                         if k in ("platform", "pipeline", "tp_size", "pid")}
        out["own_pid"] = os.getpid()
        out["before"] = diff(served.generate(ids, params, SEEDS, [0, 1]), before)
        with served.weight_update():
            WeightSync(plan, sources=sources, target=served.weight_target(), tp_group=groups.tp, tp_rank=0).sync()
        updated = served.generate(ids, params, SEEDS, [0, 1])
        out["after"], out["meta_equal"] = diff(updated, after), (updated.seeds, updated.grid) == (after.seeds,
                                                                                                    after.grid)
        served.sleep()
        served.wake_up()
        out["after_wake"] = diff(served.generate(ids, params, SEEDS, [0, 1]), after)
        try:  # the rollout's tensors of the folder but one
            held = set(provider.bagel_shapes(cfg))
            served.update_weights([(k, v) for k, v in state.items() if k in held and k != "llm2vae.bias"])
            out["partial"] = None
        except RuntimeError as exc:
            out["partial"] = str(exc)
    finally:
        served.close()
    return out


@pytest.fixture(scope="module")
def tp2_job(tmp_path_factory) -> Iterator[Future]:
    """The two-rank job (`_tp2_job`: `_tp2_update`, then `_lora_runs`), started now in a thread; its tests read
    the result."""
    root = tmp_path_factory.mktemp("bagel-tp2")
    with ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(run_ranks, _tp2_job, 2, str(root), timeout_s=900), root


@pytest.fixture(scope="module")
def figures(tmp_path_factory, tp2_job: Future) -> dict:
    folder = str(tmp_path_factory.mktemp("bagel-rl") / "tiny")
    result = run_ranks(_checks, 1, folder, timeout_s=600)[0]
    print(result)
    return result


def test_recompute_reproduces_rollout_log_probs(figures: dict) -> None:
    assert figures["shapes"] == ((2, 2, 4, 16), (2, 3, 32, 32)), figures
    assert figures["cfg_scales"] == [[4.0, 4.0], [4.0, 4.0]]  # the window lies in BAGEL's CFG interval
    assert figures["first_step"] < FP32_TOL and figures["window"] < FP32_TOL, figures
    assert figures["repeat_equal"]
    assert figures["cfg_equal"] < 1e-6 and figures["img_cfg_equal"] < 1e-6, figures


def test_fixed_window_and_clean_latents(figures: dict) -> None:
    """MixGRPO's window of the step (`BagelSampling.window_start`) is every sample's and the recompute reproduces
    it; the clean latents DiffusionNFT trains on are the last window step's output and, for its ODE rollout, the
    Euler integral of our model's guided velocity (measured 0 and 1.4e-6)."""
    assert figures["fixed_sigmas"] and figures["fixed_final"], figures
    assert figures["fixed_window"] < FP32_TOL and figures["ode_euler"] < FP32_TOL, figures
    assert figures["ode_window"] == (2, 0), figures


def test_image_cfg_as_vllm_omni_applies_it(figures: dict) -> None:
    # not a no-op in text-to-image (the text guidance is amplified before the renorm), and recomputed exactly
    assert figures["img_cfg_moved"] > 1e-3 and figures["img_cfg_window"] < FP32_TOL, figures


def test_the_understanding_expert_gets_the_gradient_with_both_experts(figures: dict) -> None:
    """Measured: -3.8244e-2 against the central difference's -3.8236e-2 (eps 1e-2), the markers' share alone
    +3.5e-3."""
    grad, markers_only, fd = figures["und_grad"]
    print(f"understanding expert (layer 0 qkv) gradient {grad:.4e} (without the prompt's pass {markers_only:.4e}), "
          f"central difference {fd:.4e}")
    assert abs(grad) > 0 and abs(grad - fd) <= 1e-2 * abs(fd), (grad, fd)
    assert abs(markers_only - fd) > 0.1 * abs(fd), (markers_only, fd)


def test_the_served_engine_samples_what_the_in_process_pipeline_samples(figures: dict) -> None:
    """`rollout.vllm_omni_process=engine` (the tiny recipe's): vLLM-Omni's engine runs our BAGEL class in a worker
    process on our CPU platform, its trajectories equal the in-process pipeline's for the same seeds and weights,
    bit for bit, before and after a bridge sync through the workers' bucketed update; an update that misses tensors
    is refused naming one; sleep and wake-up keep the weights."""
    served = figures["served"]
    report = served["report"]
    assert report["platform"] == "CpuOmniPlatform" and report["pipeline"] == "ServedFlowGRPOBagelPipeline", report
    assert report["tp_size"] == 1 and report["pid"] != served["own_pid"], report
    assert served["before"] == 0.0 and served["after"] == 0.0 and served["meta_equal"], served
    assert served["after_wake"] == 0.0, served
    assert served["partial"] is not None and "partial weight update" in served["partial"], served["partial"]
    assert "['llm2vae.bias']" in served["partial"], served["partial"]


def test_weight_update_reaches_rollout_through_bridge(figures: dict) -> None:
    assert figures["sync_buckets"] >= 1 and figures["update_moved"] > 1e-3, figures
    assert figures["after_window"] < FP32_TOL, figures
    assert figures["kl_self"] == 0 and figures["kl_trained"] > 0 and figures["kl_std_equal"], figures


def test_bad_updates_refused_by_name(figures: dict) -> None:
    e = figures["errors"]
    assert e["missing"] is not None and "llm2vae.bias" in e["missing"], e
    assert e["unknown"] is not None and "layers.9.mlp.up_proj" in e["unknown"], e
    assert e["shape"] is not None and "vae2llm.weight" in e["shape"], e
    assert e["bridge_unwritten"] is not None and "llm2vae.bias" in e["bridge_unwritten"], e
    assert figures["refusal_kept_weights"] and figures["rollout_tp2_whole"]


def test_lora_on_generation_expert_merged_into_rollout(figures: dict) -> None:
    gen = [f"decoder.layers.{i}.{m}" for i in range(2) for m in ("self_attention.linear_qkv_gen",
                                                              "self_attention.linear_proj_gen",
                                                              "mlp_gen.linear_fc1", "mlp_gen.linear_fc2")]
    assert figures["lora_linears"] == sorted(gen) and figures["lora_trainable"] == sorted(gen), figures
    assert figures["lora_moved"] > 1e-3, figures  # the merged adapters reached the rollout
    assert figures["lora_window"] < FP32_TOL and figures["lora_merge_parity"] < FP32_TOL, figures


def test_bf16_rollout_close_to_fp32_recompute(figures: dict) -> None:
    assert 0 < figures["bf16_dlogp"] < 1e-2, figures  # measured 7.3e-4


def _tp2_update(rank: int, world_size: int) -> dict:
    """One optimizer update of the generation expert at tp 2 through Megatron-Core DDP: every replicated tensor
    (the per-head QK norms, whose grads each tp rank sees for its own heads only, the generation side) stays equal
    on both tp ranks."""
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.planner.mot import is_generation_tensor
    from megatron_omni.trainer.grad_guard import GradGuard
    from megatron_omni.trainer.skeleton import update
    from megatron_omni.trainer.training_state import OptimizerSettings, build_ddp_and_optimizer, build_scheduler
    from model_providers.bagel import provider

    cfg = provider.bagel_config("tiny")
    groups = build_parallel_groups(ParallelLayout(tp=2))
    seed_everything(0, tp_rank=groups.tp.rank())
    model = provider.build_model(cfg, groups)
    provider.load_bagel_state(model, provider.random_bagel_state(cfg, seed=5))
    for name, p in model.named_parameters():
        p.requires_grad_(is_generation_tensor(name))
    ddp, opt = build_ddp_and_optimizer(model, model.config, groups.mcore, OptimizerSettings(lr=1e-2))
    sched = build_scheduler(opt, 1e-2, 0.0)
    g = torch.Generator().manual_seed(2)
    latents, ids = torch.randn(4, 16, generator=g), torch.tensor(PROMPTS[0])
    markers = torch.tensor([3, 4])
    pos = torch.arange(4)

    def backward() -> None:
        with torch.no_grad():
            _, kv, _ = model.stage_text(ids)
        v = model.stage_velocity(kv, len(ids), markers, latents, torch.full((4,), 0.7), pos)
        (v.square().mean()).backward()

    update(ddp, opt, sched, GradGuard(3), groups.mcore, backward)
    replicated = {n: p.detach().clone() for n, p in model.named_parameters()
                  if is_generation_tensor(n) and ("layernorm" in n or not n.startswith("decoder.layers."))}
    gathered = [None, None]
    torch.distributed.all_gather_object(gathered, replicated, group=groups.tp)
    return {"differ": sorted(n for n in replicated if not torch.equal(gathered[0][n], gathered[1][n])),
            "qk_norms": sum("q_layernorm" in n or "k_layernorm" in n for n in replicated)}


def _tp2_job(rank: int, world_size: int, root: str) -> dict:
    return {**_tp2_update(rank, world_size), **_lora_runs(rank, world_size, root), **_pp_runs(rank, world_size, root)}


PP_STEPS = 2
NFT_DECAY = 0.25  # DiffusionNFT's old-policy decay after the first update (rate = cap)
PP_BETA, PP_EMA = 0.1, 0.9  # the KL term and the EMA of the pp 2 / pp 1 pair
LORA_BETA = 0.1  # the KL term of the LoRA runs (reference: the adapters off)


def _pp_runs(rank: int, world_size: int, root: str) -> dict:
    """The tiny recipe's full fine-tuning (2 samples a step, one update, lr 2e-2) with the KL term and the EMA for 2
    steps at pp 2 (the update through 1F1B, `trainer.bagel_pipeline`), at tp 2 (pp 1, plain autograd) and at cp 2
    (`parallel.ulysses=2`: the image query's token shards, velocities gathered over cp) on the same two ranks, and
    with both experts training (`model.bagel_experts=both`), with GRPO-Guard's update and with DiffusionNFT's, each at
    tp 2 and cp 2, MixGRPO at pp 2 and tp 2, and pp1's config at rollout tp 2 with an evaluation; then
    `_lora_config`'s LoRA run at pp 2 (its tp 2 run is
    `_lora_runs`' first). Rank 0 returns the folders."""
    from pathlib import Path

    from examples.bagel.recipe import tiny
    from megatron_omni.trainer.run import run

    out = {}
    names = {"guard": "grpo_guard", "mix": "mixgrpo", "nft": "diffusionnft"}
    for name, tp, pp, cp in (("pp2", 1, 2, 1), ("pp1", 2, 1, 1), ("cp2", 1, 1, 2), ("both_tp2", 2, 1, 1),
                             ("both_cp2", 1, 1, 2), ("guard_tp2", 2, 1, 1), ("guard_cp2", 1, 1, 2),
                             ("guard_pp2", 1, 2, 1), ("mix_pp2", 1, 2, 1), ("mix_tp2", 2, 1, 1), ("nft_tp2", 2, 1, 1),
                             ("nft_cp2", 1, 1, 2), ("nft_pp2", 1, 2, 1), ("rtp2", 2, 1, 1)):
        cfg = tiny()
        cfg.rollout.vllm_omni_process = "inline"  # the update rules' math; rtp2 below: the served engine
        cfg.run_dir, cfg.steps, cfg.parallel.tp, cfg.parallel.pp = str(Path(root) / name), PP_STEPS, tp, pp
        cfg.parallel.ulysses = cp
        cfg.model.bagel_experts = "both" if name.startswith("both") else "generation"
        cfg.algorithm.name = names.get(name.split("_")[0], "flowgrpo")
        if cfg.algorithm.name == "mixgrpo":  # the window moves every step: starts 0, 1 of [0, 3)
            cfg.algorithm.mixgrpo.steps_per_move, cfg.rollout.window_range = 1, [0, 4]
        if cfg.algorithm.name == "diffusionnft":  # the old policy lags from the second step on (decay 0.25)
            cfg.algorithm.nft.decay_rate, cfg.algorithm.nft.decay_cap = NFT_DECAY, NFT_DECAY
        if name == "rtp2":  # vLLM-Omni's engine with 2 workers, shared by the tp group; the evaluation through it
            cfg.rollout.tp, cfg.rollout.vllm_omni_process = 2, "engine"
            cfg.eval.prompts, cfg.eval.seeds_per_prompt, cfg.eval.num_steps = ["17 42 99 7", "8 9 10"], 1, 3
        cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.optim.mini_batches = 1, 2, 1
        cfg.optim.lr, cfg.checkpoint.every, cfg.logging.tensorboard = 2e-2, PP_STEPS, False
        cfg.algorithm.beta, cfg.optim.ema_decay = PP_BETA, PP_EMA
        run(cfg)
        out[name] = cfg.run_dir
    # `algorithm.max_logp_gap`: a bf16 rollout against the fp32 recompute (|dlogp| ~1e-3) stops the run at step 0
    from megatron_omni.trainer.flowgrpo import LogpGapError

    # (through the recipe's served engine in bf16, one per rank: `run` closes both when the run stops)
    cfg = tiny()
    cfg.run_dir, cfg.steps, cfg.parallel.tp, cfg.logging.tensorboard = str(Path(root) / "gap"), 1, 2, False
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.optim.mini_batches = 1, 2, 1
    cfg.rollout.dtype, cfg.algorithm.max_logp_gap = "bf16", 1e-5
    try:
        run(cfg)
        out["gap_error"] = None
    except LogpGapError as exc:
        out["gap_error"] = str(exc)
    cfg = _lora_config(str(Path(root) / "lora_pp2"))
    cfg.parallel.tp, cfg.parallel.pp, cfg.eval.prompts = 1, 2, []  # the evaluation is tp 2's test (~1 s here)
    run(cfg)
    out["lora_pp2"] = cfg.run_dir
    return out


LORA_STEPS = 2


def _lora_config(run_dir: str):
    """The tiny recipe at trainer tp 2 with LoRA (rank 4, lr 2e-2) on the generation expert, 2 samples a step,
    checkpoints every step, and held-out evaluation (2 token-id prompts, one seed each, 3 ODE steps, before and
    after)."""
    from examples.bagel.recipe import tiny

    cfg = tiny()
    cfg.rollout.vllm_omni_process = "inline"  # the adapters' math and resume; the served engine: rtp2, the gap run
    cfg.run_dir, cfg.steps, cfg.parallel.tp = run_dir, LORA_STEPS, 2
    cfg.rollout.prompts_per_step, cfg.rollout.group_size, cfg.optim.mini_batches = 1, 2, 1
    cfg.model.lora.rank, cfg.model.lora.alpha, cfg.optim.lr, cfg.algorithm.beta = 4, 8.0, 2e-2, LORA_BETA
    cfg.checkpoint.every, cfg.checkpoint.keep = 1, 5
    cfg.eval.prompts, cfg.eval.seeds_per_prompt, cfg.eval.num_steps = ["17 42 99 7", "8 9 10"], 1, 3
    cfg.logging.tensorboard = False
    return cfg


def _lora_runs(rank: int, world_size: int, root: str) -> dict:
    """`trainer.run.run` (as `python -m megatron_omni.train` runs it) of `_lora_config` for 2 steps, then the same
    run resumed (`checkpoint.resume=auto`) from a copy of the first run's step-1 checkpoint (what a run killed
    after it holds). Rank 0 returns the folders."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from megatron_omni.trainer.run import run

    full, resumed = Path(root) / "full", Path(root) / "resumed"
    run(_lora_config(str(full)))
    if rank == 0:
        (resumed / "checkpoints").mkdir(parents=True)
        shutil.copytree(full / "bagel", resumed / "bagel")  # the tiny folder, as the first run wrote it
        shutil.copytree(full / "checkpoints" / "step_000001", resumed / "checkpoints" / "step_000001")
        shutil.copytree(full / "eval", resumed / "eval")  # the before-training evaluation (its step-0 record)
        shutil.copy(full / "eval.jsonl", resumed / "eval.jsonl")
    dist.barrier()
    cfg = _lora_config(str(resumed))
    cfg.checkpoint.resume = "auto"
    run(cfg)
    # the same checkpoint resumed on other base weights (another seed's tiny folder) is refused, naming the LoRA
    # identity (`checkpoint.bagel.bagel_base_identity`: the CRC-32 of ema.safetensors)
    from megatron_omni.trainer.config import ConfigError
    from model_providers.bagel.provider import write_bagel_folder

    other = Path(root) / "other_base"
    if rank == 0:
        (other / "checkpoints").mkdir(parents=True)
        write_bagel_folder(other / "bagel", "tiny", seed=11)
        shutil.copytree(full / "checkpoints" / "step_000001", other / "checkpoints" / "step_000001")
    dist.barrier()
    cfg = _lora_config(str(other))
    cfg.checkpoint.resume = "auto"
    try:
        run(cfg)
        refused = None
    except ConfigError as exc:
        refused = str(exc)
    return {"full": str(full), "resumed": str(resumed), "other_base": refused}


def test_tp2_update_keeps_replicated_tensors_equal(tp2_job: tuple[Future, object]) -> None:
    out = tp2_job[0].result()
    assert out[0]["qk_norms"] > 0 and out[0]["differ"] == [], out


def test_lora_at_tp2_resumes_bit_identically_and_evaluates(tp2_job: tuple[Future, object]) -> None:
    """LoRA at trainer tp 2: the merged adapters reach the rollout after every update (recompute = rollout);
    the resumed run's step-2 checkpoint (adapters only, and their Adam moments) is bit-identical to the
    uninterrupted run's, with the same rewards; the held-out evaluation ran before and after through the
    trainer's evaluation path, the resumed run's last one equal to the uninterrupted run's."""
    import json
    from pathlib import Path

    from megatron_omni.trainer.checkpoint_folders import complete_checkpoints
    from megatron_omni.trainer.checkpointing import read_checkpoint_tensors
    from megatron_omni.trainer.evaluation import EvalResult

    out = tp2_job[0].result()[0]
    full, resumed = Path(out["full"]), Path(out["resumed"])
    last = f"step_{LORA_STEPS:06d}"
    a = read_checkpoint_tensors(full / "checkpoints" / last)
    b = read_checkpoint_tensors(complete_checkpoints(resumed)[-1])
    assert complete_checkpoints(resumed)[-1].name == last
    assert a["model"] and all(k.startswith("lora.") and "_gen" in k for k in a["model"]), sorted(a["model"])[:4]
    assert len(a["model"]) == 16 and any(k.startswith("exp_avg_sq.") for k in a["optimizer"]), sorted(a["optimizer"])
    for part in ("model", "optimizer"):
        assert a[part].keys() == b[part].keys(), part
        assert [k for k in a[part] if not torch.equal(a[part][k], b[part][k])] == [], part
    hist = {r: [json.loads(x) for x in (r / "metrics.jsonl").read_text().splitlines()] for r in (full, resumed)}
    assert [m["reward_mean"] for m in hist[full]] == [m["reward_mean"] for m in hist[resumed]]
    assert max(m["train_rollout_dlogp_max"] for m in hist[full] + hist[resumed]) < FP32_TOL, hist
    evals = {r: [json.loads(x) for x in (r / "eval.jsonl").read_text().splitlines()] for r in (full, resumed)}
    assert [e["step"] for e in evals[full]] == [0, LORA_STEPS] == [e["step"] for e in evals[resumed]], evals
    assert evals[full][-1] == evals[resumed][-1], evals
    refused = out["other_base"]
    assert refused is not None and "its lora is" in refused and "'crc32'" in refused, refused
    before, after = (EvalResult.load(full / "eval" / f"step_{s:04d}.npz") for s in (0, LORA_STEPS))
    assert before.images.shape == (2, 3, 32, 32) and before.prompts == ["17 42 99 7", "8 9 10"]
    assert not torch.equal(before.images, after.images)  # the trained adapters reached the evaluation's sampler
    assert (full / "eval_before_after.png").is_file() and (resumed / "eval_before_after.png").is_file()


def _metrics(run_dir: str) -> list[dict]:
    import json
    from pathlib import Path

    return [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _close(a: float, b: float, tol: float = PP_TOL) -> bool:
    return abs(a - b) <= tol * max(1.0, abs(b))


def _equal_to_pp1(out: dict, name: str, ref: str = "pp1") -> tuple[dict, dict]:
    """`_pp_runs`' run `name` against its pp 1 (tp 2) run `ref`, both with the KL term and the EMA: the same rewards,
    losses (the KL term apart) and grad norms, recompute = rollout in both, the KL 0 before the first update and then
    the same, and the same weights and EMA weights in the step-`PP_STEPS` checkpoints. Returns those checkpoints'
    model tensors (`name`'s, `ref`'s)."""
    from pathlib import Path

    from megatron_omni.trainer.checkpoint_folders import complete_checkpoints
    from megatron_omni.trainer.checkpointing import read_checkpoint_tensors

    hist = {k: _metrics(out[k]) for k in (name, ref)}
    print({k: [{m: h[m] for m in ("reward_mean", "policy_loss", "kl_loss", "grad_norm", "train_rollout_dlogp_max")}
               for h in v] for k, v in hist.items()})
    assert len(hist[name]) == len(hist[ref]) == PP_STEPS
    # step 1 rolls out the same initial weights at both layouts: the same rewards, exactly. Later steps roll out
    # weights that differ by Adam's amplified fp32 rounding (`PP_WEIGHT_TOL`), so a pixel can round the other way and
    # the JPEG reward move by a byte: `PP_LATER_*`
    for step, (a, b) in enumerate(zip(hist[name], hist[ref], strict=True)):
        first = step == 0
        assert a["grad_norm"] > 0, (a, b)
        assert (a["reward_mean"] == b["reward_mean"] if first
                else abs(a["reward_mean"] - b["reward_mean"]) <= PP_LATER_REWARD), (a, b)
        for key in ("policy_loss", "grad_norm"):
            assert _close(a[key], b[key], PP_TOL if first else PP_LATER_TOL), (key, a, b)
        assert a["train_rollout_dlogp_max"] < FP32_TOL and b["train_rollout_dlogp_max"] < FP32_TOL, (a, b)
    # the KL against the initial copy: 0 before the first update, then > 0 and the same at both layouts, relative
    # `PP_LATER_TOL`: the step-2 rollouts differ by the weights' fp32 rounding (measured 3.5e-6 of 2.7e-3 at pp 2;
    # GRPO-Guard at cp 2 1.2e-5 on an AVX2 CPU, where one pixel of its step-2 rollout rounded the other way)
    assert hist[name][0]["kl_loss"] == hist[ref][0]["kl_loss"] == 0, hist
    kl2, kl1 = hist[name][1]["kl_loss"], hist[ref][1]["kl_loss"]
    assert kl1 > 0 and abs(kl2 - kl1) <= PP_LATER_TOL * kl1, (kl2, kl1)
    a, b = (read_checkpoint_tensors(complete_checkpoints(Path(out[k]))[-1])["model"] for k in (name, ref))
    assert a.keys() == b.keys() and len(a) > 0
    weights = [k for k in a if not k.startswith("ema.")]
    assert sorted(a) == sorted(weights + [f"ema.{k}" for k in weights])  # the EMA checkpointed
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in weights)
    worst_ema = max(float((a[f"ema.{k}"].float() - b[f"ema.{k}"].float()).abs().max()) for k in weights)
    print(f"{name} vs {ref} (tp 2) after {PP_STEPS} steps: weights max |diff| {worst:.2e}, EMA {worst_ema:.2e}")
    assert worst < PP_WEIGHT_TOL, worst
    assert worst_ema < PP_EMA_TOL, worst_ema
    return a, b


def test_pp2_steps_equal_pp1(tp2_job: tuple[Future, object]) -> None:
    """2 RL steps at pp 2 (1F1B) and at pp 1 (tp 2) of one config with the KL term and the EMA: `_equal_to_pp1`
    (the step-2 rollout ran on the synced weights, every stage's tensors broadcast into both ranks' pipelines), and
    the pp-2 EMA was updated."""
    from megatron_omni.planner.mot import is_generation_tensor

    a, _ = _equal_to_pp1(tp2_job[0].result()[0], "pp2")
    weights = [k for k in a if not k.startswith("ema.")]
    # the pp-2 EMA was updated: it lags the model on every trained tensor, equals it on every frozen one
    lag = {k: float((a[f"ema.{k}"].float() - a[k].float()).abs().max()) for k in weights}
    assert min(v for k, v in lag.items() if is_generation_tensor(k)) > 0, lag
    assert max(v for k, v in lag.items() if not is_generation_tensor(k)) == 0, lag


def test_lora_and_kl_at_pp2_equal_tp2(tp2_job: tuple[Future, object]) -> None:
    """`_lora_config`'s LoRA run with the KL term (reference: the adapters off) at pp 2 against its tp 2 run (the
    first of `_lora_runs`), on the same two ranks: the same rewards, the same grad norms and KL, recompute = rollout
    (the merged adapters of both stages reached both ranks' pipelines), the same adapters in the step-2
    checkpoints (the fused SwiGLU fc1's B in global [gate; up] order at tp 2 too: `checkpoint.lora`)."""
    from pathlib import Path

    from megatron_omni.trainer.checkpointing import read_checkpoint_tensors

    out = tp2_job[0].result()[0]
    hist = {k: _metrics(out[k]) for k in ("lora_pp2", "full")}
    print({k: [{m: h[m] for m in ("reward_mean", "kl_loss", "grad_norm", "train_rollout_dlogp_max")} for h in v]
           for k, v in hist.items()})
    assert len(hist["lora_pp2"]) == len(hist["full"]) == LORA_STEPS
    for a, b in zip(hist["lora_pp2"], hist["full"], strict=True):
        assert a["reward_mean"] == b["reward_mean"] and a["grad_norm"] > 0, (a, b)
        assert _close(a["grad_norm"], b["grad_norm"]) and a["train_rollout_dlogp_max"] < FP32_TOL, (a, b)
    kl2, kl1 = hist["lora_pp2"][1]["kl_loss"], hist["full"][1]["kl_loss"]
    assert hist["lora_pp2"][0]["kl_loss"] == 0 and kl1 > 0 and abs(kl2 - kl1) <= PP_TOL * kl1, (kl2, kl1)
    last = f"step_{LORA_STEPS:06d}"
    a, b = (read_checkpoint_tensors(Path(out[k]) / "checkpoints" / last)["model"] for k in ("lora_pp2", "full"))
    assert a.keys() == b.keys() and len(a) == 16, sorted(a)
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(f"LoRA pp2 vs tp2 adapters after {LORA_STEPS} steps: max |diff| {worst:.2e}")
    assert worst < PP_LORA_TOL, worst


def test_cp2_steps_equal_tp2(tp2_job: tuple[Future, object]) -> None:
    """`_pp_runs`' config at cp 2 (each rank computes its shard of every velocity, all-gathered before the CFG and the
    loss; gradients averaged over dp x cp by Megatron-Core's DDP) against tp 2, on the same two ranks:
    `_equal_to_pp1`."""
    _equal_to_pp1(tp2_job[0].result()[0], "cp2")


def test_both_experts_train_at_tp2_and_cp2(tp2_job: tuple[Future, object]) -> None:
    """`model.bagel_experts=both` (the understanding expert trains through the prompt's KV cache): its cp 2 run equals
    its tp 2 run (`_equal_to_pp1`: the step-2 recompute reproduces a rollout sampled after the sync, so the updated
    understanding weights reached the rollout); the EMA lags the model on the understanding expert and the token
    embeddings (they moved) and equals it on what text-to-image never trains (the LM head, the understanding final
    norm, the latent position table); the generation-only run kept those frozen."""
    from megatron_omni.planner.mot import is_trained

    out = tp2_job[0].result()[0]
    both, _ = _equal_to_pp1(out, "both_cp2", ref="both_tp2")
    gen, _ = _equal_to_pp1(out, "cp2")  # the same layout training the generation expert only
    weights = [k for k in both if not k.startswith("ema.")]
    lag = {run: {k: float((a[f"ema.{k}"].float() - a[k].float()).abs().max()) for k in weights}
           for run, a in (("both", both), ("gen", gen))}
    und = [k for k in weights if k.startswith("decoder.layers.0.") and "_gen." not in k and "layernorm" not in k]
    assert und and min(lag["both"][k] for k in [*und, "embedding.word_embeddings.weight"]) > 0, lag["both"]
    assert max(lag["gen"][k] for k in und) == 0, lag["gen"]
    never = [k for k in weights if not is_trained(k, "both")]
    assert sorted(never) == ["decoder.final_layernorm.weight", "latent_pos_embed", "output_layer.weight"], never
    assert max(lag["both"][k] for k in never) == 0, lag["both"]


def test_grpo_guard_at_tp2_cp2_and_pp2(tp2_job: tuple[Future, object]) -> None:
    """`algorithm.name=grpo_guard` on BAGEL: the ratio normalised by each window step's transition scale and the loss
    reweighted by its |dt| (`algorithms.grpo_guard`, the old transition means from the recompute). Its cp 2 run and
    its pp 2 run (the pipelined update, the loss and the old means on the last stage) equal its tp 2 run
    (`_equal_to_pp1`); its metrics carry the normalised ratio's bias; its first step rolls out what FlowGRPO's does
    (the same initial weights and seeds) and takes another gradient (the scaled ratio and the |dt| reweighting; both
    losses are 0 there: ratio 1, a group's advantages summing to 0)."""
    out = tp2_job[0].result()[0]
    _equal_to_pp1(out, "guard_cp2", ref="guard_tp2")
    _equal_to_pp1(out, "guard_pp2", ref="guard_tp2")
    assert all("ratio_mean_bias" in m for m in _metrics(out["guard_pp2"]))
    guard, plain = _metrics(out["guard_tp2"]), _metrics(out["pp1"])
    print("grpo_guard vs flowgrpo, step 1:", {k: (guard[0][k], plain[0][k]) for k in ("reward_mean", "grad_norm")})
    assert all("ratio_mean_bias" in m for m in guard) and not any("ratio_mean_bias" in m for m in plain)
    assert guard[0]["reward_mean"] == plain[0]["reward_mean"]
    assert abs(guard[0]["grad_norm"] - plain[0]["grad_norm"]) > 0.1 * plain[0]["grad_norm"], (guard[0], plain[0])


def test_mixgrpo_window_slides_and_pp2_equals_tp2(tp2_job: tuple[Future, object]) -> None:
    """`algorithm.name=mixgrpo` on BAGEL: every sample of step k shares the window starting at k (moved every step),
    its FlowGRPO update runs through the pipelined schedule at pp 2 as at tp 2 (`_equal_to_pp1`: recompute = rollout
    on the fixed window too)."""
    out = tp2_job[0].result()[0]
    _equal_to_pp1(out, "mix_pp2", ref="mix_tp2")
    for run in ("mix_pp2", "mix_tp2"):
        assert [m["window_start"] for m in _metrics(out[run])] == [0.0, 1.0], _metrics(out[run])
    assert not any("window_start" in m for m in _metrics(out["pp1"]))


@pytest.mark.parametrize("layout", ["cp2", "pp2"])
def test_diffusionnft_equals_tp2_with_a_lagging_old_policy(tp2_job: tuple[Future, object], layout: str) -> None:
    """`algorithm.name=diffusionnft` on BAGEL (ODE rollout, `nft_loss` over each sample's noised clean latents, the KL
    on velocities against the initial copy, the EMA): its cp 2 run and its pp 2 run (the old, reference and current
    velocities through the pipeline, the loss on the last stage, `trainer.bagel_pipeline.nft_backward`) equal its
    tp 2 run (rewards, losses, grad norms, the step-2 weights and EMA); the first step's old policy is the model
    itself (the old velocities equal the trained ones before the update: `old_deviate` 0, KL 0); after it the old
    policy is the lagging copy (decay `NFT_DECAY`), checkpointed under `nft_old.`, which the step-2 rollout sampled
    with (`old_deviate` > 0)."""
    from pathlib import Path

    from megatron_omni.trainer.checkpoint_folders import complete_checkpoints
    from megatron_omni.trainer.checkpointing import read_checkpoint_tensors

    out = tp2_job[0].result()[0]
    name = f"nft_{layout}"
    hist = {k: _metrics(out[k]) for k in ("nft_tp2", name)}
    keys = ("reward_mean", "policy_loss", "kl_loss", "grad_norm", "old_deviate", "old_policy_decay")
    print({k: [{m: h[m] for m in keys} for h in v] for k, v in hist.items()})
    for step, (a, b) in enumerate(zip(hist[name], hist["nft_tp2"], strict=True)):
        assert a["grad_norm"] > 0 and "train_rollout_dlogp_max" not in a, a
        assert (a["reward_mean"] == b["reward_mean"] if step == 0
                else abs(a["reward_mean"] - b["reward_mean"]) <= PP_LATER_REWARD), (a, b)
        for key in ("policy_loss", "grad_norm", "kl_loss", "old_deviate"):
            assert _close(a[key], b[key], PP_TOL if step == 0 else PP_LATER_TOL), (key, a, b)
        assert a["old_policy_decay"] == b["old_policy_decay"] == NFT_DECAY, (a, b)
    first, second = hist["nft_tp2"]
    assert first["old_deviate"] == 0 and first["kl_loss"] == 0, first
    assert second["old_deviate"] > 0 and second["kl_loss"] > 0, second
    a, b = (read_checkpoint_tensors(complete_checkpoints(Path(out[k]))[-1])["model"] for k in (name, "nft_tp2"))
    weights = [k for k in a if not k.startswith(("ema.", "nft_old."))]
    assert sorted(a) == sorted(weights + [f"{c}.{k}" for c in ("ema", "nft_old") for k in weights]), sorted(a)[:6]
    worst = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert worst < PP_WEIGHT_TOL, worst
    # the old policy lags the model on the trained tensors: old = 0.25 old + 0.75 model after each update
    lag = max(float((a[f"nft_old.{k}"].float() - a[k].float()).abs().max()) for k in weights)
    assert lag > 0, lag


def test_max_logp_gap_stops_the_run_naming_the_step(tp2_job: tuple[Future, object]) -> None:
    """`algorithm.max_logp_gap` on BAGEL (as the DiT trainer's, `trainer.flowgrpo.logp_gap`): a bf16 rollout against
    the fp32 recompute exceeds a 1e-5 bound and the run stops on every rank, naming the step and the bound."""
    msg = tp2_job[0].result()[0]["gap_error"]
    assert msg is not None and msg.startswith("step 0: mean |logp_trainer - logp_rollout| ="), msg
    assert "exceeds algorithm.max_logp_gap = 1.000e-05" in msg, msg


def test_rollout_tp2_equals_rollout_tp1_and_evaluates(tp2_job: tuple[Future, object]) -> None:
    """`rollout.tp=2`: the trainer's tp group holds one vLLM-Omni BAGEL pipeline's shards (its parallel linears,
    vocab-parallel embedding and head), each rank receiving the bridge's full tensors and its loaders keeping the
    shard: the run equals the same config at rollout tp 1 (`_equal_to_pp1`: rewards, losses, grad norms, weights,
    recompute = rollout after each sync), and the held-out evaluation, collective over the group, samples what the
    rollout-tp-1 LoRA run (B = 0 at step 0: the same weights) sampled before training."""
    import json
    from pathlib import Path

    from megatron_omni.trainer.evaluation import EvalResult

    out = tp2_job[0].result()[0]
    _equal_to_pp1(out, "rtp2")
    ours, ref = (EvalResult.load(Path(out[k]) / "eval" / "step_0000.npz") for k in ("rtp2", "full"))
    worst = float((ours.images - ref.images).abs().max())
    print(f"rollout tp 2 evaluation vs rollout tp 1 at step 0: images max |diff| {worst:.2e}")
    assert ours.prompts == ref.prompts and ours.images.shape == (2, 3, 32, 32) and worst <= 1 / 255, worst
    evals = [json.loads(x) for x in (Path(out["rtp2"]) / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, PP_STEPS], evals
