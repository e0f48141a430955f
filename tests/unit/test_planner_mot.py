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


def test_cp_splits_the_generation_tokens_and_adds_the_kv_all_gather() -> None:
    """Context parallelism in the MoT plan, term by term on BAGEL-7B-MoT at 1024 x 1024 (4096 latents + 2 markers,
    h 3584, 28 layers, 4 query groups of head dim 128): the rank's shard is the model's largest (`shard_bounds`), the
    generation tokens' activations divide by cp, the other shards' k/v are kept per layer, the all-gather receives
    (cp - 1) padded shards of k and v per layer, and the step adds three such collectives per layer (old log-probs'
    forward, training forward, backward's reduce-scatter) per trained sample and branch; cp 1 is unchanged."""
    from megatron_omni.models.bagel.mot import shard_bounds

    for n, cp in ((4096, 2), (4096, 3), (7, 4), (12, 2), (12, 1)):
        assert mot.cp_shard_tokens(n, cp) == max(b - a for a, b in (shard_bounds(n + 2, cp, r) for r in range(cp)))
    h, layers, groups, d = 3584, 28, 4, 128
    one = {p.tp: p for p in mot.plan_mot("7b-mot", "H200", 8)}
    two = {p.tp: p for p in mot.plan_mot("7b-mot", "H200", 8, cp=2)}
    assert sorted(one) == [1, 2, 4] and sorted(two) == [1, 2, 4]  # tp x cp divides the 8 GPUs, tp the 4 groups
    for tp, p in two.items():
        q = one[tp]
        assert (q.cp, q.kv_gather_bytes, q.cp_comm_s) == (1, 0, 0.0)
        assert q.activations == 34 * layers * 4098 * h * 2 // tp  # both CFG branches, the whole query
        kv = 2049 * 2 * (groups // tp) * d * 2  # the other rank's padded shard of k and v, bf16
        assert p.cp == 2 and p.dp == 8 // (2 * tp) and p.kv_gather_bytes == kv
        assert p.activations == 34 * layers * 2049 * h * 2 // tp + layers * 2 * kv  # kept for backward
        # weights whole on every cp rank; the distributed optimizer shards over dp x cp (as many ranks as at cp 1)
        assert p.memory == q.memory
        # 64 images over dp, 2 branches, window 2, 3 collectives per layer, H200 NVLink 450 GB/s x 0.7
        assert p.cp_comm_s == pytest.approx(64 / p.dp * 2 * 2 * 3 * layers * kv / (450e9 * 0.7))
        assert p.step_s == pytest.approx(q.step_s + p.cp_comm_s)
        assert "cp 2: the generation tokens' activations / 2" in "\n".join(p.lines())
    assert 0.50 < two[1].activations / one[1].activations < 0.52
    with pytest.raises(ValueError, match="cp=0"):
        mot.plan_mot("7b-mot", "H200", 8, cp=0)
    with pytest.raises(ValueError, match="exceeds"):
        mot.plan_mot("tiny", "H200", 8, height=32, width=32, cp=8)


def test_a_rollout_sharded_over_tp_holds_a_rank_shard() -> None:
    """`rollout_sharded` (rollout.tp = parallel.tp): the rollout's bf16 copy is a rank's shard at the plan's tp instead
    of the whole model, every rollout rank still receiving every tensor whole per sync; at H800 tp 2 that is what
    makes full fine-tuning of the generation expert fit (80.0 -> 66.8 GiB of 79.6)."""
    whole = {p.tp: p for p in mot.plan_mot("7b-mot", "H800", 8)}
    sharded = {p.tp: p for p in mot.plan_mot("7b-mot", "H800", 8, rollout_sharded=True)}
    assert whole[1].rollout_copy == sharded[1].rollout_copy == whole[1].sync_bytes
    for tp in (2, 4):
        assert sharded[tp].rollout_copy == mot.rank_parameter_counts("7b-mot", tp=tp)[0] * 2
        assert sharded[tp].sync_bytes == whole[tp].sync_bytes == whole[tp].rollout_copy
        assert whole[tp].total - sharded[tp].total == whole[tp].rollout_copy - sharded[tp].rollout_copy > 0
    assert not whole[2].fits and sharded[2].fits
