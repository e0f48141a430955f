"""The edit rollout engine (`rollout/diffusers_engines/edit.py`) samples what diffusers' `QwenImageEditPlusPipeline`
samples, and the trainer's Megatron model recomputes its log-probs from the Trajectory's source latents.

- ODE (no noise): the engine's image equals the pipeline's for the same record and seed, and the source tokens the
  trajectory carries are the ones the pipeline appended to its image stream (bit-equal); the same with true CFG
  (`true_cfg_scale` and a negative prompt) over a record of two source images of different grids, where the
  trajectory's negative embedding is the one the pipeline encoded with both sources.
- SDE window with true CFG: the Megatron model (same weights, TP 1 and TP 2 on the shared 2-rank pool) recomputes
  the rollout's log-probs to a mean |dlogp| under 1e-6 (fp32); with the sources' tokens zeroed, or the guidance
  dropped, it does not (the recompute reads both).
- Conversion: the edit folder's transformer goes to a Megatron checkpoint and back bit-equal (the qwen_image family).
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import numpy as np
import pytest
import torch
from PIL import Image

from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.rollout.base import SamplingParams
from megatron_omni.rollout.diffusers_engines.edit import EditRolloutEngine
from megatron_omni.rollout.registry import EngineSettings, build_engine
from model_providers.qwen_image import provider
from model_providers.qwen_image_edit.data import EditRecord
from model_providers.qwen_image_edit.tiny_pipeline import make_tiny_edit_pipeline

SDE = SamplingParams(height=64, width=64, num_steps=4, window_size=2, noise_level=1.2)
SDE_CFG = SamplingParams(height=64, width=64, num_steps=4, window_size=2, noise_level=1.2, guidance_scale=3.0,
                         negative_prompt=" ")


@pytest.fixture(scope="module")
def edit_setup(tmp_path_factory) -> tuple[str, list[str]]:
    root = tmp_path_factory.mktemp("edit")
    folder = str(make_tiny_edit_pipeline(root / "tiny-edit", seed=0))
    rng = np.random.RandomState(0)
    prompts, paths = [], []
    for i, (size, word) in enumerate([((64, 64), "CAT"), ((80, 64), "DOG"), ((128, 64), "")]):
        path = root / f"src{i}.png"
        Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8")).save(path)
        paths.append(str(path))
        if word:
            prompts.append(EditRecord(str(path), f"write {word}", {"word": word}).prompt)
    # two sources, the second on another grid (2 x 6 patches after the first's 4 x 4)
    prompts.append(EditRecord((paths[1], paths[2]), "write the word of picture 2 on picture 1").prompt)
    return folder, prompts


def _pipeline_run(engine, record: EditRecord, seed: int, **kwargs) -> tuple[torch.Tensor, list]:
    """diffusers' QwenImageEditPlusPipeline on `record` (the folder's edit areas), its ODE image and every
    transformer forward's (hidden_states, encoder_hidden_states, img_shapes)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    seen = []
    pipe = engine.pipe
    forward = pipe.transformer.forward

    def spy(*args, **kw):
        seen.append((kw["hidden_states"].clone(), kw["encoder_hidden_states"].clone(), kw["img_shapes"]))
        return forward(*args, **kw)

    with mock.patch.object(plus, "VAE_IMAGE_SIZE", engine.areas.vae_area), \
            mock.patch.object(plus, "CONDITION_IMAGE_SIZE", engine.areas.condition_area), \
            mock.patch.object(pipe.transformer, "forward", spy):
        ref = pipe(image=record.load_images(), prompt=record.instruction, height=64, width=64,
                   num_inference_steps=SDE.num_steps, generator=torch.Generator().manual_seed(seed),
                   output_type="pt", **kwargs).images
    return ref.float(), seen


