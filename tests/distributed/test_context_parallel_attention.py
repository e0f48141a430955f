"""Context-parallel joint attention (Ulysses, ring, both) on gloo ranks against one-process attention.

Each rank builds the layout's process groups with `build_parallel_groups`, takes its image shard (CP
rank c = u + U r), runs `joint_attention` forward and backward with its own local loss, and returns
outputs and input gradients. The test process checks, against a float64 softmax attention over the
full sequence with the total loss (the sum of the ranks' local losses):
- every rank's text output equals the full text output; the image shards concatenate to the full one;
- text input gradients summed over the CP ranks equal the full gradients; image gradients are slices.
Several layouts run per spawn, because starting ranks (importing torch) dominates the time.
"""

from __future__ import annotations

import pytest
import torch

from megatron_omni.parallel.rank_pool import run_ranks
from tests.unit.test_joint_attention import make_inputs, reference_joint_attention, rel_err

# Batch of 3: sample 1 has padded text, sample 2 no valid text key at all (see make_inputs).
S_TXT, S_IMG, BATCH, HEADS, HEAD_DIM = 5, 24, 3, 4, 8
NAMES = ["q_txt", "k_txt", "v_txt", "q_img", "k_img", "v_img"]


def _loss_weights(out_txt_shape, out_img_full_shape, cp):
    """Per-rank text loss weights (they differ, so a wrong text gradient sum shows) and image weights."""
    g = torch.Generator().manual_seed(7)
    w_txt = [torch.randn(out_txt_shape, generator=g, dtype=torch.float64) for _ in range(cp)]
    w_img = torch.randn(out_img_full_shape, generator=g, dtype=torch.float64)
    return w_txt, w_img


def _run_layouts(rank: int, world_size: int, layouts: list[tuple[int, int]]) -> dict:
    import torch.distributed as dist

    from megatron_omni.models.dit.context_parallel import joint_attention
    from megatron_omni.parallel.groups import build_parallel_groups
    from megatron_omni.parallel.layout import ParallelLayout

    results = {}
    txt, img, mask = make_inputs(S_TXT, S_IMG, BATCH, HEADS, HEAD_DIM)
    for ulysses, ring in layouts:
        groups = build_parallel_groups(ParallelLayout(ulysses=ulysses, ring=ring))
        u, r = dist.get_rank(groups.ulysses), dist.get_rank(groups.ring)
        cp_rank = u + ulysses * r
        # The shard order joint_attention assumes must be the CP group's own rank order.
        assert cp_rank == dist.get_rank(groups.cp), (cp_rank, dist.get_rank(groups.cp))
        s_local = S_IMG // (ulysses * ring)
        shard = slice(cp_rank * s_local, (cp_rank + 1) * s_local)
        for masked, text_queries in ((True, True), (False, True), (True, False)):
            leaves = [t.float().clone().requires_grad_(True) for t in txt]
            leaves += [t[shard].float().clone().requires_grad_(True) for t in img]
            w_txt, w_img = _loss_weights(txt[0].shape, img[0].shape, ulysses * ring)
            out_txt, out_img = joint_attention(
                leaves[0] if text_queries else None, *leaves[1:], mask if masked else None,
                ulysses_group=groups.ulysses if ulysses > 1 else None,
                ring_group=groups.ring if ring > 1 else None,
            )
            loss = (out_img * w_img[shard].float()).sum()
            if text_queries:
                loss = loss + (out_txt * w_txt[cp_rank].float()).sum()
            else:
                assert out_txt is None
            loss.backward()
            results[(ulysses, ring, masked, text_queries)] = {
                "cp_rank": cp_rank,
                "out_txt": None if out_txt is None else out_txt.detach(),
                "out_img": out_img.detach(),
                "grads": [t.grad for t in leaves],
            }
        dist.barrier()
    return results


def _check_layout(per_rank: list[dict], ulysses: int, ring: int, masked: bool, text_queries: bool = True) -> None:
    """text_queries False: joint_attention ran without text queries (the last block); its image output and
    the gradients of everything but q_txt must equal the full attention's with no loss on the text output."""
    cp = ulysses * ring
    txt, img, mask = make_inputs(S_TXT, S_IMG, BATCH, HEADS, HEAD_DIM)
    leaves = [t.clone().requires_grad_(True) for t in txt + img]
    ref_txt, ref_img = reference_joint_attention(*leaves, mask if masked else None)
    w_txt, w_img = _loss_weights(txt[0].shape, img[0].shape, cp)
    ((ref_txt * sum(w_txt) * float(text_queries)).sum() + (ref_img * w_img).sum()).backward()
    by_cp = sorted(per_rank, key=lambda res: res["cp_rank"])
    assert [res["cp_rank"] for res in by_cp] == list(range(cp))

    for res in by_cp if text_queries else ():
        err = rel_err(res["out_txt"].double(), ref_txt.detach())
        assert err < 1e-5, f"out_txt on cp rank {res['cp_rank']}: relative error {err:.2e}"
    out_img = torch.cat([res["out_img"] for res in by_cp]).double()
    assert rel_err(out_img, ref_img.detach()) < 1e-5, "out_img"
    errors = {}
    for i, name in enumerate(NAMES):
        if i == 0 and not text_queries:
            assert all(res["grads"][0] is None for res in by_cp), "q_txt got a gradient without text queries"
            continue
        if i < 3:  # replicated text inputs: the ranks' gradient shares sum to the full gradient
            got = sum(res["grads"][i].double() for res in by_cp)
        else:  # image shards: gradients are the slices of the full gradient, in CP-rank order
            got = torch.cat([res["grads"][i] for res in by_cp]).double()
        err = errors[name] = rel_err(got, leaves[i].grad)
        assert err < 1e-5, (f"grad {name}: relative error {err:.2e} (ulysses={ulysses}, ring={ring}, "
                            f"masked={masked}, text_queries={text_queries})")

    print(f"ulysses={ulysses} ring={ring} masked={masked} text_queries={text_queries}: "
          f"out_img {rel_err(out_img, ref_img.detach()):.1e}, grads "
          + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))


@pytest.mark.parametrize(
    "world_size, layouts",
    [(2, [(2, 1), (1, 2)]), (4, [(1, 4), (2, 2)])],
    ids=["ulysses2+ring2", "ring4+ulysses2xring2"],
)
def test_context_parallel_joint_attention_matches_single_rank(world_size, layouts):
    results = run_ranks(_run_layouts, world_size, layouts, timeout_s=180)
    for ulysses, ring in layouts:
        for masked, text_queries in ((True, True), (False, True), (True, False)):
            _check_layout([res[(ulysses, ring, masked, text_queries)] for res in results], ulysses, ring, masked,
                          text_queries)
