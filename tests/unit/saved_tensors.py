"""What one block saves for its backward, measured with saved-tensor hooks: the planners' activation constants are
checked against it (tests/unit/test_planner.py for Qwen-Image, tests/distributed/test_planner_memory_allocated.py
for SD3.5 and FLUX.1)."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def block_saved_bytes(layer: torch.nn.Module, args: tuple, recompute: str, excluded: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages autograd saves while `layer(*args)` builds its graph (under `recompute="full"`
    through Megatron-Core's checkpoint, as the models run a block then), leaving out the storages of `excluded`
    (the parameters, and tensors every block shares such as the RoPE rotations). The backward of the outputs' sum
    then runs, so the saved set is shown usable."""
    from megatron.core import tensor_parallel

    skip = {t.untyped_storage().data_ptr() for t in excluded}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outs = tensor_parallel.checkpoint(layer, False, *args) if recompute == "full" else layer(*args)
    sum(o.sum() for o in outs).backward()
    return sum(seen.values())
