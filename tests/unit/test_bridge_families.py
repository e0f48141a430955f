"""The bridge plans any family from its bundle's data: the AR-DiT hybrid's three parts (GQA-fused qkv and SwiGLU
gate/up in the decoder) rebuild the torch hybrid's tensors exactly from Megatron shards, in both the piece
(direct) and the gathered (full) path, and cover every parameter of its modules once."""

from __future__ import annotations

import pytest
import torch

from megatron_omni.bridge import CoverageError, PlanError, check_plan
from megatron_omni.bridge.family_sync import family_plans
from megatron_omni.bridge.sync import copy_piece, to_hf
from model_providers import get_family
from model_providers.ar_dit import decoder_mapping as dm
from model_providers.ar_dit.provider import hybrid_config

AR_DIT = get_family("ar_dit")


def _hf_tensors(part, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random Hugging Face tensors of every name of a plan (their shapes from the plan alone)."""
    return {hf: torch.randn(shape, generator=gen) for s in part.sources for hf, shape in zip(s.hf, s.hf_shapes)}


@pytest.mark.parametrize("tp", [1, 2])
def test_decoder_plan_rebuilds_qwen2_tensors_from_gqa_and_swiglu_shards(tp: int) -> None:
    cfg = hybrid_config("tiny").decoder
    n, g = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    assert g < n, "the tiny decoder must exercise GQA"
    plan = family_plans(AR_DIT, "tiny", trainer_tp=tp, rollout_kind="diffusers")["decoder"]
    hf = _hf_tensors(plan, torch.Generator().manual_seed(0))
    maps = {m.megatron: m for m in dm.all_decoder_mappings(cfg["num_hidden_layers"], cfg["tie_word_embeddings"])}
    shards = {s.megatron: [dm.hf_to_megatron_shard(maps[s.megatron], [hf[h] for h in s.hf], n, g, r, tp)
                           for r in range(tp)] for s in plan.sources}
    kinds = {s.kind for s in plan.sources}
    assert kinds == {"copy", "fuse_qkv", "fuse_gate_up"}
    # pieces (what direct mode copies): every Qwen2 tensor rebuilt element for element
    for (name, _), p in plan.params.items():
        got = torch.full(p.shape, float("nan"))
        for pc in p.pieces:
            copy_piece(got, pc, shards[pc.megatron][pc.tp_rank], plan.groups // tp, n // plan.groups)
        assert torch.equal(got, hf[name]), name
    # full mode: the shards concatenated in rank order, split back into Qwen2 names
    for s in plan.sources:
        full = torch.cat(shards[s.megatron], s.tp_dim) if s.tp_dim is not None else shards[s.megatron][0]
        for hf_name, t in to_hf(s, full, plan.num_heads, plan.groups, tp):
            assert torch.equal(t, hf[hf_name]), (s.kind, hf_name)


@pytest.mark.parametrize("tp", [1, 2])
def test_every_part_covers_the_torch_hybrid_once(tp: int) -> None:
    hybrid = AR_DIT.reference_model("tiny")
    modules = {"decoder": hybrid.decoder, "connector": hybrid.connector, "dit": hybrid.dit}
    plans = family_plans(AR_DIT, "tiny", trainer_tp=tp, rollout_kind="diffusers")
    assert sorted(plans) == sorted(modules)
    for part, plan in plans.items():
        check_plan(plan, {(n, 0): tuple(t.shape) for n, t in modules[part].named_parameters()})
    # A tensor the module does not hold, and one the plan never writes, are each named (and only they): the
    # error's whole problem list is checked, so a ledger that named another tensor, or none, fails here.
    decoder = {(n, 0): tuple(t.shape) for n, t in hybrid.decoder.named_parameters()}
    for dropped in ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert (dropped, 0) in decoder, dropped
        with pytest.raises(CoverageError) as err:
            check_plan(plans["decoder"], {k: v for k, v in decoder.items() if k != (dropped, 0)})
        assert str(err.value).splitlines()[1:] == \
            [f"  {dropped} (rollout rank 0): written but the rollout model has no such parameter"], str(err.value)
    with pytest.raises(CoverageError) as err:
        check_plan(plans["decoder"], {**decoder, ("model.extra.weight", 0): (4, 4)})
    assert str(err.value).splitlines()[1:] == ["  model.extra.weight (rollout rank 0): never written"], str(err.value)


def test_parts_without_an_engine_layout_and_families_without_parts_are_refused() -> None:
    with pytest.raises(PlanError, match="no 'vllm_omni' rollout layout"):
        family_plans(AR_DIT, "tiny", trainer_tp=1, rollout_kind="vllm_omni")
    from dataclasses import replace

    with pytest.raises(PlanError, match="declares no weight parts"):
        family_plans(replace(AR_DIT, weight_parts=None), "tiny", trainer_tp=1, rollout_kind="diffusers")


def test_qwen_image_family_plans_its_transformer() -> None:
    plans = family_plans(get_family("qwen_image"), "20b", trainer_tp=2, rollout_kind="vllm_omni", rollout_tp=4)
    assert list(plans) == ["transformer"]
    check_plan(plans["transformer"])



@pytest.mark.parametrize("family,preset,tp", [("sd3", "sd35-medium", 4), ("sd3", "sd35-large", 2),
                                              ("flux", "flux1-dev", 4)])
def test_sd3_and_flux_plan_into_vllm_omni_at_their_published_sizes(family: str, preset: str, tp: int) -> None:
    """The families' vLLM-Omni layouts plan every tensor of the published models (shapes only; SD3.5-L's 38 heads
    split over 2; the tiny models' plans fill vLLM-Omni's real modules in tests/distributed/test_image_vllm_omni.py):
    the fused q/k/v of a block holds its rank's share of the three projections."""
    fam = get_family(family)
    plan = family_plans(fam, preset, trainer_tp=2, rollout_kind="vllm_omni", rollout_tp=tp, mode="full")["transformer"]
    check_plan(plan)
    inner = fam.config(preset)["num_attention_heads"] * fam.config(preset)["attention_head_dim"]
    assert plan.rank_params(0)["transformer_blocks.0.attn.to_qkv.weight"].shape == (3 * inner // tp, inner)
    with pytest.raises(PlanError, match="does not split evenly"):
        family_plans(fam, preset, trainer_tp=1, rollout_kind="vllm_omni", rollout_tp=5)
