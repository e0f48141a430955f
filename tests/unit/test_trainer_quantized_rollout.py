"""`rollout.quantization=fp8` in the one trainer, on the tiny offline pipeline (real ModelOpt fake quantization in
the embedded engine, real Megatron model and optimizer), with the truncated importance-weight correction
(`algorithm.is_cap`):

- `auto` gives the engine its own quantized copy; each step's sync passes the quantized probe check (the
  quantizer moves the probe, within its bound), the rollout/trainer gap is > 0 and small, and the weights'
  metrics are logged (a cap of 1 truncates the transitions the FP8 rollout under-weighted, not the others);
- the weights reach the loss: the same micro-batches give another policy loss without them;
- an evaluation also samples unquantized (`unquantized_*` keys) and leaves the engine quantized as before;
- a checkpoint of the quantized run resumes bit for bit (the engine's quantizer state is rebuilt from the
  synced weights).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch

from megatron_omni.parallel.rank_pool import run_ranks
from tests.unit.tiny_trainer import tiny_trainer

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ("rollout.quantization=fp8", "algorithm.is_cap=1.0", 'eval.prompts=["a red cube"]',
             "eval.num_steps=4", "eval.seeds_per_prompt=2")
STEP_KEYS = ("train_rollout_dlogp", "train_rollout_dlogp_max", "is_weight_mean", "is_weight_max",
             "is_truncated_frac", "train_rollout_dlogp_after_is", "sync_probe_max_diff", "sync_probe_quant_diff",
             "sync_probe_quant_bound")


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _quantized_run(rank: int, world_size: int, pipeline_dir: str, run_dir: str) -> dict:
    from megatron_omni.trainer.checkpointing import load_checkpoint, save_checkpoint
    from megatron_omni.trainer.run import record_evaluation

    trainer = tiny_trainer(pipeline_dir, *OVERRIDES)
    out: dict = {"own_copy": not trainer.shares_model, "quantized": trainer.engine.quantizer is not None}
    out["m0"] = trainer.train_step(0).metrics
    save_checkpoint(Path(run_dir), 1, trainer.model, trainer.optimizer, trainer.scheduler, {"step": 1}, keep=1)
    result = trainer.train_step(1)
    out["m1"], params1 = result.metrics, _params(trainer.model)

    # evaluation: quantized and unquantized on the same prompts and seeds; the engine samples as before after it
    prompts, seeds, params = result.prompts[:2], result.trajectory.seeds[:2].tolist(), trainer.sampling_params(2)
    before = trainer.engine.generate(prompts, params, group_size=1, seeds=seeds).images
    record_evaluation(trainer.cfg, trainer, Path(run_dir), 2)
    after = trainer.engine.generate(prompts, params, group_size=1, seeds=seeds).images
    out["eval"] = json.loads((Path(run_dir) / "eval.jsonl").read_text().splitlines()[-1])
    out["engine_after_eval"] = float((before - after).abs().max())
    with trainer.unquantized_rollout():
        plain = trainer.engine.generate(prompts, params, group_size=1, seeds=seeds).images
    out["unquantized_vs_quantized"] = float((plain - before).abs().max())

    # the importance weights reach the loss: one mini-batch's policy loss with and without them
    traj, adv = result.trajectory, torch.linspace(-1.0, 1.0, len(result.trajectory))
    objective, _, _ = trainer.policy_gradient_objective(traj, adv, 1, {})
    mbs = trainer.micro_batches(len(traj), objective.points, 1)[0]
    losses = [sum(m["policy_loss"] for m in trainer.pipeline.forward_backward(trainer.ddp, mbs, o))
              for o in (objective, dataclasses.replace(objective, is_weights=None))]
    out["weights_shape"], out["losses"] = tuple(objective.is_weights.shape), losses
    out["weights_max"] = float(objective.is_weights.max())

    # resume: a fresh trainer from the checkpoint after step 1 (synced as `run` does) repeats step 1 bit for bit
    fresh = tiny_trainer(pipeline_dir, *OVERRIDES)
    load_checkpoint(Path(run_dir) / "checkpoints" / "step_000001", fresh.model, fresh.optimizer, fresh.scheduler)
    fresh.sync_weights()
    out["resumed_m1"] = fresh.train_step(1).metrics
    resumed = _params(fresh.model)
    out["resumed_param_diff"] = max(float((resumed[k] - params1[k]).abs().max()) for k in params1)
    return out


def test_fp8_rollout_trains_with_importance_weights_evaluates_unquantized_and_resumes_exactly(
        tiny_pipeline_dir: str, tmp_path: Path) -> None:
    (out,) = run_ranks(_quantized_run, 1, tiny_pipeline_dir, str(tmp_path), timeout_s=600)
    assert out["own_copy"] and out["quantized"]
    for m in (out["m0"], out["m1"]):
        assert all(k in m for k in STEP_KEYS), sorted(m)
        assert 0 < m["sync_probe_quant_diff"] <= m["sync_probe_quant_bound"], m
        assert m["sync_probe_max_diff"] <= 1e-4  # the unquantized view holds the synced weights (fp32 tolerance)
        assert 0 < m["train_rollout_dlogp"] < 1e-2 and m["train_rollout_dlogp_max"] >= m["train_rollout_dlogp"]
        # cap 1: a weight is exp(logp_old - logp_rollout) where the FP8 rollout gave the transition more
        # probability than the trainer, 1 where it gave less (truncated)
        assert 0 < m["is_truncated_frac"] < 1 and m["is_weight_max"] == 1.0 and m["is_weight_mean"] < 1, m
        assert 0 < m["train_rollout_dlogp_after_is"] < m["train_rollout_dlogp"]
        assert math.isfinite(m["loss"])
    print("fp8 step metrics:", {k: f"{out['m1'][k]:.3g}" for k in STEP_KEYS})
    documented = (ROOT / "docs" / "metrics.md").read_text()
    assert not [k for k in out["m1"] if f"`{k}`" not in documented], "metric keys missing from docs/metrics.md"

    e = out["eval"]
    assert e["step"] == 2 and math.isfinite(e["unquantized_reward_mean"])
    assert e["quantized_reward_delta"] == e["reward_mean"] - e["unquantized_reward_mean"]
    assert all(f"`{k}`" in documented for k in e), "eval keys missing from docs/metrics.md"
    assert out["engine_after_eval"] == 0.0 < out["unquantized_vs_quantized"]
    print("eval:", e)

    assert out["weights_shape"] == (4, 2) and out["weights_max"] == 1.0
    assert out["losses"][0] != out["losses"][1], out["losses"]

    assert out["resumed_param_diff"] == 0.0
    for k, v in out["m1"].items():
        if not k.startswith("time_") and k != "images_per_s_per_rank":
            assert out["resumed_m1"][k] == v or (math.isnan(v) and math.isnan(out["resumed_m1"][k])), k
