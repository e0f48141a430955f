"""The Megatron FLUX.1 model equals diffusers' `FluxTransformer2DModel` at tp=2 on spawned gloo ranks (fp32):
forward, every gradient rebuilt from both ranks' shards, and a bit-exact load -> export round trip; the bf16 forward
bit for bit, its gradients within the measured bound (the same check as tests/unit/test_flux_parity.py at tp=1,
`tests.unit.flux_reference`)."""

from __future__ import annotations

import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.rank_pool import run_ranks
from tests.unit import flux_reference, sd3_reference

# bf16 gradients at tp=2: measured worst 1.3e-2 (the forward is bit-exact: every split linear sums its fp32
# partial sums once, `parallel.linear`, and the single block's output projection sums all its inputs on one rank).
BF16_GRAD_REL = 3e-2
# CP 2 and PP 2 (`_layout_parity`). PP runs tiny variants whose double -> single transition falls inside the first
# stage (1 double + 3 single blocks: stage 0 = double 0 + single 0) and, in fp32, at the stage boundary (the tiny
# preset's 2 + 2).
LAYOUTS = {"cp2-ulysses": (ParallelLayout(ulysses=2), None), "cp2-ring": (ParallelLayout(ring=2), None),
           "pp2": (ParallelLayout(pp=2), dict(num_layers=1, num_single_layers=3)),
           "pp2-boundary": (ParallelLayout(pp=2), {})}
# bf16 (forward rel, gradient rel) bounds per layout, from the measured figures (docs/families-flux.md).
BF16_LAYOUT = {"cp2-ulysses": (1e-30, 3e-2), "cp2-ring": (2e-2, 1e-1), "pp2": (1e-30, 3e-2)}


def test_tp2_parity_with_diffusers() -> None:
    results = run_ranks(sd3_reference.tp2_parity, 2, "flux_reference", timeout_s=300)
    sd3_reference.check_tp2(results, "flux", 1e-30, BF16_GRAD_REL)
    assert all(r[torch.bfloat16]["fwd_abs"] == 0.0 for r in results)  # bf16 bit for bit


def _layout_parity(rank: int, world_size: int) -> dict:
    """CP 2 (Ulysses, ring) and PP 2 on one pool's two ranks (fp32 and bf16; the boundary variant in fp32), plus each
    rank's parameter count against the planner's for its stage."""
    from megatron_omni.models.dit.flux_interface import flux_image_ids
    from megatron_omni.models.dit.model import DiTBatch
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.planner.arch import dit_arch
    from megatron_omni.planner.memory import rank_parameter_counts
    from model_providers.flux import provider

    b = flux_reference.batch()
    grid = (1, *flux_reference.GRID)
    s_img = grid[1] * grid[2]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for name, (layout, blocks) in LAYOUTS.items():
            if dtype == torch.bfloat16 and name not in BF16_LAYOUT:
                continue
            hf = dict(provider.hf_config("tiny"), **(blocks or {}))
            ref = flux_reference.reference_model(dtype, hf)
            ref_out = ref(hidden_states=b["latents"].to(dtype), encoder_hidden_states=b["prompt_embeds"].to(dtype),
                          pooled_projections=b["pooled"].to(dtype), timestep=b["sigma"].to(dtype),
                          img_ids=flux_image_ids(*flux_reference.GRID), txt_ids=torch.zeros(flux_reference.S_TXT, 3),
                          guidance=b["guidance"], return_dict=False)[0]
            (ref_out.float() * b["weight"]).sum().backward()
            ref_grads = {n: q.grad for n, q in ref.named_parameters() if q.grad is not None and q.grad.any()}
            groups = build_parallel_groups(layout)
            seed_everything(0, tp_rank=groups.tp.rank())
            cfg = provider.transformer_config(hf, pp=layout.pp, ulysses=layout.ulysses, ring=layout.ring,
                                              params_dtype=dtype, batch_p2p_comm=False)
            model = provider.build_model(cfg, groups)

            def make_batch():
                return DiTBatch(b["latents"], b["prompt_embeds"], None, b["sigma"], grid, pooled=b["pooled"],
                                guidance=b["guidance"])

            state = flux_reference.reference_model(dtype, hf).state_dict()
            r = sd3_reference.parity_layout(groups, provider, model, state, make_batch, b["weight"], ref_out, ref_grads,
                                            flux_reference.S_TXT, s_img)
            r["planned_params"] = rank_parameter_counts(dit_arch("flux", hf), 1, layout.pp)[r["stage"]]
            r["blocks"] = (len(model.layers), len(model.single_layers))
            if layout.pp > 1:  # the trainer counts the embedders every stage holds once in the grad norm
                from megatron_omni.trainer.flowgrpo import _count_stage_replicas_once

                _count_stage_replicas_once(model, groups)
                r["shared"] = sorted(n for n, q in model.named_parameters() if getattr(q, "shared", False))
            out[(name, dtype)] = r
    return out


def test_cp2_and_pp2_parity_with_diffusers() -> None:
    results = run_ranks(_layout_parity, 2, timeout_s=300)
    for key in results[0]:
        name, dtype = key
        per_rank = [r[key] for r in results]
        for r in per_rank:
            assert r["params"] == r["planned_params"], (name, r["params"], r["planned_params"])
        if name == "pp2":  # the transition inside stage 0: a double and a single block there, two singles after
            assert [r["blocks"] for r in per_rank] == [(1, 1), (0, 2)], [r["blocks"] for r in per_rank]
        if name.startswith("pp2"):  # stage 1's time, guidance and pooled embedders (2 linears each, w and b)
            assert per_rank[0]["shared"] == [], per_rank[0]["shared"]
            assert len(per_rank[1]["shared"]) == 12 and all(n.startswith(("time_embedder.", "guidance_embedder.",
                                                                             "pooled_embedder."))
                                                            for n in per_rank[1]["shared"]), per_rank[1]["shared"]
        if name == "pp2-boundary":
            assert [r["blocks"] for r in per_rank] == [(2, 0), (0, 2)], [r["blocks"] for r in per_rank]
        fp32 = dtype == torch.float32
        worst = sd3_reference.check_layout(per_rank, *((1e-5, 1e-4) if fp32 else BF16_LAYOUT[name]))
        print(f"flux {name} {'fp32' if fp32 else 'bf16'}: max abs {worst['fwd_abs']:.3g}, rel {worst['fwd_rel']:.3g}, "
              f"worst grad rel {worst['grad'][1]:.3g} ({worst['grad'][0]})")
