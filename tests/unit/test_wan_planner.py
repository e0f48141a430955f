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
