"""FP8 rollout speed on a GPU (tools/gpu_check.sh (e) and (f)).

(e) The rollout's forward with FP8 linears against bf16, on 20B-shaped blocks (dim 3072, 24 heads, 1024 image +
256 text tokens: 512 x 512, as the recipes): the linears `rollout.quantization=fp8` quantizes get ModelOpt's
FP8 per-channel weights (`quantization.fp8_quantize_weight`, what the bridge feeds vLLM-Omni) and quantize
their input per token at run time, then multiply in FP8 with torch's row-wise scaled GEMM: the arithmetic of
vLLM's `FP8_PER_CHANNEL_PER_TOKEN` linears (vLLM itself runs CUTLASS for it; the lent machine has no vLLM).
Figures: forward ms per block (the 4-layer minus the 2-layer model, halved) and the speed-up, per batch of
samples, and the FP8 output's relative error. Needs ModelOpt (the check carries its wheels).

(f) With vLLM-Omni on the machine (the GPU image): the real engine, `VllmOmniRolloutEngine` in bf16 and with
`quantization=fp8` on the small tiny pipeline, images/s of the same rollout, and the FP8 engine's probe against
the bf16 diffusers engine's within the quantizer's bound (`check_quantized_probe`). Skips, printing why,
without vLLM-Omni.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_omni.parallel import platform
from model_providers import get_family
from model_providers.qwen_image import provider
from tests.gpu.cuda import require_cuda, require_module
from tests.gpu.vllm_omni_gpu import require_vllm_omni_gpu

pytestmark = pytest.mark.gpu

FP8_MAX = 448.0


class Fp8Linear(torch.nn.Module):
    """A linear computed as vLLM's FP8_PER_CHANNEL_PER_TOKEN linears compute it: the weight in ModelOpt's FP8
    per-channel form, the input quantized per token at run time, one row-wise scaled FP8 GEMM (bf16 out)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        from megatron_omni.rollout.quantization import fp8_quantize_weight

        super().__init__()
        q, scale = fp8_quantize_weight(linear.weight)
        self.register_buffer("weight_t", q.t())  # [in, out], column-major: the GEMM's B
        self.register_buffer("scale_b", scale.view(1, -1))
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        scale_a = (x2.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
        xq = (x2.float() / scale_a).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.weight_t, scale_a=scale_a, scale_b=self.scale_b, bias=self.bias,
                             out_dtype=torch.bfloat16)
        return y.view(*x.shape[:-1], -1)


