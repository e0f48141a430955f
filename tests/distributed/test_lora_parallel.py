"""LoRA on Megatron-Core's parallel linears (`megatron_omni.models.lora`) at TP=2 equals the dense computation
`W x + (alpha / r) B A x` for a column -> row pair: output, the adapters' gradients (each shard against the
dense gradient's shard; the replicated factor equal on both ranks), frozen base weights without gradients,
the merged weights as shards of the dense merged weight, and the base model when the adapters are off; a split
adapter starts as the shards of the unsplit one."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _lora_pair(rank: int, world_size: int) -> dict[str, float]:
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_omni.models.lora import adapters, adapters_disabled, add_lora, merged_weight
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.linear import ColumnParallelLinear, RowParallelLinear
    from megatron_omni.parallel.platform import megatron_config_defaults, seed_everything

    tp_size = world_size
    groups = build_parallel_groups(ParallelLayout(tp=tp_size))
    tp, t = groups.tp, groups.tp.rank()
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            tensor_model_parallel_size=tp_size, add_bias_linear=True, hidden_dropout=0.0,
                            attention_dropout=0.0, **megatron_config_defaults())
    seed_everything(0, tp_rank=t)
    g = torch.Generator().manual_seed(0)
    w1, b1, w2, b2 = torch.randn(64, 32, generator=g), torch.randn(64, generator=g), torch.randn(32, 64, generator=g), \
        torch.randn(32, generator=g)
    r, alpha = 4, 8.0
    a1, bb1 = torch.randn(r, 32, generator=g), torch.randn(64, r, generator=g)
    a2, bb2 = torch.randn(r, 64, generator=g), torch.randn(32, r, generator=g)
    x = torch.randn(5, 3, 32, generator=g)

    model = torch.nn.Module()
    model.fc1 = ColumnParallelLinear(32, 64, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
                                     gather_output=False, tp_group=tp)
    model.fc2 = RowParallelLinear(64, 32, config=cfg, init_method=torch.nn.init.zeros_, bias=True,
                                  input_is_parallel=True, skip_bias_add=False, tp_group=tp)
    names = add_lora(model, ["fc*"], rank=r, alpha=alpha)
    ad = adapters(model)
    init_a2 = ad["fc2"].lora_a.detach().clone()
    with torch.no_grad():
        model.fc1.weight.copy_(w1.chunk(tp_size, 0)[t])
        model.fc1.bias.copy_(b1.chunk(tp_size, 0)[t])
        model.fc2.weight.copy_(w2.chunk(tp_size, 1)[t])
        model.fc2.bias.copy_(b2)
        ad["fc1"].lora_a.copy_(a1)  # column: A whole, B split by rows
        ad["fc1"].lora_b.copy_(bb1.chunk(tp_size, 0)[t])
        ad["fc2"].lora_a.copy_(a2.chunk(tp_size, 1)[t])  # row: A split by columns, B whole
        ad["fc2"].lora_b.copy_(bb2)

    def forward() -> torch.Tensor:
        h, _ = model.fc1(x)
        y, _ = model.fc2(torch.nn.functional.gelu(h))
        return y

    y = forward()
    y.square().sum().backward()
    with adapters_disabled(model):
        base = forward()

    s = alpha / r
    ra1, rb1, ra2, rb2 = (p.clone().requires_grad_() for p in (a1, bb1, a2, bb2))
    h = x @ w1.T + b1 + s * (x @ ra1.T) @ rb1.T
    ry = torch.nn.functional.gelu(h) @ w2.T + b2 + s * (torch.nn.functional.gelu(h) @ ra2.T) @ rb2.T
    ry.square().sum().backward()
    ref_base = torch.nn.functional.gelu(x @ w1.T + b1) @ w2.T + b2
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return {
        "names": names, "trainable": trainable,
        "frozen_grads": [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None],
        "out": _rel(y, ry), "base": _rel(base, ref_base),
        "grad_a1": _rel(ad["fc1"].lora_a.grad, ra1.grad),
        "grad_b1": _rel(ad["fc1"].lora_b.grad, rb1.grad.chunk(tp_size, 0)[t]),
        "grad_a2": _rel(ad["fc2"].lora_a.grad, ra2.grad.chunk(tp_size, 1)[t]),
        "grad_b2": _rel(ad["fc2"].lora_b.grad, rb2.grad),
        "merged1": _rel(merged_weight(model.fc1), (w1 + s * bb1 @ a1).chunk(tp_size, 0)[t]),
        "merged2": _rel(merged_weight(model.fc2), (w2 + s * bb2 @ a2).chunk(tp_size, 1)[t]),
        "a1_grad": ad["fc1"].lora_a.grad.clone(), "b2_grad": ad["fc2"].lora_b.grad.clone(), "init_a2": init_a2,
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_on_column_and_row_parallel_equals_dense(tp: int) -> None:
    results = run_ranks(_lora_pair, tp)
    for res in results:
        assert res["names"] == ["fc1", "fc2"]
        assert res["trainable"] == ["fc1.lora.lora_a", "fc1.lora.lora_b", "fc2.lora.lora_a", "fc2.lora.lora_b"]
        assert res["frozen_grads"] == []
        for key in ("out", "base", "grad_a1", "grad_b1", "grad_a2", "grad_b2", "merged1", "merged2"):
            assert res[key] < 1e-5, (key, res[key])
    # the replicated factors' gradients are the same on every rank (their reduction is the layer's)
    assert all(torch.equal(r["a1_grad"], results[0]["a1_grad"]) for r in results)
    assert all(torch.equal(r["b2_grad"], results[0]["b2_grad"]) for r in results)


def test_a_split_adapter_starts_as_the_shards_of_the_unsplit_one() -> None:
    """The row-parallel A is drawn whole and split: at TP=2 its shards are the TP=1 adapter's columns."""
    whole = run_ranks(_lora_pair, 1)[0]["init_a2"]
    shards = [r["init_a2"] for r in run_ranks(_lora_pair, 2)]
    assert torch.equal(torch.cat(shards, dim=1), whole)
