"""Wan2.2 A14B two-expert folders on the tiny offline folder in the published layout (`transformer` the high-noise
expert, `transformer_2` the low-noise one, `boundary_ratio` 0.875): each expert converts diffusers -> Megatron ->
diffusers byte-exact, and the pipeline folder converts (and is exported into) its trained low-noise expert; the embedded
engine's ODE rollout with true CFG is `WanPipeline`'s video for the same seeds, each step on the expert the pipeline
runs at that timestep (rows of both kinds in one forward too); the policy is the low-noise expert: an SDE window in
its steps is recomputed by the Megatron model built from `transformer_2` to |dlogp| <= 1e-6 (and not by the
high-noise expert's), a trainer-injected velocity model replaces that expert only, and a window that can start at a
high-noise step is refused by name, as is the folder on the vLLM-Omni pipeline."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import WanPipeline, WanTransformer3DModel

from examples.wan.recipe import wan_video_demo
from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.models.dit.video_interface import PackedVideoTransformer
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import build_diffusers_engine
from megatron_omni.rollout.diffusers_engines.wan import ExpertRouter, WanRolloutEngine
from megatron_omni.rollout.registry import EngineSettings
from megatron_omni.rollout.vllm_omni.wan_pipeline import require_one_expert
from megatron_omni.trainer.flowgrpo import _initial_weights
from model_providers.wan import provider
from model_providers.wan.experts import expert_dirs, read_two_experts
from model_providers.wan.tiny_pipeline import make_tiny_a14b_pipeline
from tests.unit.test_checkpoint_convert import tensor_hashes
from tools.checkpoint.convert import main

PROMPTS = ["a red cat", 'a sign that says "OPEN 24"']
# 5 frames at 32 x 32 (a patch grid of 2 x 2 x 2), 4 steps: t = 1000 (high-noise expert), 857.7, 602.2, 8.9 (low-noise)
SDE = SamplingParams(height=32, width=32, num_frames=5, num_steps=4, noise_level=1.0, window_size=2,
                     window_range=(1, 3), max_sequence_length=16)
CFG = dict(guidance_scale=5.0, negative_prompt="blurred, static")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(make_tiny_a14b_pipeline(tmp_path_factory.mktemp("wan") / "tiny-wan-a14b", seed=0))


@pytest.fixture(scope="module")
def engine(folder: str) -> WanRolloutEngine:
    engine = build_diffusers_engine(folder, EngineSettings(max_batch_size=4))
    assert isinstance(engine, WanRolloutEngine)
    return engine


def test_each_expert_converts_byte_exact(folder: str, tmp_path: Path, capsys) -> None:
    index = json.loads((Path(folder) / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    experts = expert_dirs(folder)
    assert list(experts) == ["transformer", "transformer_2"]
    assert tensor_hashes(experts["transformer"]) != tensor_hashes(experts["transformer_2"])  # own weights
    for name, src in experts.items():
        (tmp_path / name).mkdir()
        assert main(["hf-to-mcore", str(src), str(tmp_path / name / "mcore"), "--no-progress"]) == 0
        assert main(["mcore-to-hf", str(tmp_path / name / "mcore"), str(tmp_path / name / "back"),
                     "--no-progress"]) == 0
        assert tensor_hashes(tmp_path / name / "back") == tensor_hashes(src)
    # the pipeline folder converts its trained expert, the low-noise `transformer_2`, and a checkpoint exported into
    # a pipeline goes into that slot, the high-noise expert copied as it is (exporting the high-noise expert's
    # checkpoint shows the slot: it lands in `transformer_2`)
    assert main(["hf-to-mcore", folder, str(tmp_path / "pipe_mcore"), "--no-progress"]) == 0
    for ckpt, out in (("pipe_mcore", "pipe_back"), ("transformer/mcore", "pipe_slot")):
        assert main(["mcore-to-hf", str(tmp_path / ckpt), str(tmp_path / out), "--pipeline-source", folder,
                     "--no-progress"]) == 0
        assert tensor_hashes(tmp_path / out / "transformer") == tensor_hashes(experts["transformer"])
    assert tensor_hashes(tmp_path / "pipe_back" / "transformer_2") == tensor_hashes(experts["transformer_2"])
    assert tensor_hashes(tmp_path / "pipe_slot" / "transformer_2") == tensor_hashes(experts["transformer"])
    # a LoRA checkpoint's base identity is the trained expert's files, named
    from megatron_omni.checkpoint.lora import base_identity

    identity = base_identity(folder)
    assert identity["component"] == "transformer_2"
    assert identity["transformer_bytes"] == sum(f.stat().st_size for f in experts["transformer_2"].iterdir())


def _timesteps_seen(*modules: torch.nn.Module) -> tuple[list[list[float]], list]:
    """Forward pre-hooks recording each module's (first row's) timestep per call; returns (the lists, handles)."""
    seen: list[list[float]] = [[] for _ in modules]
    handles = [m.register_forward_pre_hook(lambda _m, args, kw, out=out: out.append(round(float(kw["timestep"]
                                                                                               .flatten()[0]), 1)),
                                           with_kwargs=True)
               for m, out in zip(modules, seen)]
    return seen, handles


def test_ode_rollout_is_wan_pipelines_video_on_each_steps_expert(folder: str, engine: WanRolloutEngine) -> None:
    pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    want_seen, handles = _timesteps_seen(pipe.transformer, pipe.transformer_2)
    want = pipe(prompt=PROMPTS, negative_prompt=CFG["negative_prompt"], height=32, width=32, num_frames=5,
                num_inference_steps=4, guidance_scale=5.0, max_sequence_length=16,
                generator=[torch.Generator().manual_seed(s) for s in (3, 4)], output_type="pt").frames
    for h in handles:
        h.remove()
    got_seen, handles = _timesteps_seen(engine.pipe.transformer, engine.pipe.transformer_2)
    traj = engine.generate(PROMPTS, replace(SDE.ode(), **CFG), seeds=[3, 4])
    for h in handles:
        h.remove()
    # diffusers runs the prompt and the negative rows in two forwards, the engine in one
    assert want_seen == [[1000.0, 1000.0], [857.7, 857.7, 602.2, 602.2, 8.9, 8.9]]
    assert got_seen == [[1000.0], [857.7, 602.2, 8.9]]
    err = float((traj.images - want).abs().max())
    print(f"A14B ODE rollout (CFG 5.0) vs WanPipeline: max |diff| {err:.2e}")
    assert traj.images.shape == want.shape == (2, 5, 3, 32, 32) and err < 1e-5
    # the policy the trainer sees is the low-noise expert
    assert engine.transformer is engine.pipe.transformer_2
    assert engine.initial_state_dict().keys() == engine.pipe.transformer.state_dict().keys()
    assert torch.equal(engine.initial_state_dict()["proj_out.weight"], engine.pipe.transformer_2.proj_out.weight)
    # a bf16 engine under an fp32 trainer: the trainer reads the policy expert's tensors from the folder
    assert engine.policy_component == "transformer_2"
    from_folder = _initial_weights({"w": torch.zeros(1, dtype=torch.bfloat16)}, folder, torch.float32,
                                   engine.policy_component)
    assert torch.equal(from_folder["proj_out.weight"], engine.pipe.transformer_2.proj_out.weight)
    # rows of both experts in one forward (continuous batching) get each its own expert's velocity
    router = engine.velocity_model
    assert isinstance(router, ExpertRouter)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    text = traj.prompt_embeds
    sigma = torch.tensor([1.0, 0.6])
    kw = dict(encoder_hidden_states_mask=traj.prompt_embeds_mask, img_shapes=[[traj.img_shape]] * 2)
    with torch.no_grad():
        both = router(hidden_states=x, encoder_hidden_states=text, timestep=sigma, **kw)[0]
        for row, expert in ((0, engine.pipe.transformer), (1, engine.pipe.transformer_2)):
            alone = PackedVideoTransformer(expert, engine.patch_size)(
                x[row:row + 1], text[row:row + 1], None, sigma[row:row + 1], [[traj.img_shape]])[0]
            assert float((both[row] - alone[0]).abs().max()) < 1e-5
        other = PackedVideoTransformer(engine.pipe.transformer_2, engine.patch_size)(x[:1], text[:1], None,
                                                                                   sigma[:1], [[traj.img_shape]])[0]
        assert float((both[0] - other[0]).abs().max()) > 1e-3  # the experts differ where it matters


@pytest.fixture(scope="module")
def one_rank():
    platform.init_distributed(rank=0, world_size=1)
    yield build_parallel_groups(ParallelLayout())
    platform.destroy_distributed()


def _megatron_expert(folder: str, name: str, groups):
    expert = WanTransformer3DModel.from_pretrained(folder, subfolder=name, local_files_only=True)
    seed_everything(0)
    model = provider.build_model(provider.transformer_config(dict(expert.config)), groups)
    provider.load_hf_state_dict(model, expert.state_dict())
    return model


def test_the_low_noise_expert_recomputes_the_window(folder: str, engine: WanRolloutEngine, one_rank) -> None:
    traj = engine.generate(PROMPTS, replace(SDE, **CFG), group_size=2, seeds=[1, 2, 3, 4])
    assert set(traj.window_start.tolist()) <= {1} and traj.log_probs.shape == (4, 2)
    assert not read_two_experts(folder).high_noise(traj.sigmas[0, 1:3]).any()  # the window's steps: low noise
    low = _megatron_expert(folder, "transformer_2", one_rank)
    high = _megatron_expert(folder, "transformer", one_rank)
    with torch.no_grad():
        dlogp = (recompute_log_probs(traj, DiffusersForward(low)).log_probs - traj.log_probs).abs()
        print(f"A14B window recompute by the low-noise expert: max |dlogp| {float(dlogp.max()):.2e}")
        assert float(dlogp.max()) <= 1e-6, dlogp
        wrong = recompute_log_probs(traj, DiffusersForward(high)).log_probs
        assert float((wrong - traj.log_probs).abs().mean()) > 1e-4
        # the trainer's shared model replaces the policy expert only: the high-noise steps stay on `transformer`
        ode = engine.generate(PROMPTS, SDE.ode(), seeds=[3, 4])
        own = engine.velocity_model
        engine.velocity_model = DiffusersForward(low)
        try:
            assert isinstance(engine.velocity_model, ExpertRouter) and engine.velocity_model.low.model is low
            again = engine.generate(PROMPTS, SDE.ode(), seeds=[3, 4])
        finally:
            engine.velocity_model = own.low
        assert float((again.images - ode.images).abs().max()) < 1e-5


def test_guidance_scale_2_guides_the_low_noise_experts_steps(folder: str, engine: WanRolloutEngine, one_rank) -> None:
    """`guidance_scale_2` as `WanPipeline` applies it: `guidance_scale` (5.0) on the high-noise expert's step,
    `guidance_scale_2` (2.0) on the low-noise expert's: the ODE video equals the pipeline's and moves from the one
    guided by 5.0 throughout; the trajectory records 2.0 (its window lies in the low-noise steps) and the low-noise
    expert recomputes the window's log-probs with it. A one-transformer folder refuses it by name."""
    pipe = WanPipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    want = pipe(prompt=PROMPTS, negative_prompt=CFG["negative_prompt"], height=32, width=32, num_frames=5,
                num_inference_steps=4, guidance_scale=5.0, guidance_scale_2=2.0, max_sequence_length=16,
                generator=[torch.Generator().manual_seed(s) for s in (3, 4)], output_type="pt").frames
    params = replace(SDE, **CFG, guidance_scale_2=2.0)
    got = engine.generate(PROMPTS, params.ode(), seeds=[3, 4])
    one_scale = engine.generate(PROMPTS, replace(SDE, **CFG).ode(), seeds=[3, 4])
    err, moved = (float((got.images - x).abs().max()) for x in (want, one_scale.images))
    print(f"A14B ODE rollout (CFG 5.0 / 2.0) vs WanPipeline: max |diff| {err:.2e}; moved from CFG 5.0 by {moved:.2e}")
    assert err < 1e-5 and moved > 1e-3
    traj = engine.generate(PROMPTS, params, group_size=2, seeds=[1, 2, 3, 4])
    assert traj.guidance_scale.tolist() == [2.0] * 4
    with torch.no_grad():
        dlogp = (recompute_log_probs(traj, DiffusersForward(_megatron_expert(folder, "transformer_2", one_rank)))
                 .log_probs - traj.log_probs).abs()
    assert float(dlogp.max()) <= 1e-6, dlogp
    from model_providers.wan.tiny_pipeline import make_tiny_pipeline

    one = build_diffusers_engine(make_tiny_pipeline(Path(folder).parent / "one-expert", seed=0),
                                 EngineSettings(max_batch_size=4))
    with pytest.raises(ValueError, match="guidance_scale_2=2.0 guides a low-noise expert: it needs a two-expert"):
        one.generate(PROMPTS, params)


