"""LoRA in the FlowGRPO trainer (model.lora.rank > 0) on the tiny offline pipeline, one rank:

- only the adapters train: they alone have requires_grad, DDP grad buffers and optimizer state; after an update
  every base weight is bit-identical and the adapters moved;
- the adapter-only sync loads them into the diffusers engine through peft: the engine carries the adapter on
  exactly the diffusers modules the trained linears map to (a fused qkv -> to_q/to_k/to_v), the probe forward
  equals the trainer's, and a sync with one adapter dropped raises LoRASyncError naming it;
- into vLLM-Omni (`rollout.lora_sync=auto`) through its LoRA request path and its own LoRA layers, then in place:
  probe equal after each sync, the rollout samples with the adapters (its log-probs are the trainer's), and a
  dropped key, a layer whose adapter was reset and a request without the LoRA request each raise;
- `rollout.lora_sync=merge` syncs W + scale B A through the ordinary bridge, probe-checked;
- the KL reference is the policy with its adapters off: kl = 0 before the first update (B = 0), > 0 after, and
  no second model is built;
- the adapter checkpoint records the base's identity, and `lora_to_hf` writes a file diffusers'
  `QwenImagePipeline.load_lora_weights` loads, whose transformer output equals the trainer's engine with the
  same adapters (and the `--merge` pipeline's equals it too).
"""

from __future__ import annotations

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks
from tests.unit.tiny_trainer import GROUP, PROMPTS, tiny_trainer

LORA = ("model.lora.rank=4", "model.lora.alpha=8", "rollout.transformer=engine")


def _one_update(trainer, seed: int = 7):
    n = len(PROMPTS) * GROUP
    traj = trainer.engine.generate(PROMPTS, trainer.sampling_params(), group_size=GROUP,
                                   seeds=[seed + i for i in range(n)])
    advantages = torch.linspace(-1.0, 1.0, n)
    return traj, trainer._update(traj, trainer.old_log_probs(traj, 0), advantages, 0,
                                 trainer.reference_means(traj, 0))


def _adapter_training(rank: int, world_size: int, pipeline_dir: str) -> dict:
    from megatron_omni.bridge.lora_sync import LoRASyncError
    from megatron_omni.models.lora import adapters, is_adapter_name

    trainer = tiny_trainer(pipeline_dir, *LORA)
    named = dict(trainer.model.named_parameters())
    trained = sorted(n for n, p in named.items() if p.requires_grad)
    adapter_numel = sum(p.numel() for n, p in named.items() if is_adapter_name(n))
    buffered = sum(p.numel() for b in trainer.ddp.buffers for p in b.params)
    optimized = sum(p.numel() for g in trainer.optimizer.param_groups for p in g["params"])
    base = {n: p.detach().clone() for n, p in named.items() if not is_adapter_name(n)}
    b_before = {n: a.lora_b.detach().clone() for n, a in adapters(trainer.model).items()}
    _one_update(trainer)
    out = {
        "all_trained_are_adapters": all(is_adapter_name(n) for n in trained) and len(trained) > 0,
        "adapter_numel": adapter_numel, "buffered": buffered, "optimized": optimized,
        "base_unchanged": all(torch.equal(base[n], named[n].detach()) for n in base),
        "base_no_grad": all(named[n].grad is None and getattr(named[n], "main_grad", None) is None for n in base),
        "b_unmoved": sorted(n for n, a in adapters(trainer.model).items() if torch.equal(b_before[n], a.lora_b)),
        "linears": len(trainer.lora_linears),
    }
    out["probe"] = trainer.sync_weights()
    out["modules"] = len(trainer.lora_sync.modules)
    out["carrying"] = len(trainer.engine.load_lora(trainer.lora_sync.state(), 4, 8.0)[0])
    state = trainer.lora_sync.state()
    dropped = next(k for k in state if ".attn.to_k." in k)
    try:
        trainer.lora_sync.deliver({k: v for k, v in state.items() if k != dropped})
        out["dropped_error"] = None
    except LoRASyncError as exc:
        out["dropped_error"] = str(exc)
    out["dropped_key"] = dropped
    return out


