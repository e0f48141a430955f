"""The Megatron SD3.5 model equals diffusers' `SD3Transformer2DModel` at tp=2 on spawned gloo ranks (fp32):
forward, every gradient rebuilt from both ranks' shards, and a bit-exact load -> export round trip (the same
check as tests/unit/test_sd3_parity.py at tp=1, `tests.unit.sd3_reference`)."""

from __future__ import annotations

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.rank_pool import run_ranks
from tests.unit import sd3_reference


def _parity(rank: int, world_size: int) -> dict:
    return sd3_reference.parity(build_parallel_groups(ParallelLayout(tp=2)))


def test_tp2_parity_with_diffusers() -> None:
    results = run_ranks(_parity, 2, timeout_s=300)
    for r in results:
        print(f"sd3 fp32 tp2: max abs {r['fwd_abs']:.3g}, rel {r['fwd_rel']:.3g}")
        sd3_reference.check(r)
