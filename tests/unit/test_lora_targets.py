"""LoRA targets are checked, never silently empty: a pattern that matches no parallel linear is refused naming
what the model has; adapters start as the base model (B = 0) and carry Megatron's tensor-parallel attributes."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.parallel import platform


@pytest.fixture(scope="module")
def single_rank_group():
    platform.init_distributed(rank=0, world_size=1)
    yield
    platform.destroy_distributed()


def _model():
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.linear import ColumnParallelLinear, RowParallelLinear
    from megatron_omni.parallel.platform import megatron_config_defaults

    groups = build_parallel_groups(ParallelLayout())
    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, add_bias_linear=True,
                            **megatron_config_defaults())
    m = torch.nn.Module()
    m.block = torch.nn.Module()
    m.block.linear_qkv = ColumnParallelLinear(8, 24, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                              gather_output=False, tp_group=groups.tp)
    m.block.linear_proj = RowParallelLinear(8, 8, config=cfg, init_method=torch.nn.init.normal_, bias=True,
                                            input_is_parallel=True, skip_bias_add=False, tp_group=groups.tp)
    m.norm = torch.nn.LayerNorm(8)
    return m


def test_unmatched_target_is_refused_with_the_models_linears(single_rank_group) -> None:
    from megatron_omni.models.lora import add_lora

    with pytest.raises(ValueError, match=r"\['\*\.to_q'\] match no tensor-parallel linear.*linear_proj"):
        add_lora(_model(), ["*.linear_qkv", "*.to_q"], rank=2, alpha=2)


def test_a_new_adapter_is_the_base_model_and_only_adapters_train(single_rank_group) -> None:
    from megatron_omni.models.lora import adapters, add_lora

    m = _model()
    x = torch.randn(3, 8)
    before = m.block.linear_qkv(x)[0]
    assert add_lora(m, ["block.*"], rank=2, alpha=4) == ["block.linear_qkv", "block.linear_proj"]
    assert torch.equal(m.block.linear_qkv(x)[0], before)
    assert not m.norm.weight.requires_grad and not m.block.linear_qkv.weight.requires_grad
    ad = adapters(m)
    assert ad["block.linear_qkv"].lora_b.tensor_model_parallel and ad["block.linear_qkv"].lora_b.partition_dim == 0
    assert ad["block.linear_proj"].lora_a.tensor_model_parallel and ad["block.linear_proj"].lora_a.partition_dim == 1
    assert not ad["block.linear_qkv"].lora_a.tensor_model_parallel
    with pytest.raises(ValueError, match="already carries"):
        add_lora(m, ["block.linear_qkv"], rank=2, alpha=4)