def _fp8_copy(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every linear `rollout.quantization=fp8` quantizes replaced by an `Fp8Linear`, in place."""
    from megatron_omni.rollout.quantization import QuantizationSpec

    spec = QuantizationSpec("fp8", get_family("qwen_image").quantized_linears)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and spec.quantizes(n)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent)
        setattr(owner, child, Fp8Linear(getattr(owner, child)))
    return model


def _forward_seconds(model: torch.nn.Module, inputs: dict, iters: int) -> float:
    with torch.no_grad():
        for _ in range(3):
            model(**inputs)
        platform.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            model(**inputs)
        platform.synchronize()
    return (time.perf_counter() - t0) / iters


def test_fp8_forward_of_20b_blocks(record) -> None:
    require_cuda("the FP8 rollout forward of 20B blocks")
    require_module("modelopt", "the FP8 weights (ModelOpt's FP8QTensor)")
    from diffusers import QwenImageTransformer2DModel

    grid, s_txt = (1, 32, 32), 256
    rows = {}
    for b in (1, 4, 8):
        seconds: dict[tuple[str, int], float] = {}
        for layers in (2, 4):
            cfg = dict(provider.hf_config("20b"), num_layers=layers)
            torch.manual_seed(0)
            model = QwenImageTransformer2DModel(**cfg).to("cuda", torch.bfloat16).eval()
            with torch.no_grad():
                for p in model.parameters():  # adaLN starts at zero: give every layer signal
                    p.normal_(0.0, 0.02)
            g = torch.Generator(device="cuda").manual_seed(1)
            inputs = dict(
                hidden_states=torch.randn(b, grid[1] * grid[2], cfg["in_channels"], generator=g, device="cuda",
                                          dtype=torch.bfloat16),
                encoder_hidden_states=torch.randn(b, s_txt, cfg["joint_attention_dim"], generator=g, device="cuda",
                                                  dtype=torch.bfloat16),
                encoder_hidden_states_mask=torch.ones(b, s_txt, dtype=torch.long, device="cuda"),
                timestep=torch.full((b,), 0.5, device="cuda", dtype=torch.bfloat16),
                img_shapes=[[grid]] * b, return_dict=False)
            seconds[("bf16", layers)] = _forward_seconds(model, inputs, iters=10)
            with torch.no_grad():
                want = model(**inputs)[0].float()
            _fp8_copy(model)
            seconds[("fp8", layers)] = _forward_seconds(model, inputs, iters=10)
            with torch.no_grad():
                got = model(**inputs)[0].float()
            rel = float((got - want).norm() / want.norm())
            assert torch.isfinite(got).all() and rel < 0.15, rel
            del model
            torch.cuda.empty_cache()
        bf16_ms = 1e3 * (seconds[("bf16", 4)] - seconds[("bf16", 2)]) / 2
        fp8_ms = 1e3 * (seconds[("fp8", 4)] - seconds[("fp8", 2)]) / 2
        rows[b] = dict(bf16_block_ms=bf16_ms, fp8_block_ms=fp8_ms, speedup=bf16_ms / fp8_ms, output_rel_err=rel)
    record("e_fp8_forward_20b_block", **{f"batch_{b}": r for b, r in rows.items()})
    assert rows[8]["speedup"] > 1.0, rows  # FP8 GEMMs at a full batch must beat bf16, else the path is wrong


def test_vllm_omni_fp8_engine_rollout(record, tmp_path) -> None:
    require_vllm_omni_gpu("tests/distributed/test_rollout_vllm_fp8.py")
    require_module("modelopt", "the FP8 weights (ModelOpt's FP8QTensor)")
    from megatron_omni.rollout.base import SamplingParams
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
    from megatron_omni.rollout.probe import check_quantized_probe, probe_tolerance, probe_trajectory
    from megatron_omni.rollout.quantization import QuantizationSpec, probe_relative_tolerance
    from megatron_omni.rollout.vllm_omni.engine import VllmOmniRolloutEngine
    from model_providers.qwen_image.tiny_pipeline import SMALL_TRANSFORMER, TinyPipelineConfig, make_tiny_pipeline

    folder = make_tiny_pipeline(tmp_path / "small", seed=0, config=TinyPipelineConfig(transformer=SMALL_TRANSFORMER))
    spec = QuantizationSpec("fp8", get_family("qwen_image").quantized_linears)
    params = SamplingParams(height=256, width=256, num_steps=10, noise_level=1.0, window_size=2)
    prompts, seeds = ["a red cat", "OPEN 24 HOURS"] * 4, list(range(8))
    trainer = DiffusersRolloutEngine(folder, dtype=torch.bfloat16)
    probe = probe_trajectory(trainer.transformer_config(), torch.device("cuda"))
    trainer_means = trainer.probe(probe)
    figures = {}
    for name, quantization in (("bf16", None), ("fp8", spec)):
        engine = VllmOmniRolloutEngine(folder, tensor_parallel_size=1, dtype="bfloat16", quantization=quantization)
        engine.load_initial_weights()
        engine.generate(prompts[:2], params, seeds=seeds[:2])  # warm-up
        t0 = time.perf_counter()
        engine.generate(prompts, params, seeds=seeds)
        figures[f"{name}_images_per_s"] = len(prompts) / (time.perf_counter() - t0)
        if quantization is not None:
            got = check_quantized_probe(engine.probe(probe), trainer_means, probe, probe_tolerance(torch.bfloat16),
                                        probe_relative_tolerance(spec), "FP8 engine on the GPU")
            figures.update(probe_diff=got.quantization_diff, probe_bound=got.bound)
        engine.close()
    figures["speedup"] = figures["fp8_images_per_s"] / figures["bf16_images_per_s"]
    record("f_vllm_omni_fp8_rollout", **figures)
    assert figures["speedup"] > 1.0, figures  # the FP8 engine must sample faster than bf16, else it does not pay
