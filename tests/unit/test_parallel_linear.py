"""`parallel.linear`: at tp=1 the direct `F.linear` path gives Megatron-Core's outputs and gradients (input,
weight, bias) for column- and row-parallel layers, with and without skip_bias_add; features that need
Megatron-Core's own path (gradient-accumulation fusion, sequence parallelism, expert comm) keep it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.parallel.linear import ColumnParallelLinear, RowParallelLinear, runs_unsplit
from model_providers.qwen_image import provider


@pytest.fixture(scope="module")
def tp_group():
    platform.init_distributed(rank=0, world_size=1)
    yield build_parallel_groups(ParallelLayout()).tp
    platform.destroy_distributed()


def _build(cls, tp_group, skip_bias_add: bool, **config_overrides):
    config = dataclasses.replace(provider.transformer_config("tiny"), **config_overrides)
    kwargs = dict(config=config, init_method=torch.nn.init.normal_, bias=True, skip_bias_add=skip_bias_add,
                  tp_group=tp_group, is_expert=False)
    if cls is ColumnParallelLinear:
        return cls(24, 40, gather_output=True, **kwargs)
    return cls(24, 40, input_is_parallel=True, **kwargs)


def _run(layer, x: torch.Tensor, w_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    out, bias = layer(x)
    if bias is not None:
        out = out + bias
    (out * w_out).sum().backward()
    return out.detach(), x.grad, layer.weight.grad, layer.bias.grad


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("skip_bias_add", [False, True])
def test_direct_path_equals_megatron_core(tp_group, cls, skip_bias_add: bool) -> None:
    layer = _build(cls, tp_group, skip_bias_add)
    assert layer.direct
    with torch.no_grad():
        layer.bias.normal_()
    g = torch.Generator().manual_seed(0)
    x, w_out = torch.randn(7, 3, 24, generator=g), torch.randn(7, 3, 40, generator=g)
    direct = _run(layer, x, w_out)
    layer.direct = False
    megatron = _run(layer, x, w_out)
    for name, a, b in zip(("output", "input grad", "weight grad", "bias grad"), direct, megatron, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
        assert a.abs().max() > 0, name


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
@pytest.mark.parametrize("attr", ["gradient_accumulation_fusion", "sequence_parallel", "explicit_expert_comm"])
def test_features_that_need_megatron_core_keep_its_path(tp_group, cls, attr: str) -> None:
    # Megatron-Core refuses to build these on CPU (fused wgrad needs its CUDA extension, SP and expert comm a
    # tp group > 1), so the flag is set on a built layer.
    layer = _build(cls, tp_group, False)
    assert runs_unsplit(layer)
    setattr(layer, attr, True)
    assert not runs_unsplit(layer)
