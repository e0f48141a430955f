"""Training checkpoints in Megatron's distributed checkpoint format (`megatron_omni.trainer.checkpointing`).

- A checkpoint saved at TP=2 loads at TP=1 x DP=2 (both with the distributed optimizer, whose state is
  saved in model space): saving it again there gives exactly the same model, fp32 main-parameter and Adam
  tensors, and the step, data position, metric history and scheduler position come back.
- Only complete checkpoints count: a `.tmp` folder or one without the COMPLETE marker (a crash mid-save) is
  never picked by `--resume auto`, and saving keeps the last K.
- The checkpoint is also a model checkpoint for the converter (content metadata, tensor names).

(The SIGKILL-and-resume bit-identity of a whole run is tests/e2e/test_flowgrpo_train.py.)
"""

from __future__ import annotations

from pathlib import Path

import torch
from megatron.core.distributed import finalize_model_grads

from megatron_omni.checkpoint.sharded_state import content_metadata, model_layout, read_content_metadata
from megatron_omni.models.dit.model import DiTBatch
from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.trainer.checkpoint_folders import COMPLETE, checkpoint_dir, complete_checkpoints, latest_checkpoint
from megatron_omni.trainer.checkpointing import load_checkpoint, read_checkpoint_tensors, save_checkpoint
from model_providers.qwen_image import provider
from tests.distributed.tiny_training import build_tiny_training

GRID = (1, 4, 4)


def _adam_step(groups, ddp, opt, sched, step: int) -> None:
    hf = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(step)
    batch = DiTBatch(torch.randn(2, GRID[1] * GRID[2], hf["in_channels"], generator=g),
                     torch.randn(2, 5, hf["joint_attention_dim"], generator=g), torch.ones(2, 5, dtype=torch.bool),
                     torch.rand(2, generator=g), GRID)
    ddp.zero_grad_buffer()
    opt.zero_grad()
    out = ddp(batch)
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    finalize_model_grads([ddp], pg_collection=groups.mcore)
    assert opt.step()[0]
    sched.step(increment=1)


def _meta(model) -> dict:
    return content_metadata("qwen_image", provider.hf_config("tiny"), model_layout(model))


def _tp2_to_tp1(rank: int, world_size: int, root: str) -> dict:
    src_run, dst_run = Path(root) / "tp2", Path(root) / "tp1"
    groups, model, ddp, opt, sched = build_tiny_training(tp=2, distributed=True, init_seed=0, warmup_steps=4)
    for step in range(3):
        _adam_step(groups, ddp, opt, sched, step)
        history = [{"step": s, "reward_mean": 0.1 * s} for s in range(step + 1)]
        common = {"step": step + 1, "data": {"next_step": step + 1}, "metrics_history": history}
        save_checkpoint(src_run, step + 1, model, opt, sched, common, keep=2, content_metadata=_meta(model))
    lr_before = opt.param_groups[0]["lr"]

    groups, model, ddp, opt, sched = build_tiny_training(tp=1, distributed=True, init_seed=1, warmup_steps=4)
    common = load_checkpoint(checkpoint_dir(src_run, 3), model, opt, sched)
    lr_after = opt.param_groups[0]["lr"]
    save_checkpoint(dst_run, 3, model, opt, sched, common, keep=2, content_metadata=_meta(model))
    return {"common": common, "lr": (lr_before, lr_after), "kept": [p.name for p in complete_checkpoints(src_run)]}


def test_checkpoint_saved_at_tp2_resumes_at_tp1_with_distributed_optimizer(tmp_path: Path) -> None:
    results = run_ranks(_tp2_to_tp1, 2, str(tmp_path), timeout_s=300)
    r = results[0]
    assert r["kept"] == ["step_000002", "step_000003"]  # keep = 2
    assert r["common"]["step"] == 3 and r["common"]["data"] == {"next_step": 3}
    assert [h["step"] for h in r["common"]["metrics_history"]] == [0, 1, 2]
    assert r["lr"][0] == r["lr"][1] and 0 < r["lr"][0] < 1e-3  # the scheduler's warm-up position came back

    saved = read_checkpoint_tensors(checkpoint_dir(tmp_path / "tp2", 3))
    resaved = read_checkpoint_tensors(checkpoint_dir(tmp_path / "tp1", 3))
    assert saved["model"].keys() == resaved["model"].keys()
    assert len(saved["optimizer"]) == 3 * len(saved["model"])  # main param, exp_avg, exp_avg_sq per tensor
    assert saved["optimizer"].keys() == resaved["optimizer"].keys()
    for part in ("model", "optimizer"):
        for k, v in saved[part].items():
            assert torch.equal(v, resaved[part][k]), f"{part} tensor {k} changed through TP=2 -> TP=1"
    assert any(float(v.abs().max()) > 0 for v in saved["optimizer"].values())
    # The training checkpoint is a model checkpoint for the converter too.
    assert read_content_metadata(checkpoint_dir(tmp_path / "tp1", 3))["layout"]["tp"] == 1


def test_resume_auto_ignores_half_written_checkpoints(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    for name, complete in (("step_000002", True), ("step_000004", True), ("step_000006", False),
                           ("step_000008.tmp", True)):
        (root / name).mkdir(parents=True)
        (root / name / "common.pt").write_bytes(b"")
        if complete:
            (root / name / COMPLETE).write_text("1\n")
    assert latest_checkpoint(tmp_path) == root / "step_000004"
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000002", "step_000004"]
    assert latest_checkpoint(tmp_path / "nothing-here") is None
