"""bf16 mixed precision: our model equals diffusers' transformer in bf16 bit for bit, the trainer's bf16
recompute equals the bf16 rollout's log-probs, the trainer holds bf16 weights with fp32 main params, and a
train/rollout gap above `algorithm.max_logp_gap` stops the step with an error naming it.

World size 1 in this process (gloo)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from megatron_omni.algorithms.schedule import model_timesteps
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.trainer.flowgrpo import LogpGapError
from model_providers.qwen_image import provider
from tests.unit.tiny_trainer import tiny_trainer

GRID = (1, 4, 6)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory: pytest.TempPathFactory):
    from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline

    platform.init_distributed(rank=0, world_size=1)
    yield make_tiny_pipeline(tmp_path_factory.mktemp("bf16") / "pipeline", seed=0)
    platform.destroy_distributed()


def test_bf16_model_equals_diffusers_bit_for_bit(pipeline) -> None:
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**provider.hf_config("tiny"))
    with torch.no_grad():
        for p in ref.parameters():  # adaLN starts at zero in diffusers: weights that make signal
            p.normal_(0.0, 0.2)
    ref = ref.to(torch.bfloat16)
    groups = build_parallel_groups(ParallelLayout())
    seed_everything(0)
    model = provider.build_model(provider.transformer_config("tiny", params_dtype=torch.bfloat16), groups)
    provider.load_hf_state_dict(model, ref.state_dict())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    cfg = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(1)
    s_img = GRID[0] * GRID[1] * GRID[2]
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[1, 4:] = 0
    inputs = dict(hidden_states=torch.randn(3, s_img, cfg["in_channels"], generator=g).bfloat16(),
                  encoder_hidden_states=torch.randn(3, 7, cfg["joint_attention_dim"], generator=g).bfloat16(),
                  encoder_hidden_states_mask=mask,
                  timestep=model_timesteps(torch.tensor([1.0, 0.61, 0.137]), torch.bfloat16),
                  img_shapes=[[GRID]] * 3, return_dict=False)
    with torch.no_grad():
        want = ref(**inputs)[0]
        got = DiffusersForward(model)(**inputs)[0]
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want), float((got.float() - want.float()).abs().max())
    # The rounding order of the QK norms matters: torch's nn.RMSNorm (one rounding) gives other velocities.
    for layer in model.layers:
        for stream in (layer.img, layer.txt):
            for name in ("q_layernorm", "k_layernorm"):
                norm = torch.nn.RMSNorm(cfg["attention_head_dim"], eps=1e-6, dtype=torch.bfloat16)
                norm.weight.data.copy_(getattr(stream, name).weight)
                setattr(stream, name, norm)
    with torch.no_grad():
        assert not torch.equal(DiffusersForward(model)(**inputs)[0], want)


BF16 = ("model.params_dtype=bf16", "rollout.dtype=bf16", "rollout.transformer=engine")


@pytest.mark.parametrize("cfg,bound", [((), 2e-6), (("rollout.guidance_scale=3", "rollout.negative_prompt= "), 5e-5)],
                         ids=["no_cfg", "cfg"])
def test_bf16_recompute_equals_the_bf16_rollout(pipeline, cfg: tuple[str, ...], bound: float) -> None:
    # rollout.transformer=engine: the engine samples with its diffusers transformer, the trainer recomputes
    # with the Megatron model, two implementations in bf16.
    trainer = tiny_trainer(pipeline, *BF16, *cfg)
    assert not trainer.shares_model and trainer.engine.transformer.dtype == torch.bfloat16
    assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
    # Megatron-Core's mixed precision: the optimizer steps fp32 copies of the bf16 parameters.
    main = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    assert main and {p.dtype for p in main} == {torch.float32}
    m = trainer.train_step(0).metrics
    assert m["train_rollout_dlogp"] <= bound and m["train_rollout_dlogp_max"] >= m["train_rollout_dlogp"], m
    assert m["grad_norm"] > 0
    # The update moved the bf16 weights the engine now holds (synced through the bridge) ...
    m1 = trainer.train_step(1).metrics
    assert m1["train_rollout_dlogp"] <= bound, m1
    # ... and the check can fail: other weights in the trainer's model show up in the recomputed log-probs.
    with torch.no_grad():
        trainer.model.proj_out.weight.mul_(1.05)
    prompts, _, seeds = trainer.step_prompts(2)
    traj = trainer.rollout([p for p in prompts for _ in range(2)], seeds)[0]
    assert trainer.logp_gap(trainer.old_log_probs(traj, 2), traj.log_probs, 2)[0] > 1e-4  # both bounds below


def test_a_gap_above_max_logp_gap_stops_the_step(pipeline) -> None:
    # A bf16 engine against an fp32 trainer: a gap of ~1e-4, far above the bound.
    trainer = tiny_trainer(pipeline, "rollout.dtype=bf16", "algorithm.max_logp_gap=1e-7")
    with pytest.raises(LogpGapError, match=r"step 0: mean \|logp_trainer - logp_rollout\| = .* exceeds "
                                           r"algorithm.max_logp_gap = 1.000e-07") as info:
        trainer.train_step(0)
    assert isinstance(info.value, RuntimeError) and info.value.step == 0 and info.value.mean > 1e-7


def test_text_length_pads_every_call_alike(pipeline) -> None:
    from megatron_omni.rollout.base import SamplingParams
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine

    engine = DiffusersRolloutEngine(pipeline, max_batch_size=2, dtype=torch.bfloat16)
    base = SamplingParams(height=32, width=32, num_steps=2, window_size=1, guidance_scale=2.0, negative_prompt=" ")
    short, long = ["a cat"], ["a photo of a cat on a mat next to a red cube"]
    # Without it each call pads to its own longest prompt ...
    lengths = {engine.generate(p, base, seeds=[0]).prompt_embeds.shape[1] for p in (short, long)}
    assert len(lengths) == 2
    # ... with it, both calls (text and negative text) pad to the same length, which the recompute then sees.
    params = replace(base, text_length=max(lengths) + 3)
    for p in (short, long):
        traj = engine.generate(p, params, seeds=[0])
        assert traj.prompt_embeds.shape[1] == traj.negative_prompt_embeds.shape[1] == max(lengths) + 3
    with pytest.raises(ValueError, match="more than text_length=2"):
        engine.generate(long, replace(base, text_length=2), seeds=[0])
    with pytest.raises(ValueError, match="text_length must be in"):
        replace(base, text_length=1000)
