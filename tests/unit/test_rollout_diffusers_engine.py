"""DiffusersRolloutEngine: parity with QwenImagePipeline, batching invariance, log-prob recompute,
continuous batching, prompt cache, weight loading, velocity-model injection."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from diffusers import QwenImagePipeline

from megatron_omni.algorithms.transition import recompute_log_probs
from megatron_omni.rollout.base import RolloutEngine, SamplingParams
from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

PROMPTS = ["a red cat", "OPEN 24 HOURS"]
NON_CFG = SamplingParams(height=64, width=64, num_steps=6, noise_level=1.2, window_size=2, window_range=(0, 4))
CFG = replace(NON_CFG, guidance_scale=4.0, negative_prompt=" ")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return make_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "pipe", seed=0)


@pytest.fixture(scope="module")
def engine(folder: Path) -> DiffusersRolloutEngine:
    return DiffusersRolloutEngine(folder, max_batch_size=3)


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "cfg"])
def test_ode_matches_qwen_image_pipeline(folder: Path, engine: DiffusersRolloutEngine, cfg: bool) -> None:
    """noise_level 0 is the pipeline's own Euler sampler: same seeds, same images."""
    params = (CFG if cfg else NON_CFG).ode()
    seeds = [11, 12, 13, 14]
    traj = engine.generate(PROMPTS, params, group_size=2, seeds=seeds)
    assert traj.log_probs.shape == (4, 0) and traj.noise_level == 0.0
    pipe = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    ref = pipe(
        [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2,
        negative_prompt=[" "] * 4 if cfg else None,
        true_cfg_scale=4.0 if cfg else 1.0,
        height=64,
        width=64,
        num_inference_steps=params.num_steps,
        generator=[torch.Generator().manual_seed(s) for s in seeds],
        output_type="pt",
    ).images
    torch.testing.assert_close(traj.images, ref, rtol=0, atol=2e-5)


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "cfg"])
def test_stepwise_batching_equals_one_at_a_time(folder: Path, engine: DiffusersRolloutEngine, cfg: bool) -> None:
    params = CFG if cfg else NON_CFG
    batched = engine.generate(PROMPTS, params, group_size=3, seeds=range(100, 106))
    single = DiffusersRolloutEngine(folder, max_batch_size=1).generate(
        PROMPTS, params, group_size=3, seeds=range(100, 106)
    )
    assert torch.equal(batched.window_start, single.window_start)
    assert len(set(batched.window_start.tolist())) > 1  # windows drawn per sample from the seed
    torch.testing.assert_close(batched.images, single.images, rtol=0, atol=1e-5)
    torch.testing.assert_close(batched.latents, single.latents, rtol=0, atol=1e-5)
    assert float((batched.log_probs - single.log_probs).abs().max()) < 1e-6
    # the samples of one group differ (different seeds), the same seed reproduces
    assert float((batched.images[0] - batched.images[1]).abs().max()) > 1e-2
    again = engine.generate(PROMPTS[:1], params, group_size=1, seeds=[100])
    torch.testing.assert_close(again.images[0], batched.images[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("cfg", [False, True], ids=["no_cfg", "cfg"])
@pytest.mark.parametrize("sde_type", ["sde", "cps", "dance_sde"])
def test_recorded_log_probs_equal_recompute(engine: DiffusersRolloutEngine, cfg: bool, sde_type: str) -> None:
    params = replace(CFG if cfg else NON_CFG, sde_type=sde_type, noise_level=0.7 if sde_type == "cps" else 1.2)
    traj = engine.generate(PROMPTS, params, group_size=3, seeds=range(6))
    assert traj.log_probs.shape == (6, 2) and torch.isfinite(traj.log_probs).all()
    with torch.no_grad():
        rec = recompute_log_probs(traj, engine.transformer, batch_size=4)
        # the check can fail: other prompts' embeddings (and, with CFG, no guidance) move the log-probs
        swapped = replace(
            traj, prompt_embeds=traj.prompt_embeds.flip(0), prompt_embeds_mask=traj.prompt_embeds_mask.flip(0)
        )
        changed = [recompute_log_probs(swapped, engine.transformer)]
        if cfg:
            changed.append(recompute_log_probs(replace(traj, guidance_scale=torch.ones(6)), engine.transformer))
    assert float((rec.log_probs - traj.log_probs).abs().max()) < 1e-6
    for c in changed:
        assert float((c.log_probs - traj.log_probs).abs().max()) > 1e-5


def test_transitions_are_consistent(engine: DiffusersRolloutEngine) -> None:
    traj = engine.generate(PROMPTS, NON_CFG, group_size=2, seeds=range(4))
    # x_{t+1} of window step j is x_t of step j + 1
    assert torch.equal(traj.next_latents[:, 0], traj.latents[:, 1])
    steps = traj.step_indices
    assert steps.shape == (4, 2) and int(steps.max()) < NON_CFG.num_steps
    assert traj.sigmas.shape == (4, NON_CFG.num_steps + 1) and float(traj.sigmas[0, 0]) == 1.0
    sub = traj.select([3, 1])
    assert sub.prompts == [traj.prompts[3], traj.prompts[1]] and torch.equal(sub.latents[0], traj.latents[3])
    assert traj.group_ids.tolist() == [0, 0, 1, 1]


def test_continuous_batching_join_and_leave(folder: Path) -> None:
    """Samples with different step counts share forwards; leavers are replaced between steps."""
    eng = DiffusersRolloutEngine(folder, max_batch_size=2)
    long = replace(NON_CFG, num_steps=6, window_range=(0, 3))
    short = replace(NON_CFG, num_steps=3, window_range=(0, 3))
    text = eng.encode_prompts(PROMPTS)
    order = []
    samples = [
        eng._new_sample(0, PROMPTS[0], 0, 5, long, text[0], None),
        eng._new_sample(1, PROMPTS[1], 1, 6, short, text[1], None),
        eng._new_sample(2, PROMPTS[1], 1, 7, short, text[1], None),
    ]
    done = eng.run(samples, on_finish=lambda s: order.append(s.index))
    assert order == [1, 0, 2] or order == [1, 2, 0]
    assert eng.stats["forwards"] == 6  # 3 steps of (0, 1), then 3 of (0, 2); sequential would be 12
    solo = DiffusersRolloutEngine(folder, max_batch_size=1)
    for s in done:
        ref = solo.run([solo._new_sample(s.index, s.prompt, 0, s.seed, s.params, s.text, None)])[0]
        torch.testing.assert_close(s.image, ref.image, rtol=0, atol=1e-5)
        assert float((torch.stack(s.rec_log_probs) - torch.stack(ref.rec_log_probs)).abs().max()) < 1e-6


def test_prompt_cache_matches_pipeline_encoding(folder: Path) -> None:
    eng = DiffusersRolloutEngine(folder)
    embeds = eng.encode_prompts(["a red cat", "OPEN 24 HOURS", "a red cat"])
    assert eng.stats == {"forwards": 0, "forward_rows": 0, "cache_hits": 1, "cache_misses": 2}
    assert embeds[0] is embeds[2]
    eng.encode_prompts(["a red cat"])
    assert eng.stats["cache_hits"] == 2
    pipe = QwenImagePipeline.from_pretrained(folder, local_files_only=True)
    for text, ours in zip(["a red cat", "OPEN 24 HOURS"], embeds):
        ref, _ = pipe.encode_prompt(text, device=torch.device("cpu"), max_sequence_length=1024)
        torch.testing.assert_close(ours, ref[0].float(), rtol=1e-5, atol=1e-5)


def test_uncached_encoding_is_differentiable_and_clearing_the_cache_sees_new_weights(folder: Path) -> None:
    """What a pretraining loop that trains the text encoder relies on: `encode_token_ids` equals the cached
    encoding and carries gradients to the encoder; after the encoder changes, `clear_prompt_cache` makes
    `encode_prompts` return the new encoder's embeddings instead of stale ones."""
    eng = DiffusersRolloutEngine(folder)
    cached = eng.encode_prompts(PROMPTS)
    keys = [eng.token_ids(p) for p in PROMPTS]
    fresh = eng.encode_token_ids(keys)
    for a, b in zip(cached, fresh):
        torch.testing.assert_close(b.float(), a, rtol=0, atol=0)
    embedding = eng.pipe.text_encoder.get_input_embeddings().weight
    embedding.requires_grad_(True)
    sum(e.sum() for e in fresh).backward()
    rows = sorted({t for k in keys for t in k})
    assert embedding.grad is not None and float(embedding.grad[rows].abs().sum()) > 0
    with torch.no_grad():
        embedding.add_(0.5)
    assert torch.equal(eng.encode_prompts(PROMPTS)[0], cached[0])  # stale until cleared
    eng.clear_prompt_cache()
    assert not torch.allclose(eng.encode_prompts(PROMPTS)[0], cached[0], atol=1e-3)


def test_streams_each_sample(engine: DiffusersRolloutEngine) -> None:
    got = []
    traj = engine.generate(PROMPTS, NON_CFG, group_size=2, seeds=range(4), on_sample=got.append)
    assert sorted(s.index for s in got) == [0, 1, 2, 3]
    for s in got:
        assert torch.equal(s.image, traj.images[s.index]) and s.prompt == traj.prompts[s.index]


def test_injected_velocity_model_is_used(folder: Path, engine: DiffusersRolloutEngine) -> None:
    calls = []

    def model(**kwargs):
        calls.append(kwargs["hidden_states"].shape[0])
        return engine.transformer(**kwargs)

    eng = DiffusersRolloutEngine(folder, max_batch_size=4, velocity_model=model)
    traj = eng.generate(PROMPTS, CFG, group_size=2, seeds=range(4))
    assert calls == [8] * CFG.num_steps  # 4 conditional + 4 negative rows per forward
    ref = engine.generate(PROMPTS, CFG, group_size=2, seeds=range(4))
    torch.testing.assert_close(traj.log_probs, ref.log_probs, rtol=0, atol=1e-6)


def test_load_weights_round_trip(tmp_path: Path, folder: Path) -> None:
    other_folder = make_tiny_pipeline(tmp_path / "seed1", seed=1)
    target = DiffusersRolloutEngine(other_folder)
    source = DiffusersRolloutEngine(folder)
    before = target.generate(PROMPTS, NON_CFG, seeds=[0, 1])
    names = target.load_weights(("transformer." + k, v) for k, v in source.transformer.state_dict().items())
    assert len(names) == len(source.transformer.state_dict())
    after = target.generate(PROMPTS, NON_CFG, seeds=[0, 1])
    # transformer weights now those of seed 0; VAE/text encoder still seed 1's
    assert float((after.latents - before.latents).abs().max()) > 1e-3
    src = DiffusersRolloutEngine(folder, velocity_model=target.transformer)
    ref = src.generate(PROMPTS, NON_CFG, seeds=[0, 1])
    torch.testing.assert_close(source.generate(PROMPTS, NON_CFG, seeds=[0, 1]).latents, ref.latents)
    with pytest.raises(KeyError, match="nope"):
        target.load_weights([("transformer.nope.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        target.load_weights([("img_in.weight", torch.zeros(3, 3))])


def test_protocol_and_errors(engine: DiffusersRolloutEngine) -> None:
    assert isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match="negative_prompt"):
        SamplingParams(guidance_scale=3.0)
    with pytest.raises(ValueError, match="multiples of 16"):
        engine.generate(PROMPTS, replace(NON_CFG, height=40))
    with pytest.raises(ValueError, match="seeds"):
        engine.generate(PROMPTS, NON_CFG, group_size=2, seeds=[1, 2])
    with pytest.raises(ValueError, match="window"):
        replace(NON_CFG, window_range=(0, 12))
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, NON_CFG)
    engine.wake_up()