def test_engine_samples_what_the_edit_pipeline_samples(edit_setup) -> None:
    folder, prompts = edit_setup
    engine = build_engine("diffusers", folder, EngineSettings(max_batch_size=4))
    assert isinstance(engine, EditRolloutEngine)
    record = EditRecord.parse(prompts[1])
    traj = engine.generate([prompts[1]], SDE.ode(), seeds=[5])
    assert traj.cond_shapes == ((1, 4, 4),) and traj.cond_latents.shape == (1, 16, 64)
    ref, seen = _pipeline_run(engine, record, 5)
    hidden, _, img_shapes = seen[0]
    assert img_shapes == [[(1, 4, 4), *traj.cond_shapes]]
    assert torch.equal(hidden[:, 16:], traj.cond_latents)
    err = float((traj.images - ref).abs().max())
    print(f"edit engine vs QwenImageEditPlusPipeline, ODE image: max |diff| {err:.2e}")
    assert err < 1e-4, err

    # True CFG over two sources: the pipeline's true_cfg_scale with a negative prompt, norm-preserving rescale.
    two = EditRecord.parse(prompts[2])
    traj = engine.generate([prompts[2]], SDE_CFG.ode(), seeds=[7])
    assert traj.cond_shapes == ((1, 4, 4), (1, 2, 6)) and traj.cond_latents.shape == (1, 28, 64)
    assert float(traj.guidance_scale[0]) == 3.0 and traj.cfg_rescale
    ref, seen = _pipeline_run(engine, two, 7, true_cfg_scale=3.0, negative_prompt=" ")
    assert len(seen) == 2 * SDE.num_steps  # the conditional and the negative forward per step
    (hidden, text, img_shapes), (neg_hidden, neg_text, _) = seen[:2]
    assert img_shapes == [[(1, 4, 4), (1, 4, 4), (1, 2, 6)]]
    assert torch.equal(hidden[:, 16:], traj.cond_latents) and torch.equal(neg_hidden, hidden)
    n_pos, n_neg = int(traj.prompt_embeds_mask[0].sum()), int(traj.negative_prompt_embeds_mask[0].sum())
    assert torch.equal(text[0], traj.prompt_embeds[0, :n_pos]) and torch.equal(neg_text[0],
                                                                              traj.negative_prompt_embeds[0, :n_neg])
    unguided = engine.generate([prompts[2]], SDE.ode(), seeds=[7]).images
    err = float((traj.images - ref).abs().max())
    moved = float((unguided - ref).abs().max())
    print(f"edit engine vs QwenImageEditPlusPipeline, true CFG 3 over two sources, ODE image: max |diff| {err:.2e} "
          f"(CFG moves the image by {moved:.2e})")
    assert err < 1e-4 and moved > 100 * max(err, 1e-6), (err, moved)


def _dlogp(rank: int, world_size: int, folder: str, prompts: list[str], tp: int) -> dict[str, float]:
    engine = EditRolloutEngine(folder, max_batch_size=4)
    groups = build_parallel_groups(ParallelLayout(tp=tp))
    seed_everything(0, tp_rank=groups.tp.rank())
    model = provider.build_model(provider.transformer_config(dict(engine.transformer.config), tp=tp), groups)
    provider.load_hf_state_dict(model, engine.initial_state_dict())
    velocity = DiffusersForward(model)
    # One grid per call: the 64 x 64 source only (the 80 x 64 one encodes to the same grid, both join).
    traj = engine.generate(prompts[:2], SDE_CFG, group_size=2, seeds=[11, 12, 13, 14])
    with torch.no_grad():
        rec = recompute_log_probs(traj, velocity)
        unguided = recompute_log_probs(dataclasses.replace(traj, guidance_scale=torch.ones_like(traj.guidance_scale)),
                                       velocity)
        traj.cond_latents = torch.zeros_like(traj.cond_latents)
        blind = recompute_log_probs(traj, velocity)
    return {"dlogp": float((rec.log_probs - traj.log_probs).abs().mean()),
            "blind": float((blind.log_probs - traj.log_probs).abs().mean()),
            "unguided": float((unguided.log_probs - traj.log_probs).abs().mean()), "window": traj.window_size}


@pytest.mark.parametrize("tp", [1, 2])
def test_megatron_recompute_sees_the_rollouts_sources(edit_setup, tp: int) -> None:
    folder, prompts = edit_setup
    results = run_ranks(_dlogp, 2, folder, prompts, tp, timeout_s=400)
    for r in results:
        print(f"edit recompute tp{tp}, true CFG 3: mean |dlogp| {r['dlogp']:.2e}; sources zeroed {r['blind']:.2e}; "
              f"guidance dropped {r['unguided']:.2e}")
        assert r["window"] == 2
        assert r["dlogp"] < 1e-6, r
        assert r["blind"] > 100 * max(r["dlogp"], 1e-8), r
        assert r["unguided"] > 20 * max(r["dlogp"], 1e-8), r  # tp 2: 6.2e-6 against 6.0e-8


def test_edit_folder_converts_through_qwen_image_and_back(edit_setup, tmp_path) -> None:
    """An edit pipeline's transformer converts like Qwen-Image's (one diffusers class, one conversion family): to a
    Megatron checkpoint and back into a complete edit pipeline folder, every tensor bit-equal."""
    import json
    from pathlib import Path

    from megatron_omni.checkpoint.convert import hf_to_mcore, mcore_to_hf
    from tests.unit.test_checkpoint_convert import tensor_hashes

    folder = Path(edit_setup[0])
    hf_to_mcore(folder, tmp_path / "mcore", progress=False)
    mcore_to_hf(tmp_path / "mcore", tmp_path / "back", pipeline_source=folder, progress=False)
    assert tensor_hashes(tmp_path / "back" / "transformer") == tensor_hashes(folder / "transformer")
    index = json.loads((tmp_path / "back" / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and (tmp_path / "back" / "edit_config.json").is_file()
    assert isinstance(build_engine("diffusers", str(tmp_path / "back"), EngineSettings()), EditRolloutEngine)
