"""The bridge from a Megatron Wan model at trainer TP=2 into real rollout modules, checked by forward equality,
and the converted checkpoint loaded at TP=2.

The trainer model loads a Megatron checkpoint that `tools/checkpoint/convert.py` wrote from a diffusers folder
(saved at tp 1, read back at tp 2: the family found from the built model). The rollout modules start
poisoned with NaN, so any element a sync misses shows up in the forward: diffusers' `WanTransformer3DModel`
(rollout tp 1, `full` plan) and vLLM-Omni 0.30.0's Wan2.2 `WanTransformer3DModel` built on CPU (rollout tp 2
`direct` and `full`, rollout tp 1 `full`). After each sync the rollout forward, through the packed-token
interface the rollout uses, must equal the Megatron forward (relative error < 1e-5); after an Adam step
changes the Megatron weights, a second sync must make the rollout follow.

One task call on two ranks runs every case.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import WanTransformer3DModel

from megatron_omni.bridge import DiffusersTarget, VllmOmniTarget, WeightSync
from megatron_omni.bridge.family_sync import family_plans
from megatron_omni.checkpoint.sharded_state import load_model_checkpoint
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.models.dit.video_interface import PackedVideoTransformer
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from model_providers import get_family
from model_providers.wan import provider
from tests.distributed.test_bridge_sync import _poison, _rel
from tests.unit.test_wan_convert import write_wan_folder
from tools.checkpoint.convert import main as convert

GRID = (3, 2, 3)  # frames, height, width in patches
TRAINER_TP = 2
BUCKET_BYTES = 32 * 1024  # small, so the tiny model moves in many buckets


def _inputs() -> dict:
    cfg = provider.hf_config("tiny")
    g = torch.Generator().manual_seed(1)
    text = torch.randn(2, 6, cfg["text_dim"], generator=g)
    text[1, 2:] = 0
    tokens = GRID[0] * GRID[1] * GRID[2]
    return dict(hidden_states=torch.randn(2, tokens, cfg["in_channels"] * 4, generator=g), encoder_hidden_states=text,
                encoder_hidden_states_mask=None, timestep=torch.tensor([0.93, 0.27]), img_shapes=[[GRID]] * 2)


def _bridge_cases(rank: int, world_size: int, checkpoint: str) -> dict:
    from megatron_omni.rollout.vllm_omni import inline

    groups = build_parallel_groups(ParallelLayout(tp=TRAINER_TP))
    seed_everything(0, tp_rank=groups.tp.rank())
    model = provider.build_model(provider.transformer_config("tiny", tp=TRAINER_TP), groups)
    load_model_checkpoint(model, checkpoint)
    trainer = DiffusersForward(model)
    family, cfg = get_family("wan"), provider.hf_config("tiny")
    x = _inputs()
    sources = family.megatron_sources(model)["transformer"]
    out: dict = {"loaded": {k: v.clone() for k, v in provider.stage_hf_tensors(model).items()}}

    def step() -> None:  # one Adam step of the trainer
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        v = trainer(**x)[0]
        (v * torch.linspace(-1, 1, v.shape[-1])).sum().backward()
        opt.step()

    def run(name: str, module: torch.nn.Module, target, rollout_kind: str, rollout_tp: int, mode: str) -> None:
        plan = family_plans(family, cfg, trainer_tp=TRAINER_TP, rollout_kind=rollout_kind, rollout_tp=rollout_tp,
                            mode=mode)["transformer"]
        sync = WeightSync(plan, sources=sources, target=target, tp_group=groups.tp, tp_rank=groups.tp.rank(),
                          bucket_bytes=BUCKET_BYTES)
        rollout = PackedVideoTransformer(module, cfg["patch_size"])
        stats = sync.sync()
        with torch.no_grad():
            before = rollout(**x)[0]
            err1 = _rel(before, trainer(**x)[0])
        step()
        stats2 = sync.sync()
        with torch.no_grad():
            after = rollout(**x)[0]
            err2 = _rel(after, trainer(**x)[0])
        numel = sum(p.numel() for p in module.parameters())
        out[name] = dict(err1=err1, err2=err2, changed=_rel(after, before), buckets=stats.buckets,
                         bytes=(stats.bytes_loaded, stats2.bytes_loaded, 4 * numel),
                         per_rank=plan.numel_per_rollout_rank()[target.tp_rank])

    torch.manual_seed(5)
    diffusers_module = WanTransformer3DModel(**cfg).eval()
    _poison(diffusers_module)
    run("diffusers-tp1-full", diffusers_module, DiffusersTarget(diffusers_module), "diffusers", 1, "full")
    for rollout_tp, mode in ((2, "direct"), (2, "full"), (1, "full")):
        with inline.vllm_omni_parallel(rollout_tp) as _:
            from vllm.distributed import get_tensor_model_parallel_rank

            module = inline.build_wan_transformer(cfg)
            _poison(module)
            inline.finish_loading(module)
            # the bare transformer's loader takes unprefixed names (the pipeline's strips `transformer.`)
            target = VllmOmniTarget(module, get_tensor_model_parallel_rank(), rollout_tp, load_prefix="")
            run(f"vllm_omni-tp{rollout_tp}-{mode}", module, target, "vllm_omni", rollout_tp, mode)
    return out


def test_converted_checkpoint_and_sync_into_diffusers_and_vllm_omni(tmp_path: Path) -> None:
    src = write_wan_folder(tmp_path / "hf", provider.hf_config("tiny"))
    assert convert(["hf-to-mcore", str(src), str(tmp_path / "mcore"), "--no-progress"]) == 0
    results = run_ranks(_bridge_cases, 2, str(tmp_path / "mcore"), timeout_s=600)
    hf = WanTransformer3DModel.from_pretrained(src).state_dict()
    for res in results:
        # the checkpoint, saved at tp 1, loads at tp 2 into the same tensors
        loaded = res.pop("loaded")
        assert loaded.keys() == hf.keys() and all(torch.equal(loaded[k], hf[k]) for k in hf)
        for name, case in res.items():
            assert case["err1"] < 1e-5, (name, case)
            assert case["err2"] < 1e-5, (name, case)  # the second sync, after an optimizer step, is not stale
            assert case["changed"] > 1e-3, (name, case)  # and the step did change the rollout's output
            loaded, loaded2, numel_bytes = case["bytes"]
            assert loaded == loaded2 == numel_bytes == 4 * case["per_rank"], (name, case)
            assert case["buckets"] > 1, (name, case)
