"""AR-DiT resume through the one run loop (`trainer.run.run`, as `python -m megatron_omni.train` runs it): a run
of the tiny recipe that crashes in the middle of step 3 (after a checkpoint at 2 steps) and is resumed with
`checkpoint.resume=auto` ends with weights, Adam moments and metric history bit-identical
(CPU fp32) to an uninterrupted run of the same length; the checkpoint is Megatron's distributed format,
written atomically (`trainer.checkpointing`), here at TP=2 on two gloo ranks. The trained hybrid then leaves
through the converter: `convert_ar_dit.py mcore-to-hf` reads the TP=2 training checkpoint into a Hugging Face
folder, and `hf-to-mcore` of that folder gives every weight back bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from megatron_omni.parallel.rank_pool import run_ranks

STEPS = 4
ROOT = Path(__file__).resolve().parents[2]


class _Crash(RuntimeError):
    pass


def _run(rank: int, world_size: int, out_dir: str, crash_at: int | None, resume: bool, save_every: int) -> str:
    from examples.ar_dit.recipe import tiny
    from megatron_omni.trainer.ar_dit import ARDiTTrainer
    from megatron_omni.trainer.run import run

    cfg = tiny()
    cfg.run_dir, cfg.steps, cfg.parallel.tp = out_dir, STEPS, 2
    cfg.checkpoint.every, cfg.checkpoint.resume = save_every, "auto" if resume else None
    cfg.logging.tensorboard = False
    cfg.ar_dit.decoder_lr_scale = 0.5  # a decoder lr of its own: two optimizer groups to match on load
    original = ARDiTTrainer.train_step

    def train_step(self, step: int):
        if step == crash_at:
            raise _Crash(f"crash in step {step}")
        return original(self, step)

    ARDiTTrainer.train_step = train_step
    try:
        run(cfg)
        return "done"
    except _Crash as e:
        return str(e)
    finally:
        ARDiTTrainer.train_step = original


def test_crash_and_resume_equals_an_uninterrupted_run(tmp_path) -> None:
    from megatron_omni.trainer.checkpoint_folders import complete_checkpoints
    from megatron_omni.trainer.checkpointing import read_checkpoint_tensors

    full, crashed = tmp_path / "full", tmp_path / "crashed"
    assert run_ranks(_run, 2, str(full), None, False, STEPS, timeout_s=300) == ["done"] * 2
    assert run_ranks(_run, 2, str(crashed), 2, False, 2, timeout_s=300) == ["crash in step 2"] * 2
    assert [p.name for p in complete_checkpoints(crashed)] == ["step_000002"]
    assert run_ranks(_run, 2, str(crashed), None, True, 2, timeout_s=300) == ["done"] * 2

    a = read_checkpoint_tensors(complete_checkpoints(full)[-1])
    b = read_checkpoint_tensors(complete_checkpoints(crashed)[-1])
    assert complete_checkpoints(crashed)[-1].name == f"step_{STEPS:06d}"
    for part in ("model", "optimizer"):
        assert a[part].keys() == b[part].keys() and a[part], part
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)
    assert any(k.startswith("exp_avg_sq.") for k in a["optimizer"]), "no Adam moments in the checkpoint"
    hist_a = [json.loads(x) for x in (full / "metrics.jsonl").read_text().splitlines()]
    hist_b = [json.loads(x) for x in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in hist_b] == list(range(STEPS))  # the redone steps replace nothing twice
    assert [m["reward_mean"] for m in hist_a] == [m["reward_mean"] for m in hist_b]


    # Out through the converter and back: HF folder from the TP=2 training checkpoint, then a TP=1 checkpoint.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    hf, again = tmp_path / "hf", tmp_path / "again"
    script = (f"from tools.checkpoint import convert_ar_dit as c; "
              f"assert c.main(['mcore-to-hf', '{complete_checkpoints(full)[-1]}', '{hf}']) == 0; "
              f"assert c.main(['hf-to-mcore', '{hf}', '{again}']) == 0")
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (hf / "decoder" / "config.json").is_file() and (hf / "transformer" / "config.json").is_file()
    dcp_to_torch_save(str(again), str(tmp_path / "again.pt"))
    back = {k: v for k, v in torch.load(tmp_path / "again.pt", weights_only=False).items() if torch.is_tensor(v)}
    assert back.keys() == a["model"].keys()
    for k, v in a["model"].items():
        assert torch.equal(back[k], v), k
