"""The engine side of the adapter-only LoRA sync (`megatron_omni/rollout/lora_receiver.py`), on plain tensors:

- `merged_copies` turns the copies of a fused qkv's adapter (A to three modules, B's q/k/v parts, interleaved per
  head on the trainer side) into two copies that write exactly what the per-tensor copies write, and leaves
  alone what does not line up (other storages, overlapping or descending destinations);
- `FlatAdapters` keeps the values and shapes of the tensors it takes in one buffer;
- `CopyPlan` refuses a source whose shape changed since the plan was built.
"""

from __future__ import annotations

import pytest
import torch

from megatron_omni.rollout.lora_receiver import FlatAdapters, LoRARouter, merged_copies
from model_providers.qwen_image.mapping import split_qkv

HEADS, HEAD_DIM, RANK, IN = 4, 3, 2, 5


def _copy(dsts, srcs) -> None:
    torch._foreach_copy_(dsts, srcs)


def test_a_fused_qkv_adapter_copies_as_two_merged_copies() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(RANK, IN, generator=g)
    b = torch.randn(HEADS * 3 * HEAD_DIM, RANK, generator=g)  # Megatron rows per head: q_h, k_h, v_h
    parts = split_qkv(b, HEADS, views=True)  # [heads, head_dim, r] views, no copy
    flat = FlatAdapters([torch.zeros(RANK, IN)] * 3 + [torch.zeros(HEADS * HEAD_DIM, RANK)] * 3)  # A x3, then B x3
    dsts = [flat.views[i] for i in range(3)] + [flat.views[3 + i].view(HEADS, HEAD_DIM, RANK) for i in range(3)]
    srcs = [a, a, a, *parts]
    merged = merged_copies(dsts, srcs)
    assert len(merged[0]) == 2  # A to the three modules (source step 0), then the q, k, v parts of B
    _copy(*merged)
    expected = torch.cat([a.reshape(-1)] * 3 + [p.reshape(-1) for p in split_qkv(b, HEADS)])
    assert torch.equal(flat.buffer, expected)


def test_copies_that_do_not_line_up_stay_separate() -> None:
    g = torch.Generator().manual_seed(1)
    srcs = [torch.randn(2, 3, generator=g) for _ in range(3)]  # three storages: nothing to merge on the source
    buffer = torch.zeros(18)
    dsts = [buffer[12:18].view(2, 3), buffer[0:6].view(2, 3), buffer[6:12].view(2, 3)]  # not in address order
    merged = merged_copies(dsts, srcs)
    assert len(merged[0]) == 3
    _copy(*merged)
    assert torch.equal(buffer, torch.cat([srcs[1].reshape(-1), srcs[2].reshape(-1), srcs[0].reshape(-1)]))
    # destinations that overlap one another are never merged (the source steps match, the copies would not)
    shared = torch.arange(12.0)
    out = torch.zeros(8)
    merged = merged_copies([out[0:6].view(2, 3), out[2:8].view(2, 3)], [shared[0:6].view(2, 3), shared[2:8].view(2, 3)])
    assert len(merged[0]) == 2
    # sources that step backwards while destinations step forwards are not merged either
    src = torch.arange(12.0)
    out = torch.zeros(12)
    merged = merged_copies([out[0:6].view(2, 3), out[6:12].view(2, 3)], [src[6:12].view(2, 3), src[0:6].view(2, 3)])
    assert len(merged[0]) == 2
    _copy(*merged)
    assert torch.equal(out, torch.cat([src[6:12], src[0:6]]))


def test_a_plan_refuses_a_changed_shape() -> None:
    flat = FlatAdapters([torch.zeros(2, 3)])
    router = LoRARouter(lambda key, source: (flat.views[0], None, False))
    state = {"m.lora_A.weight": torch.ones(2, 3)}
    router.plan(state).run(state)
    assert torch.equal(flat.views[0], torch.ones(2, 3))
    with pytest.raises(ValueError, match="shape changed"):
        other = {"m.lora_A.weight": torch.ones(6)}
        router.plan(other).run(other)
