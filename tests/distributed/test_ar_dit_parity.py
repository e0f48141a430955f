"""The Megatron AR decoder equals transformers' `Qwen2ForCausalLM` (tiny config, fp32) at TP=1, TP=2, PP=2 and
CP=2 (Ulysses), and the whole AR-DiT hybrid forward at TP=2 equals TP=1, and at CP=2 the reference.

Decoder: identical Qwen2-named weights go into both models; a batch of token ids runs forward (logits to
< 1e-5 relative error) and backward through a weighted sum of token log-probs (vocab-parallel log-softmax
under TP), and every Qwen2 parameter's gradient, rebuilt from the Megatron shards, must match to < 1e-4.
PP=2 runs Megatron-Core's 1F1B schedule over 2 micro-batches. CP=2 splits tokens, labels and weights the
Megatron way (chunks r and 2cp-1-r) and sums the replicas' gradients over cp. TP=1 runs on both ranks (dp=2).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

from megatron_omni.models.ar.context_parallel import gather_sequence, split_sequence
from megatron_omni.models.ar.decoder import gather_logits, token_log_probs
from megatron_omni.models.dit.cp_comm import gather_along_dim
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from model_providers.ar_dit import decoder_provider, provider

BATCH, SEQ = 2, 9
CP_SEQ = 12  # divisible by 2 * cp: Megatron's load-balanced causal split


def _batches(n: int, seq: int = SEQ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    vocab = decoder_provider.qwen2_config("tiny")["vocab_size"]
    return [(torch.randint(0, vocab, (BATCH, seq), generator=g), torch.randn(BATCH, seq - 1, generator=g))
            for _ in range(n)]


def _reference(batches):
    hf = decoder_provider.hf_model("tiny")
    outs = []
    for ids, w in batches:
        logits = hf(input_ids=ids).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        ((lp * w).sum() / len(batches)).backward()
        outs.append(logits.detach())
    return outs, {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}, hf.state_dict()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _decoder_parity(rank: int, world_size: int, layout: ParallelLayout) -> dict:
    n_micro = 2 if layout.pp > 1 else 1
    batches = _batches(n_micro, seq=CP_SEQ if layout.cp > 1 else SEQ)
    ref_logits, ref_grads, ref_state = _reference(batches)
    groups = build_parallel_groups(layout)
    seed_everything(0, tp_rank=groups.tp.rank())
    cfg = decoder_provider.transformer_config("tiny", tp=layout.tp, pp=layout.pp, cp=layout.cp,
                                              batch_p2p_comm=False)
    model = decoder_provider.build_decoder("tiny", cfg, groups)
    decoder_provider.load_hf_state_dict(model, ref_state)
    outs: list[torch.Tensor] = []

    def loss_of(logits, ids, w):
        outs.append(gather_logits(logits.detach(), groups.tp).transpose(0, 1))
        lp = token_log_probs(logits[:-1], ids[:, 1:].t(), groups.tp)  # [s-1, b]
        return (lp * w.t()).sum()

    if layout.cp > 1:
        # Megatron's layout: tokens, shifted labels and their weights split alike (chunks r and 2cp-1-r); each
        # rank's loss covers its own positions and the replicas' gradients are summed over the cp group.
        ids, w = batches[0]
        labels = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], 1)
        weights = torch.cat([w, torch.zeros_like(w[:, :1])], 1)
        local = [split_sequence(x, 1, groups.cp) for x in (ids, labels, weights)]
        _, logits = model.forward_hidden(local[0])
        outs.append(gather_sequence(gather_logits(logits.detach(), groups.tp), 0, groups.cp).transpose(0, 1))
        (token_log_probs(logits, local[1].t(), groups.tp) * local[2].t()).sum().backward()
        for p in model.parameters():
            torch.distributed.all_reduce(p.grad, group=groups.cp)
    elif layout.pp == 1:
        ids, w = batches[0]
        _, logits = model.forward_hidden(ids)
        loss_of(logits, ids, w).backward()
    else:
        it = iter(batches)

        def forward_step(data_iterator, module):
            ids, w = next(data_iterator)
            out = module(ids)
            return out, lambda logits: (loss_of(logits, ids, w), {})

        forward_backward_pipelining_without_interleaving(
            forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=n_micro,
            seq_length=SEQ, micro_batch_size=BATCH, p2p_communicator=P2PCommunicator(pp_group=groups.pp, config=cfg),
            pg_collection=groups.mcore,
        )
    fwd = None
    if groups.is_last_stage:
        fwd = max(_rel(o, r) for o, r in zip(outs, ref_logits))
    grads = decoder_provider.stage_hf_tensors(model, {n: p.grad for n, p in model.named_parameters()})
    return {"fwd": fwd, "grad": {n: _rel(g, ref_grads[n]) for n, g in grads.items()}, "n_ref": len(ref_grads)}


@pytest.mark.parametrize("layout", [ParallelLayout(tp=1), ParallelLayout(tp=2), ParallelLayout(pp=2),
                                    ParallelLayout(ulysses=2)], ids=["tp1", "tp2", "pp2-2microbatches", "cp2-ulysses"])
def test_decoder_parity_with_transformers_qwen2(layout: ParallelLayout) -> None:
    results = run_ranks(_decoder_parity, 2, layout, timeout_s=240)
    fwd = [r["fwd"] for r in results if r["fwd"] is not None]
    assert fwd and max(fwd) < 1e-5, fwd
    covered = set()
    for r in results:
        for name, err in r["grad"].items():
            assert err < 1e-4, (name, err)
            covered.add(name)
    assert len(covered) == results[0]["n_ref"], "some Qwen2 parameters got no gradient to compare"


# ------------------------------------------------------------------------------------------ the hybrid

GRID = (1, 2, 4)  # latent grid in patches: 8 image tokens


def _hybrid_inputs(seq: int = SEQ):
    h = provider.hybrid_config("tiny")
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, h.decoder["vocab_size"], (BATCH, seq), generator=g)
    mask = torch.ones(BATCH, seq, dtype=torch.bool)
    mask[1, 6:] = False  # sample 1 is a shorter prompt + plan (right padding)
    latents = torch.randn(BATCH, GRID[1] * GRID[2], h.dit["in_channels"], generator=g)
    sigma = torch.rand(BATCH, generator=g)
    return ids, mask, latents, sigma


def _hybrid_parity(rank: int, world_size: int, layout: ParallelLayout) -> dict:
    ref = provider.torch_hybrid("tiny")
    ids, mask, latents, sigma = _hybrid_inputs(CP_SEQ if layout.cp > 1 else SEQ)
    with torch.no_grad():
        out = ref.decoder(input_ids=ids, output_hidden_states=True)
        cond = ref.connector(out.hidden_states[-1])
        v_ref = ref.dit(hidden_states=latents, encoder_hidden_states=cond, encoder_hidden_states_mask=mask,
                        timestep=sigma, img_shapes=[[GRID]] * BATCH).sample
    groups = build_parallel_groups(layout)
    seed_everything(0, tp_rank=groups.tp.rank())
    model = provider.build_model("tiny", groups)
    provider.load_hf_state(model, *ref.state())
    with torch.no_grad():
        logits, v = model(ids, mask, latents, sigma, GRID)
    logits = gather_sequence(gather_logits(logits, groups.tp), 0, groups.cp).transpose(0, 1)
    v = gather_along_dim(v, 1, groups.cp)  # the DiT's contiguous image shards
    back = provider.hf_state(model)
    exact = all(torch.equal(b[k], r[k]) for b, r in zip(back, ref.state()) for k in r)
    return {"logits": _rel(logits, out.logits), "velocity": _rel(v, v_ref), "v": v, "round_trip": exact}


def test_hybrid_forward_tp2_equals_tp1_and_reference() -> None:
    tp1 = run_ranks(_hybrid_parity, 2, ParallelLayout(tp=1), timeout_s=240)
    tp2 = run_ranks(_hybrid_parity, 2, ParallelLayout(tp=2), timeout_s=240)
    for r in tp1 + tp2:
        assert r["logits"] < 1e-5 and r["velocity"] < 1e-5, (r["logits"], r["velocity"])
        assert r["round_trip"], "weights gathered back from the shards differ from those loaded"
    assert _rel(tp2[0]["v"], tp1[0]["v"]) < 1e-5


def test_hybrid_forward_cp2_equals_reference() -> None:
    """Both halves context-parallel over the same 2 ranks: the decoder's Ulysses over token shards (its hidden
    states gathered for the DiT's text stream), the DiT's over image shards."""
    for r in run_ranks(_hybrid_parity, 2, ParallelLayout(ulysses=2), timeout_s=240):
        assert r["logits"] < 1e-5 and r["velocity"] < 1e-5, (r["logits"], r["velocity"])
        assert r["round_trip"], "weights gathered back from the shards differ from those loaded"


def _checkpoint_tp2_to_tp1(rank: int, world_size: int, ckpt: str) -> bool:
    from tools.checkpoint.convert_ar_dit import load_hybrid, save_hybrid

    ref = provider.torch_hybrid("tiny", seed=7)
    tp2 = build_parallel_groups(ParallelLayout(tp=2))
    seed_everything(0, tp_rank=tp2.tp.rank())
    model = provider.build_model("tiny", tp2)
    provider.load_hf_state(model, *ref.state())
    save_hybrid(model, ckpt, ref.config.to_dict())
    tp1 = build_parallel_groups(ParallelLayout(tp=1))
    seed_everything(1, tp_rank=0)
    other = provider.build_model("tiny", tp1)
    load_hybrid(other, ckpt)
    return all(torch.equal(a[k], b[k]) for a, b in zip(provider.hf_state(other), ref.state()) for k in b)


def test_hybrid_checkpoint_saved_at_tp2_loads_at_tp1(tmp_path) -> None:
    assert all(run_ranks(_checkpoint_tp2_to_tp1, 2, str(tmp_path / "ckpt"), timeout_s=240))
