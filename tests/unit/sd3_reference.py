"""The shared SD3.5 parity check: diffusers' `SD3Transformer2DModel` (tiny preset: a dual-attention block, a plain
block, the context-pre-only last block) against our Megatron model with the same weights, forward and backward,
on any tensor-parallel layout. Used in one process (tests/unit) and on spawned gloo ranks (tests/distributed)."""

from __future__ import annotations

import torch
from diffusers import SD3Transformer2DModel

from model_providers.sd3 import provider
from tests.unit.parity_schedule import reduced_grads, weighted_backward

LATENT_HW = (8, 12)  # a non-square 4 x 6 patch grid, centre-cropped from the 12 x 12 sincos table
S_TXT = 5
BATCH = 2


def reference_model(dtype: torch.dtype = torch.float32, config: dict | None = None) -> SD3Transformer2DModel:
    """The tiny diffusers transformer (or `config`), seeded; every parameter N(0, 0.2) (adaLN is zero-initialised by
    default, which would hide the blocks)."""
    torch.manual_seed(0)
    ref = SD3Transformer2DModel(**(config or provider.hf_config("tiny")))
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.2)
    return ref if dtype == torch.float32 else ref.to(dtype)


def batch() -> dict[str, torch.Tensor]:
    """Latents [b, c, H, W], prompt embeddings [b, s, joint], pooled [b, pooled], timesteps [b] (0..1000) and
    a random loss weight on the output."""
    cfg = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(1)
    return dict(
        latents=torch.randn(BATCH, cfg["in_channels"], *LATENT_HW, generator=g),
        prompt_embeds=torch.randn(BATCH, S_TXT, cfg["joint_attention_dim"], generator=g),
        pooled=torch.randn(BATCH, cfg["pooled_projection_dim"], generator=g),
        timestep=torch.rand(BATCH, generator=g) * 1000,
        weight=torch.randn(BATCH, cfg["out_channels"], *LATENT_HW, generator=g),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def parity(groups, dtype: torch.dtype = torch.float32) -> dict:
    """Run both models on `batch()` (forward, then backward of the weighted sum); return the forward's max abs
    and relative error, the relative error of every diffusers parameter's gradient rebuilt from this rank's
    shards, the names of nonzero gradients diffusers lacks, and the load -> export round trip's mismatches."""
    from megatron_omni.models.dit.sd3_model import SD3Batch
    from megatron_omni.parallel.platform import seed_everything

    b = batch()
    ref = reference_model(dtype)
    ref_out = ref(hidden_states=b["latents"].to(dtype), encoder_hidden_states=b["prompt_embeds"].to(dtype),
                  pooled_projections=b["pooled"].to(dtype), timestep=b["timestep"]).sample
    (ref_out.float() * b["weight"]).sum().backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None and p.grad.any()}

    seed_everything(0, tp_rank=groups.tp.rank())
    model = provider.build_model(provider.transformer_config("tiny", tp=groups.layout.tp, params_dtype=dtype), groups)
    return compare(groups, provider, model, reference_model(dtype).state_dict(),
                   lambda: model(SD3Batch(b["latents"], b["prompt_embeds"], b["pooled"], b["timestep"])), b["weight"],
                   ref_out, ref_grads)


def compare(groups, provider, model, ref_state: dict, run, weight: torch.Tensor, ref_out: torch.Tensor,
            ref_grads: dict) -> dict:
    """The Megatron side of a parity check against a diffusers reference that has run (`ref_out`, `ref_grads`):
    load `ref_state` into `model` through `provider` (a family provider module), export it back, run `run()` and the
    backward of its output weighted by `weight`; the result dict `check` reads."""
    provider.load_hf_state_dict(model, ref_state)
    exported = provider.stage_hf_tensors(model)
    round_trip = sorted(set(ref_state) ^ set(exported)) + [
        n for n in ref_state if n in exported and not (ref_state[n].dtype == exported[n].dtype
                                                       and torch.equal(ref_state[n], exported[n]))]

    out = run()
    (out.float() * weight).sum().backward()
    grads = reduced_grads(model, groups)
    hf_grads = provider.stage_hf_tensors(model, grads)
    return {
        "shape": (tuple(out.shape), tuple(ref_out.shape)),
        "fwd_abs": float((out.detach().float() - ref_out.detach().float()).abs().max()),
        "fwd_rel": _rel(out.detach(), ref_out.detach()),
        "grad": {n: _rel(g, ref_grads[n]) for n, g in hf_grads.items() if n in ref_grads},
        "n_ref_grads": len(ref_grads),
        "stray": [n for n, g in hf_grads.items() if n not in ref_grads and g.any()],
        "round_trip": round_trip,
    }


def check(result: dict, fwd_rel: float = 1e-5, grad_rel: float = 1e-4) -> None:
    """Assert a `parity` result: output shapes equal, forward and every gradient within the bounds, every
    diffusers gradient covered, no stray gradient, a bit-exact load -> export round trip."""
    assert result["shape"][0] == result["shape"][1], result["shape"]
    assert result["fwd_rel"] < fwd_rel, result["fwd_rel"]
    assert not result["stray"], f"nonzero gradients diffusers does not have: {result['stray']}"
    assert len(result["grad"]) == result["n_ref_grads"], "some diffusers parameters got no gradient to compare"
    worst = max(result["grad"].items(), key=lambda kv: kv[1])
    assert worst[1] < grad_rel, worst
    assert not result["round_trip"], f"load -> export is not bit-exact for {result['round_trip']}"