@pytest.mark.slow
def test_only_adapters_train_and_the_engine_carries_them(tiny_pipeline_dir: str) -> None:
    r = run_ranks(_adapter_training, 1, tiny_pipeline_dir)[0]
    assert r["all_trained_are_adapters"]
    assert r["buffered"] == r["adapter_numel"] == r["optimized"]
    assert r["base_unchanged"] and r["base_no_grad"]
    # every adapter moved but those whose output the model never uses: the last block's text stream after its
    # attention (MMDiT's output is the image stream)
    last = r["linears"] // 8 - 1
    assert r["b_unmoved"] == [f"layers.{last}.txt.linear_fc1", f"layers.{last}.txt.linear_fc2",
                              f"layers.{last}.txt.linear_proj"]
    # each stream of each block: qkv (-> to_q, to_k, to_v), proj, fc1, fc2
    assert r["modules"] == r["linears"] // 4 * 6 == r["carrying"]
    assert r["probe"] < 1e-5
    assert r["dropped_error"] is not None and "not written" in r["dropped_error"]
    assert r["dropped_key"].rsplit(".lora_", 1)[0] in r["dropped_error"]


def _vllm_omni_adapters(rank: int, world_size: int, pipeline_dir: str) -> dict:
    from megatron_omni.bridge.lora_sync import LoRASyncError
    from megatron_omni.models.lora import adapters_disabled

    def error_of(fn) -> str | None:
        try:
            fn()
        except LoRASyncError as exc:
            return str(exc)
        return None

    # inline (its LoRA manager in this rank; rollout.lora_sync=auto takes adapters there)
    trainer = tiny_trainer(pipeline_dir, *LORA, "rollout.engine=vllm_omni", "rollout.vllm_omni_process=inline")
    out = {"adapter_mode": trainer.lora_sync is not None and trainer.weight_sync is None}
    _one_update(trainer)
    out["probe"] = trainer.sync_weights()  # the first: through vLLM-Omni's LoRA request path
    receiver = trainer.engine.omni.worker._flowgrpo_lora_receiver
    out["layer_types"] = sorted({type(layer).__name__ for layer in receiver.layers.values()})
    out["layers"], out["modules"] = len(receiver.layers), len(trainer.lora_sync.modules)
    n = len(PROMPTS) * GROUP
    # the rollout samples with the synced adapters (its requests carry the LoRA request): its log-probs are the
    # trainer's, and they differ from the base's
    traj = trainer.engine.generate(PROMPTS, trainer.sampling_params(), group_size=GROUP, seeds=list(range(30, 30 + n)))
    out["rollout_gap"] = float((trainer.old_log_probs(traj, 0) - traj.log_probs).abs().max())
    with adapters_disabled(trainer.model):
        out["base_gap"] = float((trainer.old_log_probs(traj, 0) - traj.log_probs).abs().max())
    _one_update(trainer, seed=11)
    out["probe2"] = trainer.sync_weights()  # in place
    state = trainer.lora_sync.state()
    dropped = next(k for k in state if ".attn.to_k." in k)
    out["dropped"] = dropped
    out["dropped_error"] = error_of(lambda: trainer.lora_sync.deliver({k: v for k, v in state.items() if k != dropped}))
    # the engine loses one layer's adapter: the next sync names the modules it no longer carries
    next(layer for name, layer in receiver.layers.items() if name.endswith("0.attn.to_out")).reset_lora(0)
    out["reset_error"] = error_of(trainer.sync_weights)
    # a request without the LoRA request switches the adapter off in vLLM-Omni's worker: the next sync says so
    trainer.engine._lora_request = None
    trainer.engine.generate(PROMPTS[:1], trainer.sampling_params(), group_size=1, seeds=[3])
    out["off_error"] = error_of(trainer.sync_weights)
    return out


