"""The Megatron Qwen-Image model equals diffusers' `QwenImageTransformer2DModel` under every parallel layout.

Identical weights go into diffusers' module (tiny config) and into our model; a batch mixing prompt
lengths (padding masks) on a non-square latent grid runs forward and backward through both. The forward
output must match to a relative error under 1e-5, and every diffusers parameter's gradient, rebuilt from
the Megatron shards, under 1e-4.

Gradient reduction is what Megatron-Core's finalize_model_grads + DDP do in training: sum over the
context-parallel group (each CP rank holds part of the image tokens and a replica of the text stream),
sum of the QK-norm grads over tensor parallel (each tp rank normalises its own heads), sum of the
timestep-embedder grads over pipeline stages (it is replicated on every stage).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from megatron_omni.models.dit.model import DiTBatch, pipeline_seq_length
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from model_providers.qwen_image import provider
from tests.unit.parity_schedule import reduced_grads, weighted_backward

GRID = (1, 4, 6)  # frames, height, width in patches: non-square, 24 image tokens
S_TXT = 5
BATCH = 2
N_MICRO = 4


def _reference_model() -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**provider.hf_config("tiny"))
    with torch.no_grad():
        for p in ref.parameters():  # adaLN is zero-initialised by default: use weights that make signal
            p.normal_(0.0, 0.2)
    return ref


def _batches(n: int) -> list[dict[str, torch.Tensor]]:
    cfg = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(1)
    s_img = GRID[0] * GRID[1] * GRID[2]
    out = []
    for i in range(n):
        mask = torch.ones(BATCH, S_TXT, dtype=torch.bool)
        mask[1, 2 + i % 3:] = False  # sample 1 has a shorter prompt
        out.append(dict(
            latents=torch.randn(BATCH, s_img, cfg["in_channels"], generator=g),
            prompt_embeds=torch.randn(BATCH, S_TXT, cfg["joint_attention_dim"], generator=g),
            prompt_mask=mask,
            sigma=torch.rand(BATCH, generator=g),
            weight=torch.randn(BATCH, s_img, cfg["patch_size"] ** 2 * cfg["out_channels"], generator=g),
        ))
    return out


def _reference(batches) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    ref = _reference_model()
    outs = []
    for b in batches:
        out = ref(hidden_states=b["latents"], encoder_hidden_states=b["prompt_embeds"],
                  encoder_hidden_states_mask=b["prompt_mask"], timestep=b["sigma"],
                  img_shapes=[[GRID]] * BATCH).sample
        ((out * b["weight"]).sum() / len(batches)).backward()
        outs.append(out.detach())
    # The last block's text output feeds nothing, so its text projection and MLP get no gradient and its
    # text queries an all-zero one (our model skips them).
    return outs, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None and p.grad.any()}


def _parity(rank: int, world_size: int, layout: ParallelLayout, recompute: str | None) -> dict:
    n_micro = N_MICRO if layout.pp > 1 else 1
    batches = _batches(n_micro)
    ref_outs, ref_grads = _reference(batches)

    groups = build_parallel_groups(layout)
    seed_everything(0, tp_rank=groups.tp.rank())
    overrides = {}
    if recompute == "full":
        overrides = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    elif recompute == "full-all":  # both tiny blocks: the last (text output skipped) is checkpointed too
        overrides = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    elif recompute == "selective":
        overrides = dict(recompute_granularity="selective")
    cfg = provider.transformer_config("tiny", tp=layout.tp, pp=layout.pp, ulysses=layout.ulysses,
                                      ring=layout.ring, batch_p2p_comm=False, **overrides)
    model = provider.build_model(cfg, groups)
    # The direct F.linear path (parallel.linear) runs exactly when the linears are not split.
    from megatron_omni.parallel.linear import ColumnParallelLinear, RowParallelLinear

    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(m.direct == (layout.tp == 1) for m in linears)
    provider.load_hf_state_dict(model, _reference_model().state_dict())
    shard = model.image_shard(GRID[0] * GRID[1] * GRID[2])
    text_mlp_ran: set[int] = set()
    for layer in model.layers:
        layer.txt.linear_fc1.register_forward_hook(lambda *_, n=layer.layer_number: text_mlp_ran.add(n))

    def to_batch(b) -> DiTBatch:
        return DiTBatch(b["latents"], b["prompt_embeds"], b["prompt_mask"], b["sigma"], GRID)

    outs = weighted_backward(model, groups, batches, lambda module, b: module(to_batch(b)),
                             lambda out, b: (out * b["weight"][:, shard]).sum(),
                             pipeline_seq_length(S_TXT, GRID[0] * GRID[1] * GRID[2], layout.cp), BATCH)
    fwd_err = None
    if groups.is_last_stage:
        fwd_err = max(float((o - r[:, shard]).norm() / r[:, shard].norm()) for o, r in zip(outs, ref_outs))
    grads = provider.stage_hf_tensors(model, reduced_grads(model, groups))
    grad_err = {n: float((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30))
                for n, g in grads.items() if n in ref_grads}
    stray = [n for n, g in grads.items() if n not in ref_grads and g.any()]
    expected_params = provider.per_rank_parameter_counts("tiny", layout.tp, layout.pp)[groups.coords["pp"]]
    # Only the model's last block skips its text stream's output (nothing reads it).
    text_skipped = {layer.layer_number for layer in model.layers} - text_mlp_ran
    return {"fwd": fwd_err, "grad": grad_err, "n_ref": len(ref_grads), "stray": stray,
            "text_skipped": (text_skipped, {cfg.num_layers} if groups.is_last_stage else set()),
            "params": (sum(p.numel() for p in model.parameters()), expected_params)}


CASES = [
    pytest.param(2, ParallelLayout(tp=2), None, id="tp2"),
    pytest.param(2, ParallelLayout(ulysses=2), None, id="cp2-ulysses"),
    pytest.param(2, ParallelLayout(ring=2), None, id="cp2-ring"),
    pytest.param(4, ParallelLayout(ulysses=2, ring=2), None, id="cp4-ulysses2xring2"),
    pytest.param(2, ParallelLayout(pp=2), None, id="pp2-4microbatches"),
    pytest.param(4, ParallelLayout(tp=2, pp=2), None, id="tp2xpp2"),
    pytest.param(4, ParallelLayout(tp=2, ulysses=2), None, id="tp2xcp2"),
    pytest.param(2, ParallelLayout(tp=2), "full", id="tp2-full-recompute"),
    pytest.param(2, ParallelLayout(tp=2), "full-all", id="tp2-full-recompute-all-blocks"),
    pytest.param(2, ParallelLayout(ring=2), "selective", id="cp2-ring-selective-recompute"),
]


@pytest.mark.parametrize("world_size,layout,recompute", CASES)
def test_parity_with_diffusers(world_size: int, layout: ParallelLayout, recompute: str | None) -> None:
    results = run_ranks(_parity, world_size, layout, recompute, timeout_s=300)
    fwd = [r["fwd"] for r in results if r["fwd"] is not None]
    assert fwd and max(fwd) < 1e-5, fwd
    covered: set[str] = set()
    for r in results:
        assert not r["stray"], f"nonzero gradients diffusers does not have: {r['stray']}"
        for name, err in r["grad"].items():
            assert err < 1e-4, (name, err)
            covered.add(name)
    assert len(covered) == results[0]["n_ref"], "some diffusers parameters got no gradient to compare"
    for r in results:  # the planner's per-rank counts equal what each rank really holds
        assert r["params"][0] == r["params"][1], r["params"]
        assert r["text_skipped"][0] == r["text_skipped"][1], r["text_skipped"]
