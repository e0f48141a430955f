"""Weight sync from a Megatron Qwen-Image model at TP=2 into real rollout modules, checked by forward equality.

The rollout modules (vLLM-Omni 0.30.0's `QwenImageTransformer2DModel` at rollout TP=1 and TP=2, and
diffusers' module) start poisoned with NaN, so any element the sync misses shows up in the forward. After
the sync the rollout forward must equal the Megatron forward (relative error < 1e-5); after an Adam step
changes the Megatron weights, a second sync must make the rollout follow. Broken mappings must fail the
coverage check with an error naming the rollout parameter.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from diffusers import QwenImageTransformer2DModel

from megatron_omni.bridge import CoverageError, DiffusersTarget, DistributedTransport, VllmOmniTarget, WeightSync
from megatron_omni.bridge.qwen_image import megatron_sources, qwen_image_plan
from megatron_omni.models.dit.model import DiTBatch
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from model_providers.qwen_image import provider
from model_providers.qwen_image.mapping import ParamMapping, all_mappings

GRID = (1, 4, 6)
S_TXT = 5
TRAINER_TP = 2
BUCKET_BYTES = 32 * 1024  # small, so the tiny model is moved in many buckets


def _inputs() -> dict[str, torch.Tensor]:
    cfg = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(2, S_TXT, dtype=torch.bool)
    mask[1, 3:] = False
    return dict(latents=torch.randn(2, GRID[0] * GRID[1] * GRID[2], cfg["in_channels"], generator=g),
                prompt_embeds=torch.randn(2, S_TXT, cfg["joint_attention_dim"], generator=g),
                prompt_mask=mask, sigma=torch.rand(2, generator=g))


def _trainer():
    groups = build_parallel_groups(ParallelLayout(tp=TRAINER_TP))
    seed_everything(0, tp_rank=groups.tp.rank())
    model = provider.build_model(provider.transformer_config("tiny", tp=TRAINER_TP), groups)
    torch.manual_seed(0)
    ref = QwenImageTransformer2DModel(**provider.hf_config("tiny"))
    with torch.no_grad():
        for p in ref.parameters():  # adaLN is zero-initialised by default: use weights that make signal
            p.normal_(0.0, 0.2)
    provider.load_hf_state_dict(model, ref.state_dict())
    return groups, model


def _megatron_forward(model, x) -> torch.Tensor:
    with torch.no_grad():
        return model(DiTBatch(x["latents"], x["prompt_embeds"], x["prompt_mask"], x["sigma"], GRID))


def _adam_step(model, groups, x) -> None:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = model(DiTBatch(x["latents"], x["prompt_embeds"], x["prompt_mask"], x["sigma"], GRID))
    (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    for name, p in model.named_parameters():  # QK-norm weights are replicated; their grads are per-head partial
        if p.grad is not None and ("q_layernorm" in name or "k_layernorm" in name):
            dist.all_reduce(p.grad, group=groups.tp)
    opt.step()


def _poison(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(float("nan"))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _vllm_case(rank: int, world_size: int, rollout_tp: int, mode: str) -> dict:
    from megatron_omni.rollout.vllm_omni import inline

    groups, model = _trainer()
    x = _inputs()
    out = {}
    with inline.vllm_omni_parallel(rollout_tp) as (od, _):
        from vllm.distributed import get_tensor_model_parallel_rank

        module = inline.build_transformer(od, provider.hf_config("tiny"))
        _poison(module)
        inline.finish_loading(module)
        target = VllmOmniTarget(module, get_tensor_model_parallel_rank(), rollout_tp)
        plan = qwen_image_plan("tiny", trainer_tp=TRAINER_TP, rollout_kind="vllm_omni", rollout_tp=rollout_tp,
                               mode=mode)
        sync = WeightSync(plan, sources=megatron_sources(model), target=target, tp_group=groups.tp,
                          tp_rank=groups.tp.rank(), bucket_bytes=BUCKET_BYTES)
        stats = sync.sync()
        before = inline.forward(module, **x, grid=GRID)
        out["err1"] = _rel(before, _megatron_forward(model, x))
        _adam_step(model, groups, x)
        stats2 = sync.sync()
        after = inline.forward(module, **x, grid=GRID)
        out["err2"] = _rel(after, _megatron_forward(model, x))
        out["changed"] = _rel(after, before)
        out["stats"] = (stats, stats2)
        out["rollout_numel"] = sum(p.numel() for p in module.parameters())
    return out


@pytest.mark.parametrize("rollout_tp,mode", [(1, "full"), (2, "direct"), (2, "full")])
def test_sync_into_vllm_omni(rollout_tp: int, mode: str) -> None:
    results = run_ranks(_vllm_case, 2, rollout_tp, mode, timeout_s=300)
    plan = qwen_image_plan("tiny", trainer_tp=TRAINER_TP, rollout_tp=rollout_tp, mode=mode)
    for r, res in enumerate(results):
        assert res["err1"] < 1e-5, res
        assert res["err2"] < 1e-5, res  # the second sync after an optimizer step is not stale
        assert res["changed"] > 1e-3, res  # and the step did change the rollout's output
        assert res["rollout_numel"] == plan.numel_per_rollout_rank()[r % rollout_tp]
        first, second = res["stats"]
        assert first.bytes_loaded == second.bytes_loaded == 4 * res["rollout_numel"]
        assert first.buckets > 1
        if mode == "direct":
            # Only adaLN (sharded in Megatron, replicated in vLLM-Omni) crosses ranks.
            local, remote = plan.local_numel(r)
            assert first.bytes_gathered == 4 * remote  # exactly the other rank's adaLN shards
            assert {s.megatron.split(".")[-2] for s in plan.remote_sources()} == {"adaln"}


def _diffusers_case(rank: int, world_size: int, distributed: bool) -> dict:
    groups, model = _trainer()
    x = _inputs()
    torch.manual_seed(5)
    rollout = QwenImageTransformer2DModel(**provider.hf_config("tiny")).eval()
    _poison(rollout)
    plan = qwen_image_plan("tiny", trainer_tp=TRAINER_TP, rollout_kind="diffusers", rollout_tp=1)
    hosts = (not distributed) or rank == 1
    transport = DistributedTransport(sources=[0], rollout_ranks=[1], dtype=torch.float32) if distributed else None
    sync = WeightSync(plan, sources=megatron_sources(model), target=DiffusersTarget(rollout) if hosts else None,
                      tp_group=groups.tp, tp_rank=groups.tp.rank(), transport=transport, bucket_bytes=BUCKET_BYTES)
    res = {"hosts": hosts}
    for step in range(2):
        if step:
            _adam_step(model, groups, x)
        stats = sync.sync()
        ref = _megatron_forward(model, x)
        if hosts:
            with torch.no_grad():
                got = rollout(hidden_states=x["latents"], encoder_hidden_states=x["prompt_embeds"],
                              encoder_hidden_states_mask=x["prompt_mask"], timestep=x["sigma"],
                              img_shapes=[[GRID]] * 2).sample
            res[f"err{step}"] = _rel(got, ref)
        res[f"stats{step}"] = stats
    res["largest"] = 4 * max(s.full_numel for s in plan.sources)
    return res


@pytest.mark.parametrize("distributed", [False, True], ids=["in-process", "to-another-rank"])
def test_sync_into_diffusers(distributed: bool) -> None:
    results = run_ranks(_diffusers_case, 2, distributed, timeout_s=240)
    for res in results:
        if res["hosts"]:
            assert res["err0"] < 1e-5 and res["err1"] < 1e-5, res
        for step in range(2):
            stats = res[f"stats{step}"]
            assert stats.buckets > 1
            # Extra memory stays bounded by the bucket (or the one tensor that exceeds it), not the model.
            assert stats.peak_extra_bytes <= 4 * max(BUCKET_BYTES, res["largest"]), stats
    if distributed:
        assert results[0]["stats0"].bytes_transported > 0 and results[1]["stats0"].bytes_loaded > 0


def _broken_case(rank: int, world_size: int, broken: str, mode: str, rollout_tp: int) -> str:
    from megatron_omni.rollout.vllm_omni import inline

    groups, model = _trainer()
    mappings = all_mappings(2)
    if broken == "duplicate":  # layer 1's image v projection named as its k projection
        mappings = [ParamMapping(m.megatron, (m.hf[0], m.hf[1], m.hf[1]), m.kind, m.tp_dim, m.layer, m.stage)
                    if m.megatron == "layers.1.img.linear_qkv.weight" else m for m in mappings]
    else:  # a mapping left out
        mappings = [m for m in mappings if m.megatron != "layers.1.txt.linear_fc2.bias"]
    with inline.vllm_omni_parallel(rollout_tp) as (od, _):
        from vllm.distributed import get_tensor_model_parallel_rank

        module = inline.build_transformer(od, provider.hf_config("tiny"))
        inline.finish_loading(module)
        plan = qwen_image_plan("tiny", trainer_tp=TRAINER_TP, rollout_tp=rollout_tp, mode=mode, mappings=mappings)
        sources = megatron_sources(model)
        if broken == "missing":
            sources.pop("layers.1.txt.linear_fc2.bias")
        sync = WeightSync(plan, sources=sources, target=VllmOmniTarget(module, get_tensor_model_parallel_rank(),
                                                                       rollout_tp), tp_group=groups.tp,
                          tp_rank=groups.tp.rank())
        try:
            sync.sync()
        except CoverageError as e:
            return str(e)
    return "no error"


@pytest.mark.parametrize("broken,mode,rollout_tp,param", [
    ("duplicate", "full", 1, "transformer_blocks.1.attn.to_qkv.weight"),
    ("missing", "direct", 2, "transformer_blocks.1.txt_mlp.net.2.bias"),
])
def test_broken_mapping_is_caught(broken: str, mode: str, rollout_tp: int, param: str) -> None:
    for message in run_ranks(_broken_case, 2, broken, mode, rollout_tp, timeout_s=240):
        assert param in message, message
        assert ("more than once" in message) if broken == "duplicate" else ("never written" in message), message
