"""The Megatron Wan model equals diffusers' `WanTransformer3DModel` under every parallel layout.

Identical weights go into diffusers' module (tiny config) and into our model. Each layout runs three inputs of
different frame counts on non-square frames (grids (1, 4, 6), (3, 2, 4), (5, 2, 2) patches), each a batch whose
prompts have different lengths, zero-padded as Wan's pipeline pads them (to 5, 9 and 3 text tokens), forward
and backward through both; the 3-frame input takes Wan2.2-TI2V's per-token timesteps (its first frame's 8 tokens
at t = 0, which CP=4 splits over two shards). The forward output must match to a relative error under 1e-5, and
every diffusers parameter's gradient (accumulated over the three inputs), rebuilt from the Megatron shards, under
1e-4.

Gradient reduction is what Megatron-Core's DDP + finalize_model_grads do in training: sum over the
context-parallel group (each CP rank holds part of the video tokens and a replica of the text), sum of the
timestep embedder's and projection's grads over pipeline stages (replicated on every stage). Nothing is summed
over tensor parallelism: the across-heads q/k norm weights are split with their heads.

One task call per world size runs all of its layouts (the ranks build each layout's groups in turn).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from megatron_omni.models.dit.embeddings import patchify_video
from megatron_omni.models.dit.model import DiTBatch, pipeline_seq_length
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from model_providers.wan import provider
from tests.unit.parity_schedule import reduced_grads, weighted_backward

PATCH = (1, 2, 2)
INPUTS = [((1, 4, 6), 5), ((3, 2, 4), 9), ((5, 2, 2), 3)]  # (patch grid (frames, height, width), text tokens)
BATCH = 2
N_MICRO = 2  # micro-batches per input under pipeline parallelism


def _reference_model() -> WanTransformer3DModel:
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**provider.hf_config("tiny"))
    with torch.no_grad():
        for p in ref.parameters():  # norms start at one and zero: weights that make signal everywhere
            p.normal_(0.0, 0.2)
    return ref


def _batches() -> list[list[dict[str, torch.Tensor]]]:
    """Per input, N_MICRO micro-batches: video [b, c, F, H, W], zero-padded text, sigma, a loss weight."""
    cfg = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(1)
    out = []
    for (f, h, w), s_txt in INPUTS:
        micro = []
        for i in range(N_MICRO):
            text = torch.randn(BATCH, s_txt, cfg["text_dim"], generator=g)
            text[1, 1 + i % (s_txt - 1):] = 0  # sample 1 has a shorter prompt, padded with zeros
            video = torch.randn(BATCH, cfg["in_channels"], f * PATCH[0], h * PATCH[1], w * PATCH[2], generator=g)
            sigma = torch.rand(BATCH, generator=g)
            if f == 3:  # Wan2.2-TI2V's per-token timesteps: the image-conditioned first frame at 0 (across CP shards)
                sigma = sigma[:, None].repeat(1, f * h * w)
                sigma[:, : h * w] = 0
            micro.append(dict(
                video=video,
                text=text,
                sigma=sigma,
                weight=torch.randn(BATCH, f * h * w, cfg["out_channels"] * 4, generator=g),
            ))
        out.append(micro)
    return out


def _reference(batches, n_micro: int) -> tuple[list[list[torch.Tensor]], dict[str, torch.Tensor]]:
    """diffusers' outputs (packed like ours) per input and micro-batch, and its accumulated grads."""
    ref = _reference_model()
    outs = []
    for micro in batches:
        outs.append([])
        for b in micro[:n_micro]:
            video = ref(hidden_states=b["video"], timestep=b["sigma"] * 1000, encoder_hidden_states=b["text"],
                        return_dict=False)[0]
            out = patchify_video(video, PATCH)
            ((out * b["weight"]).sum() / n_micro).backward()
            outs[-1].append(out.detach())
    return outs, {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}


