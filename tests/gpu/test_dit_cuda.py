"""Our Megatron MMDiT on one CUDA device in bf16 (run by tools/gpu_check.sh on the lent H200):

(a) the `local` spec against diffusers' `QwenImageTransformer2DModel` with the same weights, both in bf16, each
    measured against diffusers in fp32: ours may not be further from the fp32 reference than diffusers' own
    bf16 run is (x 1.5), and the bf16 outputs' max abs difference is recorded;
(c) forward + backward time of one 20B-shaped block (the 20b preset's widths, 1024 image + 256 text tokens,
    batch 1, 2, 4), as the difference of a 4-block and a 2-block model (embedders cancel), in TFLOP/s and
    MFU against 790 TFLOP/s (H200 dense bf16 as measured by cuBLAS) and against the planner's 989 peak, held to
    the planner's assumed MFU with a stated margin (`tests/gpu/cuda.py`, `check_block_throughput`);
(d) the `te` spec (TransformerEngine linears) against `local` in bf16, forward and grads, TP=1.

Skipped with the reason printed on machines without CUDA (and (d) without TransformerEngine).
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_omni.models.dit.model import DiTBatch
from megatron_omni.parallel import platform
from megatron_omni.planner import GPUS
from megatron_omni.planner.flops import forward_flops
from model_providers.qwen_image import provider
from tests.gpu.cuda import ACHIEVABLE_BF16, check_block_throughput, one_rank_groups, require_cuda, require_module

pytestmark = pytest.mark.gpu

GRID = (1, 16, 16)  # 256 image tokens for the parity checks
S_TXT = 32


def _reference_weights(name: str) -> dict[str, torch.Tensor]:
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**provider.hf_config(name))
    with torch.no_grad():
        for p in ref.parameters():  # diffusers zero-initialises adaLN: use weights that carry signal
            p.normal_(0.0, 0.02)
    return ref.state_dict()


def _batch(cfg: dict, grid: tuple[int, int, int], s_txt: int, b: int, dtype: torch.dtype) -> DiTBatch:
    g = torch.Generator().manual_seed(1)
    s_img = grid[0] * grid[1] * grid[2]
    mask = torch.ones(b, s_txt, dtype=torch.bool)
    mask[-1, s_txt // 2:] = False
    dev = platform.device()
    return DiTBatch(torch.randn(b, s_img, cfg["in_channels"], generator=g).to(dev, dtype),
                    torch.randn(b, s_txt, cfg["joint_attention_dim"], generator=g).to(dev, dtype),
                    mask.to(dev), torch.rand(b, generator=g).to(dev), grid)


def _ours(name: str, backend: str, dtype: torch.dtype, state: dict[str, torch.Tensor] | None = None):
    groups = one_rank_groups()
    cfg = provider.transformer_config(name, params_dtype=dtype)
    model = provider.build_model(cfg, groups, backend=backend)
    if state is not None:
        provider.load_hf_state_dict(model, state)
    return model.to(platform.device())


def _diffusers(name: str, dtype: torch.dtype, state: dict[str, torch.Tensor]):
    from diffusers import QwenImageTransformer2DModel

    ref = QwenImageTransformer2DModel(**provider.hf_config(name))
    ref.load_state_dict(state)
    return ref.to(platform.device(), dtype)


def _diffusers_out(ref, batch: DiTBatch, dtype: torch.dtype) -> torch.Tensor:
    return ref(hidden_states=batch.latents.to(dtype), encoder_hidden_states=batch.prompt_embeds.to(dtype),
               encoder_hidden_states_mask=batch.prompt_mask, timestep=batch.sigma.to(dtype),
               img_shapes=[[batch.grid]] * batch.latents.shape[0]).sample


@torch.no_grad()
def test_local_spec_matches_diffusers_in_bf16(record) -> None:
    require_cuda("our MMDiT against diffusers in bf16")
    state = _reference_weights("small")
    cfg = provider.hf_config("small")
    batch = _batch(cfg, GRID, S_TXT, 2, torch.bfloat16)
    reference = _diffusers_out(_diffusers("small", torch.float32, state), batch, torch.float32)
    theirs = _diffusers_out(_diffusers("small", torch.bfloat16, state), batch, torch.bfloat16).float()
    ours = _ours("small", "local", torch.bfloat16, state)(batch).float()
    ours_err = (ours - reference).abs().max().item()
    theirs_err = (theirs - reference).abs().max().item()
    diff = (ours - theirs).abs().max().item()
    record("a_local_vs_diffusers_bf16", max_abs_diff=diff, ours_vs_fp32=ours_err, diffusers_vs_fp32=theirs_err,
           output_abs_max=reference.abs().max().item())
    assert torch.isfinite(ours).all()
    assert ours_err <= 1.5 * theirs_err + 1e-3, (ours_err, theirs_err)


def _fwd_bwd_seconds(model, batch: DiTBatch, iters: int) -> float:
    weight = torch.randn_like(model(batch))
    for _ in range(3):  # warm-up: kernels picked, allocator grown
        (model(batch) * weight).sum().backward()
    platform.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        (model(batch) * weight).sum().backward()
    platform.synchronize()
    return (time.perf_counter() - t0) / iters


def test_20b_block_throughput(record) -> None:
    require_cuda("the 20B block's throughput")
    grid, s_txt = (1, 32, 32), 256  # 512x512: 1024 image tokens
    rows = {}
    for b in (1, 2, 4):
        seconds, flops = {}, {}
        for layers in (2, 4):
            cfg = dict(provider.hf_config("20b"), num_layers=layers)
            model = _ours(cfg, "local", torch.bfloat16)
            seconds[layers] = _fwd_bwd_seconds(model, _batch(cfg, grid, s_txt, b, torch.bfloat16), iters=10)
            flops[layers] = 3 * b * forward_flops(cfg, grid[1] * grid[2], s_txt).total
            del model
            torch.cuda.empty_cache()
        block_s = (seconds[4] - seconds[2]) / 2
        block_flops = (flops[4] - flops[2]) / 2
        achieved = block_flops / block_s
        rows[b] = dict(block_ms=1e3 * block_s, tflops=achieved / 1e12, mfu_790=achieved / ACHIEVABLE_BF16,
                       mfu=achieved / GPUS["H200"].peak_bf16_flops)
    record("c_20b_block_fwd_bwd", **{f"batch_{b}": r for b, r in rows.items()})
    check_block_throughput(rows)  # against the planner's MFU with its stated margin (tests/gpu/cuda.py)


def test_te_spec_matches_local_in_bf16(record) -> None:
    require_cuda("the TransformerEngine spec")
    require_module("transformer_engine", "the te layer spec")
    state = _reference_weights("small")
    cfg = provider.hf_config("small")
    batch = _batch(cfg, GRID, S_TXT, 2, torch.bfloat16)
    outs, grads = {}, {}
    for backend in ("local", "te"):
        model = _ours("small", backend, torch.bfloat16, state)
        out = model(batch)
        (out.float() * torch.linspace(-1, 1, out.shape[-1], device=out.device)).sum().backward()
        outs[backend] = out.detach().float()
        grads[backend] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    assert grads["te"].keys() == grads["local"].keys()
    out_diff = (outs["te"] - outs["local"]).abs().max().item()
    scale = outs["local"].abs().max().item()
    grad_rel = max(((grads["te"][n] - g).norm() / g.norm().clamp_min(1e-12)).item()
                   for n, g in grads["local"].items())
    record("d_te_vs_local_bf16", out_max_abs_diff=out_diff, out_abs_max=scale, grad_max_rel_diff=grad_rel)
    assert out_diff <= 2e-2 * scale, (out_diff, scale)
    assert grad_rel <= 5e-2, grad_rel
