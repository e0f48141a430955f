"""The dry-run planner's memory formula against the bytes the code really allocates.

On two gloo ranks, for Qwen-Image's tiny and small presets and SD3.5's tiny one (a dual-attention block, a plain
block, the context-pre-only block) at TP 1 and 2 (dp = 2 / tp), in fp32 and bf16, with and without the
distributed optimizer: each rank builds the Megatron model, wraps it the way the trainer does
(`training_state.build_ddp_and_optimizer`), takes one optimizer step (Adam's state is created lazily) and
counts the storages behind its parameters, DDP's main-grad buffers, the main parameters and Adam's moments
(`allocated_bytes`; SD3's constant sincos table, a buffer, is counted with the parameters, as the planner counts
it); the embedded rollout engine's copy is diffusers' transformer in the rollout dtype (its buffers included). The
planner's figures for the same config must be within 5% of each (rank 0, the first stage, is what the
planner reports).

The same ranks measure what one SD3 block saves for its backward (saved-tensor hooks, fp32, a dual-attention
block and a plain one, at TP 1 and 2, with and without full recompute) against the planner's activation model.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_omni.parallel.layout import ParallelLayout
from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.planner import Precision, RolloutSpec, Workload, plan
from megatron_omni.planner.arch import flux_arch, sd3_arch
from megatron_omni.planner.memory import block_activation_bytes
from model_providers.flux import provider as flux_provider
from model_providers.qwen_image import provider
from model_providers.sd3 import provider as sd3_provider
from tests.unit.saved_tensors import block_saved_bytes

CASES = list(itertools.product(("tiny", "small", "sd3-tiny", "flux-tiny"), (1, 2), ("fp32", "bf16"), (False, True)))
# preset name -> (provider, its preset, diffusers' transformer class name)
FAMILIES = {"sd3-tiny": (sd3_provider, "tiny", "SD3Transformer2DModel"),
            "flux-tiny": (flux_provider, "tiny", "FluxTransformer2DModel")}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# An SD3 model wide enough that per-token activations dominate the [b, h] modulation vectors: block 0 dual.
SD3_WIDE = dict(sd3_provider.preset("tiny"), attention_head_dim=32, num_attention_heads=4, caption_projection_dim=128)
# A FLUX model of the same width (h 128; RoPE axes summing to the head dim 32): its single-stream block's saved tensors.
FLUX_WIDE = dict(flux_provider.preset("tiny"), attention_head_dim=32, num_attention_heads=4, axes_dims_rope=(8, 12, 12))
S_IMG, S_TXT, BATCH = 256, 64, 2


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _sd3_saved(tp: int) -> dict:
    """Bytes one SD3 block (0: dual attention, 1: plain) saves for its backward, without and with full recompute."""
    from megatron_omni.parallel import build_parallel_groups

    groups = build_parallel_groups(ParallelLayout(tp=tp))
    model = sd3_provider.build_model(sd3_provider.transformer_config(SD3_WIDE, tp=tp), groups).train()
    h = model.config.hidden_size
    out = {}
    for block in (0, 1):
        for mode in ("none", "full"):
            args = (torch.randn(S_IMG, BATCH, h, requires_grad=True), torch.randn(S_TXT, BATCH, h, requires_grad=True),
                    torch.randn(BATCH, h))
            out[(block, mode)] = block_saved_bytes(model.layers[block], args, mode, model.parameters())
    return out


def _flux_single_saved(tp: int) -> dict:
    """Bytes one FLUX single-stream block saves for its backward ([text; image] of S_TXT + S_IMG tokens), without
    and with full recompute."""
    from megatron_omni.models.dit.embeddings import flux_rope_angles, rope_rotations
    from megatron_omni.parallel import build_parallel_groups

    groups = build_parallel_groups(ParallelLayout(tp=tp))
    model = flux_provider.build_model(flux_provider.transformer_config(FLUX_WIDE, tp=tp), groups).train()
    h = model.config.hidden_size
    img_angles, txt_angles = flux_rope_angles(16, S_IMG // 16, S_TXT, tuple(model.config.axes_dims_rope),
                                              model.config.rope_theta)
    img_rope, txt_rope = rope_rotations(img_angles), rope_rotations(txt_angles)
    out = {}
    for mode in ("none", "full"):
        args = (torch.randn(S_IMG, BATCH, h, requires_grad=True), torch.randn(S_TXT, BATCH, h, requires_grad=True),
                torch.randn(BATCH, h), img_rope, txt_rope)
        # the rotations are computed once per forward and shared by every block: not one block's activations
        out[mode] = block_saved_bytes(model.single_layers[0], args, mode, [*model.parameters(), img_rope, txt_rope])
    return out


def _measure(rank: int, world_size: int) -> dict:
    import diffusers

    from megatron_omni.parallel import build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.trainer.training_state import OptimizerSettings, allocated_bytes, build_ddp_and_optimizer

    out = {}
    for preset, tp, dtype, distributed in CASES:
        prov, name, engine_class = FAMILIES.get(preset, (provider, preset, "QwenImageTransformer2DModel"))
        groups = build_parallel_groups(ParallelLayout(tp=tp))
        seed_everything(0, tp_rank=groups.tp.rank())
        cfg = prov.transformer_config(name, tp=tp, params_dtype=DTYPES[dtype])
        model = prov.build_model(cfg, groups)
        ddp, optimizer = build_ddp_and_optimizer(model, cfg, groups.mcore,
                                                 OptimizerSettings(lr=1e-4, distributed_optimizer=distributed))
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ok, _, _ = optimizer.step()
        assert ok
        counted = allocated_bytes(ddp, optimizer)
        counted["parameters"] += _nbytes(model.buffers())  # SD3's sincos table (Qwen-Image has no buffers)
        engine = getattr(diffusers, engine_class)(**prov.hf_config(name)).to(DTYPES[dtype])
        counted["rollout_weights"] = _nbytes(engine.parameters()) + _nbytes(engine.buffers())
        out[(preset, tp, dtype, distributed)] = counted
    for tp in (1, 2):
        out[("sd3-saved", tp)] = _sd3_saved(tp)
        out[("flux-single-saved", tp)] = _flux_single_saved(tp)
    return out


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_ranks(_measure, 2, timeout_s=600)[0]


@pytest.mark.parametrize("preset,tp,dtype,distributed", CASES)
def test_planner_memory_equals_allocated_bytes(measured, preset: str, tp: int, dtype: str,
                                               distributed: bool) -> None:
    model = FAMILIES[preset][0].hf_config("tiny") if preset in FAMILIES else preset
    report = plan(model, ParallelLayout(tp=tp), 2, "H200", Workload(height=64, width=64, prompts=2, group_size=2),
                  rollout=RolloutSpec(extra_params=0), precision=Precision.of(dtype, dtype, distributed),
                  recompute="none")
    got = measured[(preset, tp, dtype, distributed)]
    m = report.memory
    predicted = {"parameters": m.parameters, "gradients": m.gradients, "optimizer_states": m.optimizer_states,
                 "rollout_weights": m.rollout_weights}
    for part, value in predicted.items():
        assert got[part] > 0, part
        assert abs(value - got[part]) <= 0.05 * got[part], (
            f"{part}: planner {value:,} B vs allocated {got[part]:,} B ({value / got[part]:.3f})")
        print(f"{preset} tp={tp} {dtype} distributed={distributed} {part}: planner {value:,} B, allocated "
              f"{got[part]:,} B ({value / got[part]:.4f})")


@pytest.mark.parametrize("tp", [1, 2])
def test_sd3_activation_model_matches_saved_tensors(measured, tp: int) -> None:
    """The planner's SD3 activations per block (`planner.arch`: a plain block 9 + 17 / tp multiples of h per token,
    a dual block's second image attention 2 + 10 / tp more per image token, full recompute the block's inputs)
    against what the blocks save: the model may save up to 5% more (per-token norm statistics, the [b, h]
    modulation vectors), never less."""
    a = sd3_arch(SD3_WIDE)
    h, tokens = a.hidden, S_IMG + S_TXT
    full, split = a.image_attention_saved
    plain = block_activation_bytes(h, tokens, BATCH, tp, "none", 4, a.saved_per_token)
    predicted = {(1, "none"): plain, (0, "none"): plain + 4 * S_IMG * BATCH * (full * h + split * h // tp),
                 (0, "full"): block_activation_bytes(h, tokens, BATCH, tp, "full", 4, a.saved_per_token)}
    predicted[(1, "full")] = predicted[(0, "full")]
    got = measured[("sd3-saved", tp)]
    for key, want in predicted.items():
        print(f"sd3 tp={tp} block {key[0]} ({'dual' if key[0] == 0 else 'plain'}) recompute {key[1]}: measured "
              f"{got[key]:,} B, predicted {want:,} B ({got[key] / want:.4f})")
    bad = {k: (got[k], want) for k, want in predicted.items() if not want <= got[k] < 1.05 * want}
    assert not bad, bad


@pytest.mark.parametrize("tp", [1, 2])
def test_flux_single_block_activation_model_matches_saved_tensors(measured, tp: int) -> None:
    """The planner's FLUX single-stream block (`planner.arch.FLUX_SINGLE_SAVED_PER_TOKEN`, full + split / tp
    multiples of h per token of [text; image]; full recompute its inputs) against what the block saves: up to 5%
    more (norm statistics, the [b, h] modulation vectors), never less."""
    a = flux_arch(FLUX_WIDE)
    tokens = S_IMG + S_TXT
    predicted = {mode: block_activation_bytes(a.hidden, tokens, BATCH, tp, mode, 4, {"none": a.single_saved})
                 for mode in ("none", "full")}
    got = measured[("flux-single-saved", tp)]
    for mode, want in predicted.items():
        print(f"flux single block tp={tp} recompute {mode}: measured {got[mode]:,} B "
              f"({got[mode] / (4 * a.hidden * tokens * BATCH):.3f} h per token), predicted {want:,} B "
              f"({got[mode] / want:.4f})")
    bad = {k: (got[k], want) for k, want in predicted.items() if not want <= got[k] < 1.05 * want}
    assert not bad, bad
