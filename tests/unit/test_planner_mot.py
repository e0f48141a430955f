"""The planner's MoT cost model on BAGEL-7B-MoT (the per-rank counts are checked against the built tiny model in
tests/distributed/test_bagel_parity.py)."""

from __future__ import annotations

import pytest

from megatron_omni.planner import mot


def test_bagel_7b_mot_parameters() -> None:
    total = mot.rank_parameter_counts("7b-mot", tp=1)[0]
    gen = mot.rank_parameter_counts("7b-mot", tp=1, trainable="gen")[0]
    # BAGEL-7B-MoT: "7B active, 14B total" (two experts of a Qwen2.5-7B, sharing embedding and head).
    assert 14.0e9 < total < 14.3e9, total
    assert 6.4e9 < gen < 6.7e9, gen  # one expert's layers + the generation side, without embedding and head
    assert sum(mot.rank_parameter_counts("7b-mot", tp=1, pp=4)) == total
    assert mot.rank_parameter_counts("7b-mot", tp=4)[0] < total / 3


def test_frozen_understanding_expert_saves_optimizer_state() -> None:
    gen = mot.mot_memory("7b-mot", tp=2, train="gen")
    both = mot.mot_memory("7b-mot", tp=2, train="both")
    assert gen.weights == both.weights  # both experts' weights are held either way
    assert gen.optimizer < 0.5 * both.optimizer and gen.grads < 0.5 * both.grads
    # weights + grads + Adam state (no activations): 124 GiB at tp 1 fits an H200's 141 GB, tp 2 an H800's 80 GB
    assert mot.mot_memory("7b-mot", tp=1, train="gen").total < 141e9
    assert mot.mot_memory("7b-mot", tp=2, train="gen").total < 80e9
    with pytest.raises(ValueError, match="train"):
        mot.mot_memory("7b-mot", tp=1, train="und")


def test_lora_plans_adapter_state_only() -> None:
    """LoRA on the generation expert: the frozen base's weights counted once, the adapters' weights, gradients and
    Adam state added; the adapter count follows `models.lora`'s tensor-parallel split (checked against the built
    tiny model per rank in tests/distributed/test_bagel_parity.py)."""
    base = mot.rank_parameter_counts("7b-mot", tp=1)[0]
    adapters = mot.lora_parameter_counts("7b-mot", tp=1, rank=64)[0]
    # 28 layers x rank 64 x (qkv 3584 + 4608, o 3584 + 3584, fc1 3584 + 37888, fc2 18944 + 3584)
    assert adapters == 28 * 64 * (3584 + 4608 + 3584 + 3584 + 3584 + 37888 + 18944 + 3584)
    lora = mot.mot_memory("7b-mot", tp=1, train="lora", lora_rank=64)
    gen = mot.mot_memory("7b-mot", tp=1, train="gen")
    assert lora.weights == (base + adapters) * 2 and lora.grads == adapters * 4 and lora.optimizer == adapters * 12
    assert lora.total < 0.3 * gen.total
    # tp 2: the replicated factors (A of q/k/v and fc1, B of o and fc2) stay whole
    assert adapters / 2 < mot.lora_parameter_counts("7b-mot", tp=2, rank=64)[0] < adapters
    assert sum(mot.lora_parameter_counts("7b-mot", tp=1, pp=4, rank=64)) == adapters


def test_generation_step_flops_scale_with_image_tokens() -> None:
    small = mot.generation_step_flops("7b-mot", 1024, 64)
    big = mot.generation_step_flops("7b-mot", 4096, 64)
    # linear in the tokens for the projections, quadratic for attention: between 4x and 16x
    assert 4 * small < big < 16 * small
    # about 2 x 6.5e9 active parameters per image token, plus attention
    assert 2 * 6.4e9 * 4096 < big < 2 * 7.5e9 * 4096 * 1.5
