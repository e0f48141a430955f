"""Megatron-Core's distributed optimizer (optimizer state sharded over data parallel) on CPU with gloo.

At DP=2 on the tiny Qwen-Image model (fp32, Adam with weight decay and grad clipping, different data per
rank), two steps with the distributed optimizer give the weights of two steps with the plain one; its
training checkpoint (`megatron_omni.trainer.checkpointing`, the Megatron distributed checkpoint format)
reloads into freshly built ranks with the saved weights, and the next step after the reload is bit-identical
to the uninterrupted run (megatron-core restores torch Adam's step counters as one shared tensor;
`checkpointing._unshare_adam_steps` mends it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.distributed import finalize_model_grads

from megatron_omni.models.dit.model import DiTBatch
from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.trainer.checkpointing import load_checkpoint, save_checkpoint
from model_providers.qwen_image import provider
from tests.distributed.tiny_training import build_tiny_training

GRID = (1, 4, 4)
S_TXT = 5


def _step(groups, ddp, opt, sched, step: int, dp_rank: int) -> None:
    hf = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(100 * step + dp_rank)  # each data-parallel rank sees its own batch
    batch = DiTBatch(torch.randn(2, GRID[0] * GRID[1] * GRID[2], hf["in_channels"], generator=g),
                     torch.randn(2, S_TXT, hf["joint_attention_dim"], generator=g),
                     torch.ones(2, S_TXT, dtype=torch.bool), torch.rand(2, generator=g), GRID)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    out = ddp(batch)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    finalize_model_grads([ddp], pg_collection=groups.mcore)
    ok, _, _ = opt.step()
    assert ok
    sched.step(increment=1)


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}


def _two_steps(rank: int, world_size: int, distributed: bool, ckpt_root: str | None) -> dict:
    groups, model, ddp, opt, sched = build_tiny_training(1, distributed, init_seed=0)
    initial = _weights(model)
    for step in range(2):
        _step(groups, ddp, opt, sched, step, groups.dp.rank())
    after_two = _weights(model)
    if ckpt_root is None:
        return {"initial": initial, "after_two": after_two}
    save_checkpoint(Path(ckpt_root), 2, model, opt, sched, {"step": 2}, keep=1)
    _step(groups, ddp, opt, sched, 2, groups.dp.rank())
    after_three = _weights(model)

    groups, model, ddp, opt, sched = build_tiny_training(1, distributed, init_seed=1)  # other weights, empty optimizer
    common = load_checkpoint(Path(ckpt_root) / "checkpoints" / "step_000002", model, opt, sched)
    reloaded = _weights(model)
    _step(groups, ddp, opt, sched, 2, groups.dp.rank())
    return {"after_two": after_two, "after_three": after_three, "reloaded": reloaded,
            "resumed_three": _weights(model), "common": common}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    plain = run_ranks(_two_steps, 2, False, None, timeout_s=300)
    sharded = run_ranks(_two_steps, 2, True, str(tmp_path_factory.mktemp("dist_opt")), timeout_s=300)
    return plain, sharded


def test_distributed_optimizer_matches_plain_adam_and_its_checkpoint_reloads(runs) -> None:
    plain, sharded = runs
    assert sharded[0]["common"] == {"step": 2}
    for rank in range(2):
        ref, got = plain[rank]["after_two"], sharded[rank]["after_two"]
        # Adam moves every parameter with a gradient by about lr; only the last block's text-stream outputs
        # (text queries, projection and MLP) feed nothing and get none.
        stuck = [k for k in ref if float((ref[k] - plain[rank]["initial"][k]).abs().max()) < 1e-4]
        assert stuck and all(k.startswith("layers.1.txt.") for k in stuck), stuck
        # Same math; only the summation order of the gradient reduction differs (reduce-scatter vs all-reduce).
        # Adam's step is about lr * m / sqrt(v), so rounding differences of the gradients move weights by
        # far less than one step (lr = 1e-3).
        errors = {k: float((got[k] - ref[k]).abs().max()) for k in ref}
        worst = max(errors, key=errors.get)
        print(f"rank {rank}: distributed vs plain optimizer, worst weight difference {errors[worst]:.2e} ({worst})")
        assert errors[worst] < 1e-6, errors
        for k in sharded[rank]["after_two"]:
            assert torch.equal(sharded[rank]["reloaded"][k], sharded[rank]["after_two"][k]), f"rank {rank}: {k}"
    # The ranks of one data-parallel group hold the same weights after the all-gather.
    for k in sharded[0]["after_three"]:
        assert torch.equal(sharded[0]["after_three"][k], sharded[1]["after_three"][k]), k


def test_distributed_optimizer_resumes_bit_identically(runs) -> None:
    _, sharded = runs
    for rank in range(2):
        for k in sharded[rank]["after_three"]:
            assert torch.equal(sharded[rank]["resumed_three"][k], sharded[rank]["after_three"][k]), f"{rank}: {k}"
