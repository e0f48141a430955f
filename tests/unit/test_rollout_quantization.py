"""Quantized rollout in the embedded diffusers engine (ModelOpt fake quantization, `rollout/quantization.py`).

A Megatron Qwen-Image model (one gloo rank) holds "trained" weights: the tiny pipeline's, halved (so many
per-channel maxima shrink, which a running-max re-calibration would miss) plus noise. The bridge syncs them into
an FP8 engine; the engine must then hold exactly what `mtq.quantize` makes of a fresh copy with those weights,
and the probe check with quantization must pass for it and fail for every kind of stale or unquantized copy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_omni.parallel import platform
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
from megatron_omni.rollout.probe import ProbeMismatch, check_quantized_probe, probe_trajectory
from megatron_omni.rollout.quantization import (
    QuantizationSpec,
    fp8_checkpoint_items,
    fp8_quantize_weight,
    modelopt_config,
    probe_relative_tolerance,
)
from model_providers import get_family

SPEC = QuantizationSpec("fp8", get_family("qwen_image").quantized_linears)
FP32_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def trained(tiny_pipeline_dir: str):
    """(Megatron model with the trained weights, its diffusers-named state, the trainer's probe means)."""
    from megatron_omni.algorithms.transition import recompute_log_probs
    from megatron_omni.models.dit.diffusers_interface import DiffusersForward
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from model_providers.qwen_image import provider

    platform.init_distributed(rank=0, world_size=1)
    hf_cfg = json.loads((Path(tiny_pipeline_dir) / "transformer" / "config.json").read_text())
    base = DiffusersRolloutEngine(tiny_pipeline_dir).initial_state_dict()
    g = torch.Generator().manual_seed(3)
    state = {k: 0.5 * v + 0.02 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    groups = build_parallel_groups(ParallelLayout())
    seed_everything(0, tp_rank=0)
    model = provider.build_model(provider.transformer_config(hf_cfg, tp=1), groups)
    provider.load_hf_state_dict(model, state)
    probe = probe_trajectory(hf_cfg)
    with torch.no_grad():
        means = recompute_log_probs(probe, DiffusersForward(model), return_means=True).means
    yield model, state, probe, means
    platform.destroy_distributed()


def _synced(folder: str, model, quantization: QuantizationSpec | None) -> DiffusersRolloutEngine:
    """An engine that received the trainer's weights through the bridge (direct mode), as the trainer syncs."""
    from megatron_omni.bridge import WeightSync
    from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan

    engine = DiffusersRolloutEngine(folder, quantization=quantization)
    plan = qwen_image_plan(engine.transformer_config(), trainer_tp=1, rollout_kind="diffusers", rollout_tp=1,
                           mode="direct")
    with engine.weight_update():
        WeightSync(plan, sources=megatron_sources(model), target=engine.weight_sink().target).sync()
    return engine


def test_quantized_sync_equals_mtq_quantize_on_a_copy(tiny_pipeline_dir: str, trained) -> None:
    import modelopt.torch.quantization as mtq
    from diffusers import QwenImageTransformer2DModel

    model, state, probe, _ = trained
    before = DiffusersRolloutEngine(tiny_pipeline_dir, quantization=SPEC).quantizer.quantized_weights()
    engine = _synced(tiny_pipeline_dir, model, SPEC)
    copy = QwenImageTransformer2DModel.from_pretrained(Path(tiny_pipeline_dir) / "transformer")
    copy.load_state_dict(state)
    mtq.quantize(copy, modelopt_config(SPEC), forward_loop=None)

    got, want = engine.transformer.state_dict(), copy.state_dict()
    assert sorted(got) == sorted(want)
    unequal = [k for k in want if not torch.equal(got[k], want[k])]
    assert not unequal, unequal[:5]  # weights and every quantizer's scales, bit for bit
    ours = engine.quantizer.quantized_weights()
    assert len(ours) == 12 * engine.transformer.config.num_layers
    for name, w in ours.items():
        module = copy.get_submodule(name)
        assert torch.equal(w, module.weight_quantizer(module.weight)), name
        assert not torch.equal(w, before[name]), name  # the sync moved it
    with torch.no_grad():
        from megatron_omni.algorithms.transition import recompute_log_probs

        theirs = recompute_log_probs(probe, copy, return_means=True).means
    assert torch.equal(engine.probe(probe), theirs)
    # only the family's linears are quantized: the modulations, embedders and output projection are not
    enabled = {n.rsplit(".", 1)[0] for n, m in engine.transformer.named_modules()
               if n.endswith("_quantizer") and m.is_enabled}
    assert enabled == set(ours)


def test_probe_passes_for_a_synced_quantized_engine(tiny_pipeline_dir: str, trained) -> None:
    model, _, probe, means = trained
    engine = _synced(tiny_pipeline_dir, model, SPEC)
    got = check_quantized_probe(engine.probe(probe), means, probe, FP32_TOLERANCE, probe_relative_tolerance(SPEC),
                                "after the sync", engine.probe_unquantized(probe))
    assert got.weights_diff <= FP32_TOLERANCE
    assert 0 < got.quantization_diff <= got.bound
    assert got.bound == pytest.approx(probe_relative_tolerance(SPEC) * got.velocity_term)


@pytest.mark.parametrize("copy", ["unquantized_stale", "quantized_stale", "unquantized_synced"])
def test_probe_fails_on_a_stale_or_unquantized_copy(tiny_pipeline_dir: str, trained, copy: str) -> None:
    model, _, probe, means = trained
    quantization = SPEC if copy.startswith("quantized") else None
    engine = (_synced(tiny_pipeline_dir, model, quantization) if copy.endswith("synced")
              else DiffusersRolloutEngine(tiny_pipeline_dir, quantization=quantization))
    expected = "does not quantize" if copy == "unquantized_synced" else "quantizers off"
    with pytest.raises(ProbeMismatch, match=expected):
        check_quantized_probe(engine.probe(probe), means, probe, FP32_TOLERANCE, probe_relative_tolerance(SPEC),
                              copy, engine.probe_unquantized(probe))


def test_fp8_export_form_equals_the_fake_quantized_weights(tiny_pipeline_dir: str) -> None:
    engine = DiffusersRolloutEngine(tiny_pipeline_dir, quantization=SPEC)
    fake = engine.quantizer.quantized_weights()
    state = engine.initial_state_dict()
    names = {f"{n}.weight" for n in fake}
    items = dict(fp8_checkpoint_items(state.items(), names))
    assert sorted(items) == sorted(list(state) + [n.removesuffix("weight") + "weight_scale" for n in names])
    for module, w in fake.items():
        q, scale = items[f"{module}.weight"], items[f"{module}.weight_scale"]
        assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (q.shape[0],)
        # ModelOpt's real quantizer divides by the scale, its fake one multiplies by the inverse: fp32 rounding
        torch.testing.assert_close(q.float() * scale[:, None], w, rtol=0, atol=1e-6 * float(w.abs().max()))
    zero = torch.zeros(3, 4)
    zero[1] = torch.tensor([1.0, -2.0, 0.5, 0.0])
    q, scale = fp8_quantize_weight(zero)
    assert torch.equal(scale, torch.tensor([1.0, 2.0 / 448, 1.0]))  # an all-zero row: scale 1, not 0 / 0
    torch.testing.assert_close(q.float() * scale[:, None], zero, rtol=1e-6, atol=0)


def test_initial_state_and_weight_names_are_the_unquantized_engines(tiny_pipeline_dir: str) -> None:
    from megatron_omni.rollout.registry import EngineSettings, build_engine

    quantized = build_engine("diffusers", tiny_pipeline_dir, EngineSettings(quantization=SPEC))
    assert quantized.quantizer is not None and quantized.quantizer.check_enabled() == 24
    plain = DiffusersRolloutEngine(tiny_pipeline_dir)
    a, b = quantized.initial_state_dict(), plain.initial_state_dict()
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert quantized.weight_sink().target.parameters().keys() == plain.weight_sink().target.parameters().keys()


def test_bad_quantization_settings_are_refused(tiny_pipeline_dir: str) -> None:
    with pytest.raises(ValueError, match="unknown rollout quantization 'int3'"):
        QuantizationSpec("int3", SPEC.linears)
    with pytest.raises(ValueError, match="quantized linears"):
        QuantizationSpec("fp8")
    typo = QuantizationSpec("fp8", ("transformer_blocks.*.attn.to_qq",))
    with pytest.raises(ValueError, match=r"\['transformer_blocks\.\*\.attn\.to_qq'\] match no linear"):
        DiffusersRolloutEngine(tiny_pipeline_dir, quantization=typo)
    with pytest.raises(ValueError, match="velocity_model"):
        DiffusersRolloutEngine(tiny_pipeline_dir, quantization=SPEC, velocity_model=lambda **kw: None)
    engine = DiffusersRolloutEngine(tiny_pipeline_dir, quantization=SPEC)
    with pytest.raises(ValueError, match="lora_sync=merge"):
        engine.load_lora({}, rank=4, alpha=4.0)