@pytest.mark.slow
def test_adapters_into_vllm_omni_through_its_lora_layers(tiny_pipeline_dir: str) -> None:
    r = run_ranks(_vllm_omni_adapters, 1, tiny_pipeline_dir)[0]
    assert r["adapter_mode"]
    assert r["layer_types"] == ["DiffusionColumnParallelLinearWithLoRA", "DiffusionMergedQKVParallelLinearWithLoRA",
                                "DiffusionRowParallelLinearWithLoRA"]
    assert r["layers"] * 6 == r["modules"] * 4  # per stream: to_qkv (3 modules), to_out, net.0.proj, net.2
    assert r["probe"] < 1e-5 and r["probe2"] < 1e-5
    assert r["rollout_gap"] < r["base_gap"] / 100 and r["base_gap"] > 1e-6
    assert "not written" in r["dropped_error"] and r["dropped"].rsplit(".lora_", 1)[0] in r["dropped_error"]
    assert "not carrying: ['transformer_blocks.0.attn.to_out.0']" in r["reset_error"]
    assert r["off_error"].startswith(f"LoRA sync: the engine carries the adapter on 0 modules, the trainer trains "
                                     f"{r['modules']}")


def _merge_and_kl(rank: int, world_size: int, pipeline_dir: str) -> dict:
    merge = tiny_trainer(pipeline_dir, *LORA, "rollout.lora_sync=merge")
    _one_update(merge)
    out = {"merge_probe": merge.sync_weights(), "merge_lora_sync": merge.lora_sync}
    kl = tiny_trainer(pipeline_dir, *LORA, "algorithm.beta=0.5")
    _, first = _one_update(kl)
    _, second = _one_update(kl, seed=11)
    out.update(reference=kl.reference, kl0=first["kl"], kl1=second["kl"])
    return out


@pytest.mark.slow
def test_merged_sync_and_the_adapters_off_reference(tiny_pipeline_dir: str) -> None:
    r = run_ranks(_merge_and_kl, 1, tiny_pipeline_dir)[0]
    assert r["merge_lora_sync"] is None and r["merge_probe"] < 1e-5
    assert r["reference"] is None
    assert r["kl0"] == 0.0 and r["kl1"] > 0.0


def _export(rank: int, world_size: int, pipeline_dir: str, run_dir: str) -> dict:
    from pathlib import Path

    from diffusers import QwenImagePipeline

    from megatron_omni.checkpoint.lora import base_identity, lora_to_hf
    from megatron_omni.trainer.checkpointing import save_checkpoint

    trainer = tiny_trainer(pipeline_dir, *LORA)
    _one_update(trainer)
    trainer.sync_weights()
    common = {"step": 1, "identity": trainer.checkpoint_identity}
    folder = save_checkpoint(Path(run_dir), 1, trainer.model, trainer.optimizer, trainer.scheduler, common, 1,
                             content_metadata=trainer.content_metadata(1), sharded_state=trainer.sharded_state)
    lora_file = lora_to_hf(folder, Path(run_dir) / "lora")
    merged = lora_to_hf(folder, Path(run_dir) / "merged", merge=True)
    traj = trainer.probe
    ours = trainer.engine.probe(traj)

    def probe_of(pipe) -> torch.Tensor:
        from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine

        engine = DiffusersRolloutEngine.__new__(DiffusersRolloutEngine)
        engine.velocity_model, engine.dtype = pipe.transformer, torch.float32
        return engine.probe(traj)

    loaded = QwenImagePipeline.from_pretrained(pipeline_dir, local_files_only=True)
    loaded.load_lora_weights(str(lora_file.output), weight_name="pytorch_lora_weights.safetensors")
    full = QwenImagePipeline.from_pretrained(str(merged.output), local_files_only=True)
    return {"identity": trainer.checkpoint_identity["lora"]["base"], "expected_identity": base_identity(pipeline_dir),
            "modules": lora_file.modules, "engine_modules": len(trainer.lora_sync.modules),
            "loaded_diff": float((probe_of(loaded) - ours).abs().max()),
            "merged_diff": float((probe_of(full) - ours).abs().max()),
            "moved": float((ours - probe_of(QwenImagePipeline.from_pretrained(pipeline_dir, local_files_only=True)))
                           .abs().max())}


@pytest.mark.slow
def test_export_loads_in_diffusers_and_matches(tiny_pipeline_dir: str, tmp_path) -> None:
    r = run_ranks(_export, 1, tiny_pipeline_dir, str(tmp_path))[0]
    assert r["identity"] == r["expected_identity"]
    assert r["modules"] == r["engine_modules"]
    assert r["moved"] > 1e-4, "the update did not change the model: the comparison would prove nothing"
    assert r["loaded_diff"] < 1e-5 and r["merged_diff"] < 1e-5
