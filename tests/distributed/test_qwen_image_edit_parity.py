"""Qwen-Image-Edit's image stream in our Megatron MMDiT equals diffusers' `QwenImageTransformer2DModel` fed as
`QwenImageEditPlusPipeline` feeds it: the generated latent's tokens followed by one or two source images'
tokens (`hidden_states = cat([latents, image_latents], 1)`, `img_shapes = [[grid, *source grids]] * b`), a
batch mixing prompt lengths.

fp32: forward (all tokens, sources included) under 1e-5 relative error, every gradient of a loss on the
generated tokens (what the pipeline keeps: `noise_pred[:, :s]`) under 1e-4, at TP 1 (two data-parallel ranks),
TP 2 and CP 2 (Ulysses and ring). Under CP the whole stream `[generated | source 1 | source 2]` splits into
contiguous shards, so a shard may hold the end of the generated tokens and the start of a source's (the grids
below make both ranks straddle a boundary). bf16 at TP 1 and TP 2: the forward's relative error against
diffusers in bf16 is printed and bounded. PP 2 with two sources: Megatron-Core's 1F1B schedule over two
micro-batches carries the whole stream `[generated | sources]` + text between the stages (the `DiTBatch` with its
`cond_grids` on both stages), forward and every gradient against diffusers; in bf16 the forward (measured 0: the
stages pass the bf16 stream diffusers holds between the same blocks, so nothing is rounded twice).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from diffusers import QwenImageTransformer2DModel

from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from model_providers.qwen_image import provider

GRID = (1, 4, 6)  # the generated latent: 24 tokens
SOURCES = {1: ((1, 4, 4),), 2: ((1, 4, 4), (1, 2, 6))}  # 16 (+ 12) source tokens: 40 or 52 in all
S_TXT = 5
BATCH = 2


def _config(zero_cond_t: bool) -> dict:
    return {**provider.hf_config("tiny"), **({"zero_cond_t": True} if zero_cond_t else {})}


def _reference_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**provider.hf_config("tiny"))
    with torch.no_grad():
        for p in ref.parameters():  # adaLN is zero-initialised by default: use weights that make signal
            p.normal_(0.0, 0.2)
    return ref.state_dict()


def _reference(dtype: torch.dtype, zero_cond_t: bool = False) -> QwenImageTransformer2DModel:
    ref = QwenImageTransformer2DModel(**_config(zero_cond_t))
    ref.load_state_dict(_reference_state())
    return ref.to(dtype)


def _batch(n_sources: int, seed: int | None = None) -> dict:
    cfg = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(n_sources if seed is None else seed)
    grids = (GRID, *SOURCES[n_sources])
    s_all = sum(f * h * w for f, h, w in grids)
    s_gen = GRID[0] * GRID[1] * GRID[2]
    mask = torch.ones(BATCH, S_TXT, dtype=torch.long)
    mask[1, 3:] = 0  # sample 1 has a shorter prompt
    weight = torch.randn(BATCH, s_all, cfg["patch_size"] ** 2 * cfg["out_channels"], generator=g)
    weight[:, s_gen:] = 0  # the pipeline keeps only the generated tokens' velocity
    return dict(hidden_states=torch.randn(BATCH, s_all, cfg["in_channels"], generator=g),
                encoder_hidden_states=torch.randn(BATCH, S_TXT, cfg["joint_attention_dim"], generator=g),
                encoder_hidden_states_mask=mask, timestep=torch.rand(BATCH, generator=g),
                img_shapes=[list(grids)] * BATCH, weight=weight)


def _run(model, b: dict, dtype: torch.dtype, grad: bool) -> torch.Tensor:
    inputs = {k: (v.to(dtype) if k in ("hidden_states", "encoder_hidden_states", "timestep") else v)
              for k, v in b.items() if k != "weight"}
    out = model(**inputs, return_dict=False)[0]
    if grad:
        (out.float() * b["weight"]).sum().backward()
    return out.detach().float()


def _edit_parity(rank: int, world_size: int, layout: ParallelLayout, n_sources: int, dtypes: tuple,
                 zero_cond_t: bool = False) -> dict:
    b = _batch(n_sources)
    groups = build_parallel_groups(layout)
    seed_everything(0, tp_rank=groups.tp.rank())
    result = {}
    for dtype in dtypes:
        fp32 = dtype == torch.float32
        ref = _reference(dtype, zero_cond_t)
        ref_out = _run(ref, b, dtype, grad=fp32)
        cfg = provider.transformer_config(_config(zero_cond_t), tp=layout.tp, ulysses=layout.ulysses,
                                          ring=layout.ring, params_dtype=dtype)
        model = provider.build_model(cfg, groups)
        provider.load_hf_state_dict(model, {k: v.to(dtype) for k, v in _reference_state().items()})
        out = _run(DiffusersForward(model), b, dtype, grad=fp32)
        entry = {"fwd": float((out - ref_out).norm() / ref_out.norm())}
        if fp32:
            grads = {}
            for name, p in model.named_parameters():
                if p.grad is None:  # the last block's text output feeds nothing (diffusers' gets no gradient)
                    continue
                g = p.grad.clone()
                if layout.cp > 1:
                    dist.all_reduce(g, group=groups.cp)
                if layout.tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
                    dist.all_reduce(g, group=groups.tp)
                grads[name] = g
            hf = provider.stage_hf_tensors(model, grads)
            ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None and p.grad.any()}
            entry["grad"] = {n: float((hf[n] - g).norm() / g.norm()) for n, g in ref_grads.items()}
            entry["n_ref"] = len(ref_grads)
        result[str(dtype)] = entry
    return result


CASES = [
    pytest.param(ParallelLayout(), 1, (torch.float32, torch.bfloat16), False, id="tp1-one-source"),
    pytest.param(ParallelLayout(tp=2), 2, (torch.float32, torch.bfloat16), False, id="tp2-two-sources"),
    pytest.param(ParallelLayout(ulysses=2), 2, (torch.float32,), False, id="cp2-ulysses-two-sources"),
    pytest.param(ParallelLayout(ring=2), 1, (torch.float32,), False, id="cp2-ring-one-source"),
    # Qwen-Image-Edit-2511: the source tokens modulated with the timestep-0 embedding.
    pytest.param(ParallelLayout(), 2, (torch.float32, torch.bfloat16), True, id="zero-cond-t-tp1"),
    pytest.param(ParallelLayout(ulysses=2), 1, (torch.float32,), True, id="zero-cond-t-cp2-ulysses"),
]


@pytest.mark.parametrize("layout,n_sources,dtypes,zero_cond_t", CASES)
def test_edit_stream_parity_with_diffusers(layout: ParallelLayout, n_sources: int, dtypes: tuple,
                                           zero_cond_t: bool) -> None:
    results = run_ranks(_edit_parity, 2, layout, n_sources, dtypes, zero_cond_t, timeout_s=300)
    for dtype in dtypes:
        per_rank = [r[str(dtype)] for r in results]
        fwd = max(r["fwd"] for r in per_rank)
        if dtype == torch.float32:
            worst = max(max(r["grad"].values()) for r in per_rank)
            print(f"edit parity {layout} sources={n_sources} zero_cond_t={zero_cond_t} fp32: forward {fwd:.2e}, "
                  f"worst gradient {worst:.2e}")
            assert fwd < 1e-5, fwd
            assert worst < 1e-4, {n: e for r in per_rank for n, e in r["grad"].items() if e >= 1e-4}
            assert all(len(r["grad"]) == r["n_ref"] > 0 for r in per_rank)
        else:
            print(f"edit parity {layout} sources={n_sources} zero_cond_t={zero_cond_t} bf16: forward {fwd:.2e}")
            assert fwd < 2e-2, fwd


def test_edit_rope_positions_follow_diffusers() -> None:
    """The stream's RoPE angles (frame k for source k, text after the largest grid) are diffusers' own."""
    from diffusers.models.transformers.transformer_qwenimage import QwenEmbedRope

    from megatron_omni.models.dit.embeddings import qwen_stream_rope_angles, rope_rotations

    axes = provider.hf_config("tiny")["axes_dims_rope"]
    grids = ((1, 2, 4), (1, 6, 4), (1, 3, 5))  # the second source is taller than the generated image
    img, txt = (rope_rotations(a) for a in qwen_stream_rope_angles(grids, 7, axes))
    ref_img, ref_txt = QwenEmbedRope(theta=10000, axes_dim=list(axes), scale_rope=True)([list(grids)], None, 7)
    assert torch.allclose(img, ref_img, atol=1e-6) and torch.allclose(txt, ref_txt, atol=1e-6)


def _edit_pp_parity(rank: int, world_size: int, n_sources: int) -> dict:
    """fp32: forward and every gradient through the 1F1B schedule; bf16 (weights, inputs and the stages' p2p tensors):
    the forward through the same schedule (forward_only) against diffusers' in bf16."""
    out = {"fp32": _edit_pp_run(n_sources, torch.float32)}
    out["bf16"] = _edit_pp_run(n_sources, torch.bfloat16)
    return out


def _edit_pp_run(n_sources: int, dtype: torch.dtype) -> dict:
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    from megatron_omni.models.dit.model import DiTBatch, pipeline_seq_length

    fp32 = dtype == torch.float32
    layout = ParallelLayout(pp=2)
    batches = [_batch(n_sources), _batch(n_sources, seed=10)]  # two micro-batches
    ref = _reference(dtype)
    ref_outs = [_run(ref, b, dtype, grad=fp32) for b in batches]
    groups = build_parallel_groups(layout)
    seed_everything(0, tp_rank=groups.tp.rank())
    cfg = provider.transformer_config(_config(False), pp=2, batch_p2p_comm=False, params_dtype=dtype)
    model = provider.build_model(cfg, groups)
    provider.load_hf_state_dict(model, {k: v.to(dtype) for k, v in _reference_state().items()})
    outs: list[torch.Tensor] = []

    def forward_step(data_iterator, module):
        b = next(data_iterator)
        out = module(DiTBatch(b["hidden_states"].to(dtype), b["encoder_hidden_states"].to(dtype),
                              b["encoder_hidden_states_mask"], b["timestep"].to(dtype), GRID,
                              cond_grids=SOURCES[n_sources]))

        def loss_func(output):
            outs.append(output.detach().float().clone())
            return (output.float() * b["weight"]).sum(), {}

        return out, loss_func

    s_all = b_tokens = batches[0]["hidden_states"].shape[1]
    forward_backward_pipelining_without_interleaving(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model], num_microbatches=2,
        seq_length=pipeline_seq_length(S_TXT, s_all, 1), micro_batch_size=BATCH, forward_only=not fp32,
        p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=cfg), pg_collection=groups.mcore)
    fwd = None
    if groups.is_last_stage:
        fwd = max(float((o - r).norm() / r.norm()) for o, r in zip(outs, ref_outs))
    if not fp32:
        return {"fwd": fwd}
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.clone()
        if getattr(p, "pipeline_parallel", False):  # replicated on every stage (the timestep embedder)
            dist.all_reduce(g, group=groups.pp)
        grads[name] = g
    hf = provider.stage_hf_tensors(model, grads)
    # the schedule averages the loss over its micro-batches; the reference summed both backward passes
    ref_grads = {n: p.grad / len(batches) for n, p in ref.named_parameters() if p.grad is not None and p.grad.any()}
    err = {n: float((hf[n] - ref_grads[n]).norm() / ref_grads[n].norm()) for n in hf if n in ref_grads}
    return {"fwd": fwd, "grad": err, "tokens": b_tokens, "n_ref": len(ref_grads)}


def test_edit_stream_parity_with_diffusers_at_pp2() -> None:
    results = run_ranks(_edit_pp_parity, 2, 2, timeout_s=300)
    bf16 = max(r["bf16"]["fwd"] for r in results if r["bf16"]["fwd"] is not None)
    results = [r["fp32"] for r in results]
    fwd = max(r["fwd"] for r in results if r["fwd"] is not None)
    worst = max(max(r["grad"].values()) for r in results)
    n = sum(len(r["grad"]) for r in results)
    print(f"edit parity pp=2, two sources ({results[0]['tokens']} image tokens), 2 micro-batches fp32: forward "
          f"{fwd:.2e}, worst gradient {worst:.2e} over {n} tensors; bf16 forward {bf16:.2e}")
    assert fwd < 1e-5, fwd
    assert worst < 1e-4, worst
    assert all(r["grad"] for r in results)  # both stages hold and compare gradients
    assert len(set(results[0]["grad"]) | set(results[1]["grad"])) == results[0]["n_ref"]  # every diffusers gradient
    assert bf16 < 2e-2, bf16
