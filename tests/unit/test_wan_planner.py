"""The planner's Wan cost model: a clip's patch grid follows the VAE and patch sizes, and the FLOPs of one
forward equal what torch's FLOP counter measures on diffusers' `WanTransformer3DModel` (matmuls, the patch
convolution and the attention's matmuls), for the tiny preset and a shape with unequal video and text lengths."""

from __future__ import annotations

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
    assert one.train_s <= two.train_s < 1.01 * one.train_s and two.rollout_s == one.rollout_s
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
    assert chosen.layout.ulysses == 2 and chosen.memory.fits
    below = plan_video("wan2.1-t2v-14b", chosen.layout.__class__(), 16, _workload(), precision=prec,
                       recompute="full")
    assert not below.memory.fits  # cp=1 does not: the choice is the smallest
    short = choose_cp("wan2.1-t2v-14b", 16, _workload(frames=17), precision=prec, recompute="full")
    assert short.layout.ulysses == 1  # a short clip needs no CP
    with pytest.raises(LayoutError, match="no Ulysses degree up to 8 fits"):
        choose_cp("wan2.1-t2v-14b", 16, _workload(), precision=Precision(), recompute="none")
