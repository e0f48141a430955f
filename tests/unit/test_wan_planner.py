"""The planner's Wan cost model: a clip's patch grid follows the VAE and patch sizes, and the FLOPs of one
forward equal what torch's FLOP counter measures on diffusers' `WanTransformer3DModel` (matmuls, the patch
convolution and the attention's matmuls), for the tiny preset and a shape with unequal video and text lengths."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from diffusers import WanTransformer3DModel
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_omni.planner.video import video_grid, wan_forward_flops
from model_providers.wan import provider


def test_video_grid_of_a_clip() -> None:
    assert video_grid("wan2.1-t2v-14b", 81, 480, 832) == (21, 30, 52)  # Wan2.1's 5 s 480p clip: 32760 tokens
    assert video_grid("tiny", 9, 32, 48) == (3, 2, 3)
    with pytest.raises(ValueError, match="frames - 1 must be a multiple"):
        video_grid("tiny", 8, 32, 32)
    with pytest.raises(ValueError, match="height 40 must be a positive multiple of 8 \\* 2"):
        video_grid("tiny", 9, 40, 32)


@pytest.mark.parametrize("grid,text", [((3, 2, 3), 7), ((1, 4, 2), 16)])
def test_forward_flops_equal_the_counted_flops(grid: tuple[int, int, int], text: int) -> None:
    cfg = provider.hf_config("tiny")
    model = WanTransformer3DModel(**cfg).eval()
    video = torch.randn(1, cfg["in_channels"], grid[0], 2 * grid[1], 2 * grid[2])
    # the math attention: its two matmuls are counted (the CPU flash kernel has no FLOP formula)
    with FlopCounterMode(display=False) as counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model(hidden_states=video, timestep=torch.tensor([500.0]), encoder_hidden_states=torch.randn(1, text, 32),
              return_dict=False)
    ours = wan_forward_flops("tiny", grid[0] * grid[1] * grid[2], text)
    assert ours.total == counter.get_total_flops()
    assert ours.per_rank(tp=1, cp=2, pp=1) < ours.total  # video tokens and attention divide over CP


def _workload(frames: int = 81, height: int = 480, width: int = 832, **kw):
    from megatron_omni.planner.video import VideoWorkload

    return VideoWorkload(**{**dict(frames=frames, height=height, width=width, text_tokens=512, sampling_steps=20,
                                   window=2, prompts=8, group_size=8, mini_batches=2, micro_batch_size=1), **kw})


def test_video_plan_memory_and_time_follow_the_layout() -> None:
    """Ulysses divides the activations of a long clip and the compute of its tokens; the parameters, gradients
    and optimizer states (Megatron's distributed optimizer shards them over dp x cp) follow tp; Wan2.2's VAE
    compresses 16x in space."""
    from megatron_omni.parallel.layout import LayoutError, ParallelLayout
    from megatron_omni.planner.specs import Precision
    from megatron_omni.planner.video import plan_video

    prec = Precision(distributed_optimizer=True)
    one = plan_video("wan2.1-t2v-14b", ParallelLayout(), 16, _workload(), precision=prec, recompute="none")
    two = plan_video("wan2.1-t2v-14b", ParallelLayout(ulysses=2), 16, _workload(), precision=prec, recompute="none")
    assert one.video_tokens == two.video_tokens == 32760
    assert two.memory.activations < 0.6 * one.memory.activations
    assert two.memory.parameters == one.memory.parameters
    # on the same GPUs CP trades dp for cp: the same update compute, a little more for the replicated text
    # on the same GPUs CP trades dp for cp: the same update compute (a little more for the replicated text), plus
    # Ulysses' all-to-alls (the forward's old log-probs off, so the collectives are the update's)
    one, two = (plan_video("wan2.1-t2v-14b", ParallelLayout(ulysses=u), 16, _workload(recompute_old_logprob=False),
                           precision=prec) for u in (1, 2))
    compute = [p.train_s - p.communication_s for p in (one, two)]
    assert compute[0] <= compute[1] < 1.01 * compute[0] and two.rollout_s == one.rollout_s
    assert two.communication_s > one.communication_s > 0  # + the all-to-alls; dp x cp's optimizer collectives
    tp2 = plan_video("wan2.1-t2v-14b", ParallelLayout(tp=2), 16, _workload(), precision=prec)
    assert tp2.memory.parameters < 0.55 * one.memory.parameters
    assert plan_video("wan2.2-ti2v-5b", ParallelLayout(), 8, _workload(121, 704, 1280), precision=prec).grid == (
        31, 22, 40)
    with pytest.raises(LayoutError, match="frames - 1 must be a multiple"):
        plan_video("tiny", ParallelLayout(), 1, _workload(8, 32, 32, prompts=1, group_size=2, mini_batches=1))
    with pytest.raises(LayoutError, match="not divisible"):
        plan_video("tiny", ParallelLayout(ring=5), 5, _workload(9, 32, 32))


def test_choose_cp_is_the_smallest_ulysses_degree_that_fits() -> None:
    from megatron_omni.parallel.layout import LayoutError
    from megatron_omni.planner.specs import Precision
    from megatron_omni.planner.video import choose_cp, plan_video

    prec = Precision(distributed_optimizer=True)
    chosen = choose_cp("wan2.1-t2v-14b", 16, _workload(), precision=prec, recompute="full")
    # with the text encoder (umT5-XXL) and the VAE resident beside the engine's transformer: 4 (3 does not divide
    # 40 heads)
    assert chosen.layout.ulysses == 4 and chosen.memory.fits
    for u in (1, 2):
        below = plan_video("wan2.1-t2v-14b", chosen.layout.__class__(ulysses=u), 16, _workload(), precision=prec,
                           recompute="full")
        assert not below.memory.fits  # the choice is the smallest
    short = choose_cp("wan2.1-t2v-14b", 16, _workload(frames=17), precision=prec, recompute="full")
    assert short.layout.ulysses == 1  # a short clip needs no CP
    with pytest.raises(LayoutError, match="no Ulysses degree up to 8 fits"):
        choose_cp("wan2.1-t2v-14b", 16, _workload(), precision=Precision(), recompute="none")


def test_video_plan_counts_cfg_text_encoder_and_vae() -> None:
    """True CFG doubles the rollout's and the update's transformer rows; the text encoder (umT5-XXL) and the VAE
    (Wan2.2's for the 48-channel TI2V-5B) are resident beside the engine and their FLOPs are in the rollout; the
    constants are diffusers' / transformers' modules counted on the meta device."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    from megatron_omni.parallel.layout import ParallelLayout
    from megatron_omni.planner.specs import Precision
    from megatron_omni.planner.video import UMT5_XXL_PARAMS, WAN_VAES, plan_video
    from model_providers.wan.provider import parameter_count

    with torch.device("meta"):
        te = UMT5EncoderModel(UMT5Config(vocab_size=256384, d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                         num_heads=64, feed_forward_proj="gated-gelu"))
        vae22 = AutoencoderKLWan(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12,
                                 out_channels=12, patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48,
                                 latents_std=[1.0] * 48)
        vae21 = AutoencoderKLWan()
    assert sum(p.numel() for p in te.parameters()) == UMT5_XXL_PARAMS
    assert sum(p.numel() for p in vae22.parameters()) == WAN_VAES[48].params
    assert sum(p.numel() for p in vae21.parameters()) == WAN_VAES[16].params
    prec = Precision(distributed_optimizer=True)
    work = _workload(121, 704, 1280, recompute_old_logprob=False)
    plain = plan_video("wan2.2-ti2v-5b", ParallelLayout(), 8, work, precision=prec)
    guided = plan_video("wan2.2-ti2v-5b", ParallelLayout(), 8, replace(work, cfg=True), precision=prec)
    dit = [p.rollout_s - p.vae_s - p.text_encoder_s for p in (plain, guided)]
    assert guided.vae_s == plain.vae_s > 0 and guided.text_encoder_s > plain.text_encoder_s > 0
    assert abs(dit[1] / dit[0] - 2) < 1e-9
    assert guided.memory.activations > 1.9 * plain.memory.activations
    assert plain.memory.rollout_weights == 2 * (parameter_count("wan2.2-ti2v-5b") + UMT5_XXL_PARAMS
                                                + WAN_VAES[48].params)
    # `rollout.vae_dtype=fp32` under a bf16 rollout (flow_grpo's): the resident VAE at 4 bytes a parameter
    fp32_vae = plan_video("wan2.2-ti2v-5b", ParallelLayout(), 8, work, precision=prec, vae_bytes=4)
    assert fp32_vae.memory.rollout_weights - plain.memory.rollout_weights == 2 * WAN_VAES[48].params
