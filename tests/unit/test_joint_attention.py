"""Joint attention on one process: the size-1 path, the blockwise ring kernel, and the LSE merge helper.

Everything is compared with `reference_joint_attention`, a plain softmax attention over the
concatenation `[txt ; img]` with a key padding mask for the text (what diffusers' Qwen-Image does).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_omni.models.dit.context_parallel import joint_attention
from megatron_omni.models.dit.cp_ring import (
    attention_block_forward,
    merge_attention_blocks,
    ring_joint_attention,
)


def reference_joint_attention(q_txt, k_txt, v_txt, q_img, k_img, v_img, txt_mask):
    """Explicit softmax attention over `[txt ; img]`; inputs `[s, b, n, d]`, mask `[b, s_txt]`."""
    q = torch.cat([q_txt, q_img]).permute(1, 2, 0, 3)
    k = torch.cat([k_txt, k_img]).permute(1, 2, 0, 3)
    v = torch.cat([v_txt, v_img]).permute(1, 2, 0, 3)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if txt_mask is not None:
        valid = torch.cat([txt_mask, torch.ones(txt_mask.shape[0], k_img.shape[0], dtype=torch.bool)], dim=1)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    out = (torch.softmax(scores, dim=-1) @ v).permute(2, 0, 1, 3)
    return out[: q_txt.shape[0]], out[q_txt.shape[0]:]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def make_inputs(s_txt=5, s_img=24, b=2, n=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    txt = [torch.randn(s_txt, b, n, d, generator=g, dtype=torch.float64) for _ in range(3)]
    img = [torch.randn(s_img, b, n, d, generator=g, dtype=torch.float64) for _ in range(3)]
    mask = torch.ones(b, s_txt, dtype=torch.bool)
    mask[1, 3:] = False
    if b > 2:
        mask[2, :] = False  # a sample with no valid text key at all: only image keys remain
    return txt, img, mask


def _forward_backward(fn, txt, img, mask, dtype):
    leaves = [t.to(dtype).clone().requires_grad_(True) for t in txt + img]
    out_txt, out_img = fn(*leaves, mask)
    g = torch.Generator().manual_seed(1)
    w_txt = torch.randn(out_txt.shape, generator=g, dtype=torch.float64).to(dtype)
    w_img = torch.randn(out_img.shape, generator=g, dtype=torch.float64).to(dtype)
    ((out_txt * w_txt).sum() + (out_img * w_img).sum()).backward()
    return out_txt.detach(), out_img.detach(), [t.grad for t in leaves]


def _blockwise(q_txt, k_txt, v_txt, q_img, k_img, v_img, mask):
    """The ring kernel with no ring: text block + one image block, merged by LSE, custom backward."""
    s_txt = q_txt.shape[0]
    q = torch.cat([q_txt, q_img]).permute(1, 2, 0, 3)
    out = ring_joint_attention(
        q, *(t.permute(1, 2, 0, 3) for t in (k_txt, v_txt, k_img, v_img)), mask,
        1.0 / math.sqrt(q.shape[-1]), None,
    ).permute(2, 0, 1, 3)
    return out[:s_txt], out[s_txt:]


@pytest.mark.parametrize("b", [2, 3])
@pytest.mark.parametrize("impl", ["joint_attention", "blockwise"])
def test_size_one_paths_match_reference(impl, b):
    txt, img, mask = make_inputs(b=b)
    fn = joint_attention if impl == "joint_attention" else _blockwise
    ref = _forward_backward(reference_joint_attention, txt, img, mask, torch.float64)
    got = _forward_backward(fn, txt, img, mask, torch.float32)
    assert rel_err(got[0].double(), ref[0]) < 1e-5
    assert rel_err(got[1].double(), ref[1]) < 1e-5
    for name, g_got, g_ref in zip(["q_txt", "k_txt", "v_txt", "q_img", "k_img", "v_img"], got[2], ref[2]):
        assert rel_err(g_got.double(), g_ref) < 1e-5, name


def test_no_mask_matches_reference():
    txt, img, _ = make_inputs()
    ref = _forward_backward(reference_joint_attention, txt, img, None, torch.float64)
    for fn in (joint_attention, _blockwise):
        got = _forward_backward(fn, txt, img, None, torch.float32)
        assert rel_err(got[0].double(), ref[0]) < 1e-5
        assert rel_err(got[1].double(), ref[1]) < 1e-5
        for g_got, g_ref in zip(got[2], ref[2]):
            assert rel_err(g_got.double(), g_ref) < 1e-5


def test_lse_merge_equals_attention_over_union_of_keys():
    g = torch.Generator().manual_seed(3)
    b, n, sq, d = 2, 3, 7, 8
    q = torch.randn(b, n, sq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, n, 11, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, n, 11, d, generator=g, dtype=torch.float64)
    mask = torch.ones(b, 11, dtype=torch.bool)
    mask[0, :4] = False  # sample 0: the whole first block is masked (lse = -inf there)
    mask[1, 2] = False
    scale = 1 / math.sqrt(d)
    full_out, full_lse = attention_block_forward(q, k, v, mask, scale)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask[:, None, None, :], float("-inf"))
    assert torch.allclose(full_out, torch.softmax(scores, -1) @ v, atol=1e-12)
    assert torch.allclose(full_lse, torch.logsumexp(scores, -1), atol=1e-12)

    out_a, lse_a = attention_block_forward(q, k[:, :, :4], v[:, :, :4], mask[:, :4], scale)
    assert torch.isneginf(lse_a[0]).all() and (out_a[0] == 0).all()
    out_b, lse_b = attention_block_forward(q, k[:, :, 4:], v[:, :, 4:], mask[:, 4:], scale)
    for merged in (
        merge_attention_blocks(out_a, lse_a, out_b, lse_b),
        merge_attention_blocks(out_b, lse_b, out_a, lse_a),
    ):
        assert torch.allclose(merged[0], full_out, atol=1e-12)
        assert torch.allclose(merged[1], full_lse, atol=1e-12)


def test_lse_merge_is_stable_for_large_scores_and_empty_blocks():
    out = torch.tensor([[1.0, 2.0]])
    lse = torch.tensor([1000.0])
    merged, merged_lse = merge_attention_blocks(out, lse, 3 * out, torch.tensor([1000.0]))
    assert torch.allclose(merged, 2 * out)
    assert torch.allclose(merged_lse, torch.tensor([1000.0 + math.log(2)]))
    empty = torch.tensor([float("-inf")])
    merged, merged_lse = merge_attention_blocks(torch.zeros_like(out), empty, torch.zeros_like(out), empty)
    assert torch.isneginf(merged_lse).all() and not merged.isnan().any()


def test_bad_inputs_raise_clear_errors():
    txt, img, mask = make_inputs()
    txt32 = [t.float() for t in txt]
    img32 = [t.float() for t in img]
    with pytest.raises(ValueError, match="txt_mask shape"):
        joint_attention(*txt32, *img32, mask[:, :3])
    with pytest.raises(ValueError, match="must be bool"):
        joint_attention(*txt32, *img32, mask.float())
    with pytest.raises(ValueError, match="image q/k/v shapes differ"):
        joint_attention(*txt32, img32[0], img32[1][:3], img32[2], mask)
    with pytest.raises(ValueError, match="share one dtype"):
        joint_attention(*txt32, *img32[:2], img[2], mask)
    with pytest.raises(ValueError, match=r"\[s, b, n, d\]"):
        joint_attention(txt32[0][0], *txt32[1:], *img32, mask)


@pytest.mark.parametrize("impl", ["joint_attention", "blockwise"])
def test_bf16_inputs_keep_their_dtype_and_stay_close(impl):
    txt, img, mask = make_inputs()
    fn = joint_attention if impl == "joint_attention" else _blockwise
    ref = _forward_backward(reference_joint_attention, txt, img, mask, torch.float64)
    got = _forward_backward(fn, txt, img, mask, torch.bfloat16)
    assert got[0].dtype == got[1].dtype == torch.bfloat16
    assert all(g.dtype == torch.bfloat16 for g in got[2])
    assert rel_err(got[0].double(), ref[0]) < 2e-2
    assert rel_err(got[1].double(), ref[1]) < 2e-2
    for g_got, g_ref in zip(got[2], ref[2]):
        assert rel_err(g_got.double(), g_ref) < 3e-2


def test_image_queries_only_match_the_image_half_of_the_joint_attention():
    """q_txt None (the last block): out_img and the gradients of k/v (text and image) and q_img equal those
    of the full joint attention whose text output gets no gradient; q_txt gets none."""
    txt, img, mask = make_inputs(b=3)
    ref_leaves = [t.clone().requires_grad_(True) for t in txt + img]
    ref_txt, ref_img = reference_joint_attention(*ref_leaves, mask)
    w = torch.randn(ref_img.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    (ref_img * w).sum().backward()
    leaves = [t.float().clone().requires_grad_(True) for t in txt[1:] + img]
    out_txt, out_img = joint_attention(None, *leaves, mask)
    assert out_txt is None
    (out_img * w.float()).sum().backward()
    assert rel_err(out_img.double(), ref_img.detach()) < 1e-5
    for name, got, ref in zip(["k_txt", "v_txt", "q_img", "k_img", "v_img"], leaves, ref_leaves[1:]):
        assert rel_err(got.grad.double(), ref.grad) < 1e-5, name
    with pytest.raises(ValueError, match="text k/v shapes differ"):
        joint_attention(None, leaves[0], leaves[1][:-1], *leaves[2:], None)