def tp2_parity(rank: int, world_size: int, reference: str) -> dict:
    """A rank task: the tp 2 parity of the reference module `tests.unit.<reference>` (`parity`), fp32 and bf16."""
    import importlib

    from megatron_omni.parallel import ParallelLayout, build_parallel_groups

    groups = build_parallel_groups(ParallelLayout(tp=2))
    mod = importlib.import_module(f"tests.unit.{reference}")
    return {dtype: mod.parity(groups, dtype) for dtype in (torch.float32, torch.bfloat16)}


def check_tp2(results: list[dict], family: str, bf16_fwd_rel: float, bf16_grad_rel: float) -> None:
    """Print and assert the ranks' `tp2_parity` results: fp32 within `check`'s defaults, bf16 within the family's
    measured bounds."""
    for r in results:
        fp32, bf16 = r[torch.float32], r[torch.bfloat16]
        print(f"{family} tp2: fp32 max abs {fp32['fwd_abs']:.3g}, rel {fp32['fwd_rel']:.3g}, worst grad rel "
              f"{max(fp32['grad'].values()):.3g}; bf16 max abs "
              f"{bf16['fwd_abs']:.3g}, rel {bf16['fwd_rel']:.3g}, worst grad rel {max(bf16['grad'].values()):.3g}")
        check(fp32)
        check(bf16, fwd_rel=bf16_fwd_rel, grad_rel=bf16_grad_rel)


def parity_layout(groups, provider, model, ref_state: dict, make_batch, weight: torch.Tensor, ref_out: torch.Tensor,
                  ref_grads: dict, s_txt: int, s_img: int, n_micro: int = 2) -> dict:
    """The Megatron side of a parity check under context or pipeline parallelism, on packed tokens: load `ref_state`,
    export it back (this stage's tensors), run `make_batch()` (a `DiTBatch`) forward and backward of the output
    weighted by this CP rank's shard of `weight` [b, s_img, c] -- at pp > 1 through Megatron-Core's 1F1B schedule
    (`get_forward_backward_func`, as `trainer.pipeline_step` runs it) over `n_micro` copies of the batch, whose
    averaged loss has the single batch's gradient -- and reduce the gradients as finalize_model_grads does in
    training (sum over cp, over tp for the replicated QK norms, over pp for the embedders every stage holds).
    `ref_out` [b, s_img, c]: diffusers' packed output. The result dict `check_layout` reads (one per rank)."""
    from megatron_omni.models.dit.model import pipeline_seq_length

    provider.load_hf_state_dict(model, ref_state)
    exported = provider.stage_hf_tensors(model)
    mismatched = [n for n, t in exported.items() if not (n in ref_state and ref_state[n].dtype == t.dtype
                                                        and torch.equal(ref_state[n], t))]
    shard = model.image_shard(s_img)
    outs = weighted_backward(model, groups, [make_batch() for _ in range(n_micro if groups.layout.pp > 1 else 1)],
                             lambda module, b: module(b), lambda out, b: (out.float() * weight[:, shard]).sum(),
                             pipeline_seq_length(s_txt, s_img, groups.layout.cp), weight.shape[0])
    grads = reduced_grads(model, groups)
    hf_grads = provider.stage_hf_tensors(model, grads)
    ref = ref_out[:, shard].detach().float()
    fwd = [o.float() for o in outs] if groups.is_last_stage else []
    return {
        "fwd_abs": max((float((o - ref).abs().max()) for o in fwd), default=None),
        "fwd_rel": max((_rel(o, ref) for o in fwd), default=None),
        "grad": {n: _rel(g, ref_grads[n]) for n, g in hf_grads.items() if n in ref_grads},
        "ref_grads": sorted(ref_grads),
        "stray": [n for n, g in hf_grads.items() if n not in ref_grads and g.any()],
        "exported": sorted(exported),
        "ref_state": sorted(ref_state),
        "mismatched": mismatched,
        "params": sum(p.numel() for p in model.parameters()),
        "stage": groups.coords["pp"],
    }


def check_layout(results: list[dict], fwd_rel: float = 1e-5, grad_rel: float = 1e-4) -> dict:
    """Assert the ranks' `parity_layout` results together: the last stage's forward within `fwd_rel` on every CP
    rank, every diffusers gradient covered by some rank and within `grad_rel` wherever computed, no stray gradient,
    every tensor exported by some stage bit-exact. Returns the worst figures (fwd_abs, fwd_rel, grad name and rel)."""
    fwd = [r for r in results if r["fwd_rel"] is not None]
    assert fwd, "no rank returned the model's output"
    worst_fwd = max(r["fwd_rel"] for r in fwd)
    assert worst_fwd < fwd_rel, worst_fwd
    grads: dict[str, float] = {}
    for r in results:
        assert not r["stray"], f"nonzero gradients diffusers does not have: {r['stray']}"
        assert not r["mismatched"], f"load -> export is not bit-exact for {r['mismatched']}"
        for n, e in r["grad"].items():
            grads[n] = max(e, grads.get(n, 0.0))
    missing = set(results[0]["ref_grads"]) - set(grads)
    assert not missing, f"diffusers parameters no rank got a gradient for: {sorted(missing)}"
    assert set().union(*(r["exported"] for r in results)) == set(results[0]["ref_state"])
    worst = max(grads.items(), key=lambda kv: kv[1])
    assert worst[1] < grad_rel, worst
    return {"fwd_abs": max(r["fwd_abs"] for r in fwd), "fwd_rel": worst_fwd, "grad": worst}
