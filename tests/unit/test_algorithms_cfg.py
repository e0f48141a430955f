"""True CFG with per-token norm rescale, against QwenImagePipeline's formula."""

from __future__ import annotations

import torch

from megatron_omni.algorithms.cfg import true_cfg


def test_true_cfg_matches_qwen_image_formula() -> None:
    g = torch.Generator().manual_seed(2)
    pos = torch.randn(2, 6, 16, generator=g)
    neg = torch.randn(2, 6, 16, generator=g)
    # QwenImagePipeline.__call__'s lines, verbatim in meaning
    comb = neg + 4.0 * (pos - neg)
    expected = comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    assert torch.equal(true_cfg(pos, neg, 4.0), expected)
    out = true_cfg(pos, neg, torch.tensor([4.0, 2.0]))
    assert torch.equal(out[0], expected[0])
    torch.testing.assert_close(out.norm(dim=-1), pos.norm(dim=-1))
    # bf16 inputs come back as fp32
    assert true_cfg(pos.bfloat16(), neg.bfloat16(), 3.0).dtype == torch.float32
