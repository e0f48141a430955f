"""The sync planner on the real 20b shapes: every rollout element written once, sizes exact, bad plans refused."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_omni.bridge import CoverageError, CoverageLedger, PlanError, Region, check_plan
from megatron_omni.bridge.qwen_image import qwen_image_plan
from megatron_omni.bridge.sync import copy_piece, to_hf
from model_providers.qwen_image import provider
from model_providers.qwen_image.mapping import all_mappings, tp_shard
from model_providers.qwen_image.presets import PARAMS_20B

TPS = (1, 2, 4, 8)
H, HEADS, FFN = 3072, 24, 4 * 3072


def _vllm_rank_numel(R: int) -> int:
    """Parameters one vLLM-Omni rank holds at tp=R, counted from the module layout by hand."""
    non_block = H * 256 + H + H * H + H + 64 * H + H + 3584 + 3584 * H + H + 2 * H * H + 2 * H + 64 * H + 64
    per_stream = (
        6 * H * H + 6 * H  # adaLN, replicated
        + (3 * H * H + 3 * H) // R  # fused qkv, column
        + H * H // R + H  # out projection: row weight, whole bias
        + (FFN * H + FFN) // R + H * FFN // R + H  # MLP column then row
    )
    return non_block + 60 * (2 * per_stream + 4 * 128)


@pytest.mark.parametrize("trainer_tp", TPS)
@pytest.mark.parametrize("rollout_tp", TPS)
def test_20b_plan_covers_every_element_once(trainer_tp: int, rollout_tp: int) -> None:
    plan = qwen_image_plan("20b", trainer_tp=trainer_tp, rollout_tp=rollout_tp)
    check_plan(plan)
    per_rank = plan.numel_per_rollout_rank()
    assert per_rank == [_vllm_rank_numel(rollout_tp)] * rollout_tp
    assert sum(s.full_numel for s in plan.sources) == PARAMS_20B  # full mode moves every parameter once
    assert sum(s.local_numel for s in plan.sources) == provider.per_rank_parameter_counts("20b", trainer_tp)[0]
    ranks = {r for (_, r) in plan.params}
    assert ranks == set(range(rollout_tp))
    for p in plan.params.values():  # pieces only read shards that exist
        for pc in p.pieces:
            assert 0 <= pc.tp_rank < trainer_tp and pc.dst_rank == p.rank


@pytest.mark.parametrize("tp", TPS)
def test_20b_direct_plan_is_local_except_adaln(tp: int) -> None:
    plan = qwen_image_plan("20b", trainer_tp=tp, rollout_tp=tp, mode="direct")
    check_plan(plan)
    adaln = 60 * 2 * (6 * H * H + 6 * H)
    for r in range(tp):
        local, remote = plan.local_numel(r)
        assert local + remote == _vllm_rank_numel(tp)
        assert remote == adaln * (tp - 1) // tp  # vLLM-Omni replicates adaLN, Megatron shards it
    remote_names = {s.megatron.rsplit(".", 2)[-2] for s in plan.remote_sources()}
    assert remote_names == (set() if tp == 1 else {"adaln"})


@pytest.mark.parametrize("trainer_tp", TPS)
def test_20b_diffusers_plan(trainer_tp: int) -> None:
    plan = qwen_image_plan("20b", trainer_tp=trainer_tp, rollout_kind="diffusers")
    check_plan(plan)
    assert plan.numel_per_rollout_rank() == [PARAMS_20B]
    assert len(plan.params) == sum(len(m.hf) for m in all_mappings(60))  # one parameter per diffusers tensor


def test_bad_plans_are_refused_with_the_reason() -> None:
    with pytest.raises(PlanError, match="heads over rollout tp"):
        qwen_image_plan("20b", trainer_tp=1, rollout_tp=16)
    with pytest.raises(PlanError, match="trainer tp == rollout tp"):
        qwen_image_plan("20b", trainer_tp=2, rollout_tp=4, mode="direct")
    with pytest.raises(PlanError, match="supports tp <= 1"):
        qwen_image_plan("tiny", trainer_tp=2, rollout_kind="diffusers", rollout_tp=2)
    bad = [m for m in all_mappings(2)]
    bad[20] = type(bad[20])(bad[20].megatron, ("transformer_blocks.0.attn.to_qq.weight",), "copy", 0, 0, "block")
    with pytest.raises(PlanError, match="to_qq"):
        qwen_image_plan("tiny", trainer_tp=1, mappings=bad)


def test_plan_check_names_the_broken_parameter() -> None:
    maps = [m for m in all_mappings(2) if m.megatron != "layers.0.img.linear_fc1.bias"]
    plan = qwen_image_plan("tiny", trainer_tp=2, rollout_tp=2, mappings=maps)
    full = qwen_image_plan("tiny", trainer_tp=2, rollout_tp=2)
    with pytest.raises(CoverageError, match=r"transformer_blocks\.0\.img_mlp\.net\.0\.proj\.bias \(rollout rank 1\)"
                                            r": never written"):
        check_plan(plan, {k: p.shape for k, p in full.params.items()})


def test_ledger_reports_gaps_overlaps_and_strangers() -> None:
    ledger = CoverageLedger({"a": (8, 4), "b": (6,), "c": (2, 2)})
    ledger.record("a", Region(0, 0, 4))
    ledger.record("a", Region(0, 3, 6))
    ledger.record("b", Region(None))
    ledger.record("zzz", Region(None))
    problems = "\n".join(ledger.problems())
    assert "a: elements [3, 4) along dim 0 written more than once" in problems
    assert "a: elements [6, 8) along dim 0 never written" in problems
    assert "c: never written" in problems
    assert "zzz: written but the rollout model has no such parameter" in problems
    assert "b:" not in problems
    with pytest.raises(CoverageError, match="4 problems"):
        ledger.check()


@pytest.mark.parametrize("trainer_tp,rollout_tp", [(1, 2), (2, 1), (2, 4), (4, 2), (2, 2)])
def test_pieces_rebuild_vllm_layout_from_shards(trainer_tp: int, rollout_tp: int) -> None:
    """Executing the plan's pieces on real tensors gives vLLM-Omni's per-rank layout ([Q_r; K_r; V_r] etc.)."""
    plan = qwen_image_plan("tiny", trainer_tp=trainer_tp, rollout_tp=rollout_tp)
    heads = provider.hf_config("tiny")["num_attention_heads"]
    g = torch.Generator().manual_seed(0)
    full = {s.megatron: torch.randn(s.full_shape, generator=g) for s in plan.sources}
    hf = {n: t for s in plan.sources for n, t in to_hf(s, full[s.megatron], heads)}
    by_name = {s.megatron: s for s in plan.sources}
    for (name, r), p in plan.params.items():
        got = torch.full(p.shape, float("nan"))
        for pc in p.pieces:
            shard = tp_shard(full[pc.megatron], by_name[pc.megatron].tp_dim, pc.tp_rank, trainer_tp)
            copy_piece(got, pc, shard, heads // trainer_tp)
        block, rest = (name.split(".", 2)[1], name.split(".", 2)[2]) if name.startswith("transformer_") else (
            None, name)
        pre = f"transformer_blocks.{block}." if block is not None else ""
        if rest.startswith(("attn.to_qkv", "attn.add_kv_proj")):
            kind = rest.rsplit(".", 1)[1]
            parts = (("attn.to_q", "attn.to_k", "attn.to_v") if rest.startswith("attn.to_qkv")
                     else ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"))
            want = torch.cat([hf[f"{pre}{q}.{kind}"].chunk(rollout_tp)[r] for q in parts])
        elif rest in ("attn.to_out.weight", "attn.to_add_out.weight") or rest.endswith("net.2.weight"):
            key = f"{pre}{rest.replace('to_out.', 'to_out.0.')}"
            want = hf[key].chunk(rollout_tp, dim=1)[r]
        elif "net.0.proj" in rest:
            want = hf[f"{pre}{rest}"].chunk(rollout_tp)[r]
        else:
            want = hf[f"{pre}{rest.replace('to_out.', 'to_out.0.')}"]
        assert torch.equal(got, want), (name, r)
        assert math.prod(p.shape) == sum(pc.numel for pc in p.pieces)