def test_what_the_two_expert_folder_refuses(folder: str, engine: WanRolloutEngine) -> None:
    with pytest.raises(ValueError, match=r"step 0, a high-noise step .* start at 1"):
        engine.generate(PROMPTS, replace(SDE, window_range=(0, 2)))
    # DiffusionNFT trains the low-noise expert at its levels only: the grids from the first low-noise step; a grid
    # all of whose steps are high-noise leaves it none
    from megatron_omni.trainer.flowgrpo import nft_grids

    grid = torch.tensor([[1.0, 0.9, 0.875, 0.8, 0.5, 0.0]]).expand(2, -1)
    assert torch.equal(nft_grids(grid, engine.experts), grid[:, 3:]) and nft_grids(grid, None) is grid
    with pytest.raises(ValueError, match=r"high-noise steps are \[2, 2\] of 2"):
        nft_grids(grid[:, :3], engine.experts)
    with pytest.raises(ValueError, match="not supported by the vLLM-Omni Wan pipeline yet"):
        require_one_expert(folder)


def test_the_planner_holds_both_experts_in_the_rollout(folder: str) -> None:
    """The A14B preset is two experts of the 14B's shape: the rollout engine holds both (its weights grow by one
    expert, nothing else moves); the dry run reads the count from the folder or the preset, and the recipe's window
    starts at the folder's first low-noise step."""
    from examples.wan.recipe import low_noise_window_range
    from megatron_omni.parallel.layout import ParallelLayout
    from megatron_omni.planner.specs import Precision
    from megatron_omni.planner.video import plan_video
    from megatron_omni.trainer.dry_run import rollout_experts
    from model_providers.wan.presets import preset
    from tests.unit.test_wan_planner import _workload

    assert preset("wan2.2-t2v-a14b") == preset("wan2.1-t2v-14b")
    prec = Precision(distributed_optimizer=True)
    one, two = (plan_video("wan2.2-t2v-a14b", ParallelLayout(tp=2), 16, _workload(), precision=prec,
                           recompute="full", rollout_experts=n) for n in (1, 2))
    assert two.memory.rollout_weights - one.memory.rollout_weights == 2 * provider.parameter_count("wan2.1-t2v-14b")
    assert two.memory.total - one.memory.total == two.memory.rollout_weights - one.memory.rollout_weights
    assert (two.step_s, two.memory.parameters) == (one.step_s, one.memory.parameters)
    cfg = wan_video_demo()
    assert rollout_experts(cfg) == 1  # the tiny one-transformer pipeline
    cfg.model.pipeline = folder
    assert rollout_experts(cfg) == 2
    cfg.model.pipeline, cfg.model.preset = "/no/such/folder", "wan2.2-t2v-a14b"
    assert rollout_experts(cfg) == 2
    assert low_noise_window_range(folder, 4) == [1, 4] and low_noise_window_range(folder, 6, span=2) == [2, 4]
    assert low_noise_window_range("/no/such/folder", 4) is None
