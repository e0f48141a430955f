"""The EMA of the weights (`optim.ema_decay`, flow_grpo's `train.ema`) in the trainer.

On the tiny offline pipeline, with fixed advantages on a real trajectory: after every optimizer step the EMA
is decay * EMA + (1 - decay) * weights, starting from the initial weights; `evaluation_weights()` puts it
into the model, and into the engine's own transformer when the engine samples with a copy
(`rollout.transformer=engine`), so evaluation samples with the EMA; on exit the trained weights are back bit
for bit and the engine samples exactly what it sampled before. Without `ema_decay` nothing is kept and the
context changes nothing.
"""

from __future__ import annotations

import torch

from megatron_omni.parallel.rank_pool import run_ranks
from tests.unit.tiny_trainer import GROUP, PROMPTS, tiny_trainer

DECAY = 0.75


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _ode_images(trainer) -> torch.Tensor:
    return trainer.engine.generate(PROMPTS, trainer.sampling_params().ode(), group_size=1, seeds=[3, 4]).images


def _ema_run(rank: int, world_size: int, pipeline_dir: str) -> dict:
    out: dict = {}
    for transformer in ("auto", "engine"):
        trainer = tiny_trainer(pipeline_dir, f"optim.ema_decay={DECAY}", f"rollout.transformer={transformer}")
        res: dict = {"shares_model": trainer.shares_model,
                     "ema_fp32": all(p.dtype == torch.float32 for p in trainer.ema.parameters())}
        expected = _params(trainer.model)
        res["starts_at_weights"] = _max_diff(_params(trainer.ema), expected)
        n = len(PROMPTS) * GROUP
        traj = trainer.engine.generate(PROMPTS, trainer.sampling_params(), group_size=GROUP,
                                       seeds=[7 + i for i in range(n)])
        advantages = torch.linspace(-1.0, 1.0, n)
        res["ema_error"], res["ema_vs_weights"] = [], []
        for step in (0, 1):
            trainer._update(traj, trainer.old_log_probs(traj, step), advantages, step)
            weights = _params(trainer.model)
            expected = {k: DECAY * expected[k] + (1 - DECAY) * weights[k] for k in weights}
            res["ema_error"].append(_max_diff(_params(trainer.ema), expected))
            res["ema_vs_weights"].append(_max_diff(_params(trainer.ema), weights))
        if not trainer.shares_model:
            trainer.sync_weights()
        trained, before = _params(trainer.model), _ode_images(trainer)
        with trainer.evaluation_weights():
            res["inside_is_ema"] = _max_diff(_params(trainer.model), _params(trainer.ema))
            res["inside_vs_trained_images"] = float((_ode_images(trainer) - before).abs().max())
        res["restored"] = _max_diff(_params(trainer.model), trained)
        res["images_restored"] = torch.equal(_ode_images(trainer), before)
        out[transformer] = res
    plain = tiny_trainer(pipeline_dir)
    weights, images = _params(plain.model), _ode_images(plain)
    with plain.evaluation_weights():
        out["plain"] = {"no_ema": plain.ema is None, "unchanged": _max_diff(_params(plain.model), weights),
                        "same_images": torch.equal(_ode_images(plain), images)}
    return out


def test_ema_of_the_weights_is_what_evaluation_samples(tiny_pipeline_dir: str) -> None:
    (out,) = run_ranks(_ema_run, 1, tiny_pipeline_dir, timeout_s=400)
    assert out["auto"]["shares_model"] and not out["engine"]["shares_model"]
    for transformer in ("auto", "engine"):
        r = out[transformer]
        assert r["ema_fp32"] and r["starts_at_weights"] == 0.0
        assert max(r["ema_error"]) < 1e-6, r["ema_error"]
        assert min(r["ema_vs_weights"]) > 1e-4, "lr 1e-2 moves the weights: the EMA must lag them"
        assert r["inside_is_ema"] == 0.0
        assert r["inside_vs_trained_images"] > 1e-4, "the engine must sample with the EMA inside the context"
        assert r["restored"] == 0.0 and r["images_restored"], transformer
    assert out["plain"] == {"no_ema": True, "unchanged": 0.0, "same_images": True}