def _layout_case(layout: ParallelLayout, recompute: str | None, batches, references: dict) -> dict:
    n_micro = N_MICRO if layout.pp > 1 else 1
    if n_micro not in references:  # the same for every layout with this many micro-batches
        references[n_micro] = _reference(batches, n_micro)
    ref_outs, ref_grads = references[n_micro]
    groups = build_parallel_groups(layout)
    seed_everything(0, tp_rank=groups.tp.rank())
    overrides = {}
    if recompute == "full":
        overrides = dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)
    elif recompute == "selective":
        overrides = dict(recompute_granularity="selective")
    cfg = provider.transformer_config("tiny", tp=layout.tp, pp=layout.pp, ulysses=layout.ulysses, ring=layout.ring,
                                      batch_p2p_comm=False, **overrides)
    model = provider.build_model(cfg, groups)
    provider.load_hf_state_dict(model, _reference_model().state_dict())

    fwd_err = []
    for ((grid, s_txt), micro, refs) in zip(INPUTS, batches, ref_outs, strict=True):
        shard = model.image_shard(grid[0] * grid[1] * grid[2])

        def to_batch(b, grid=grid) -> DiTBatch:
            return DiTBatch(patchify_video(b["video"], PATCH), b["text"], None, b["sigma"], grid)

        outs = weighted_backward(model, groups, micro[:n_micro], lambda module, b, f=to_batch: module(f(b)),
                                 lambda out, b, shard=shard: (out * b["weight"][:, shard]).sum(),
                                 pipeline_seq_length(s_txt, grid[0] * grid[1] * grid[2], layout.cp), BATCH)
        if groups.is_last_stage:
            fwd_err += [float((o - r[:, shard]).norm() / r[:, shard].norm()) for o, r in zip(outs, refs, strict=True)]
    grads = provider.stage_hf_tensors(model, reduced_grads(model, groups, tp_replicated=()))
    grad_err = {n: float((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30))
                for n, g in grads.items() if n in ref_grads}
    stray = [n for n in grads if n not in ref_grads]
    expected = provider.per_rank_parameter_counts("tiny", layout.tp, layout.pp)[groups.coords["pp"]]
    return {"fwd": fwd_err, "grad": grad_err, "n_ref": len(ref_grads), "stray": stray,
            "params": (sum(p.numel() for p in model.parameters()), expected)}


def _parity(rank: int, world_size: int, cases: list[tuple[str, ParallelLayout, str | None]]) -> dict:
    batches, references = _batches(), {}
    return {name: _layout_case(layout, recompute, batches, references) for name, layout, recompute in cases}


CASES = {
    2: [("tp2", ParallelLayout(tp=2), None),
        ("cp2-ulysses", ParallelLayout(ulysses=2), None),
        ("cp2-ring", ParallelLayout(ring=2), None),
        ("pp2", ParallelLayout(pp=2), None),
        ("tp2-full-recompute", ParallelLayout(tp=2), "full"),
        ("cp2-ring-selective-recompute", ParallelLayout(ring=2), "selective")],
    4: [("cp4-ulysses2xring2", ParallelLayout(ulysses=2, ring=2), None),
        ("tp2xpp2", ParallelLayout(tp=2, pp=2), None),
        ("tp2xcp2-ulysses", ParallelLayout(tp=2, ulysses=2), None)],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_parity_with_diffusers(world_size: int) -> None:
    results = run_ranks(_parity, world_size, CASES[world_size], timeout_s=600)
    for name, _, _ in CASES[world_size]:
        per_rank = [r[name] for r in results]
        fwd = [e for r in per_rank for e in r["fwd"]]
        print(f"{name}: max forward error {max(fwd):.2e}, max gradient error "
              f"{max(e for r in per_rank for e in r['grad'].values()):.2e}")
        assert len(fwd) >= len(INPUTS) and max(fwd) < 1e-5, (name, fwd)
        covered: set[str] = set()
        for r in per_rank:
            assert not r["stray"], (name, f"gradients diffusers does not have: {r['stray']}")
            for param, err in r["grad"].items():
                assert err < 1e-4, (name, param, err)
                covered.add(param)
            assert r["params"][0] == r["params"][1], (name, r["params"])  # the planner's per-rank counts
        assert len(covered) == per_rank[0]["n_ref"], (name, "some diffusers parameters got no gradient to compare")
