"""Our Megatron-Core BAGEL's generation step equals vLLM-Omni 0.30.0's `Bagel` on the same tiny BAGEL folder.

One offline tiny folder in the published layout (`ema.safetensors` names, `llm_config.json`, `vit_config.json`,
`ae.safetensors`) feeds both: vLLM-Omni's `Qwen2MoTForCausalLM` takes the LLM tensors through its own
`load_weights` (the `_moe_gen` renames, fused q/k/v and gate/up), `Bagel` the generation-side modules; ours
through `model_providers.bagel.provider.load_bagel_state`.

The step: the prompt `[bos, text..., eos]` builds the text KV cache as BAGEL builds it
(`Bagel.forward_cache_update_text`: causal, understanding expert), then the velocity of noisy latents at a
timestep (`Bagel.prepare_input` gives BAGEL's own packing and position ids; `forward_single_branch` the velocity).
Ours runs at TP=1, TP=2 and PP=2 on the same two spawned gloo ranks (one rank-pool job for every layout).

Also here, sharing the folder and the job: the folder converted to a Megatron checkpoint by
tools/checkpoint/convert.py loads at TP=2 / PP=2 to exactly the folder's tensors and converts back identically; a
folder missing a tensor fails naming it; the planner's MoT counts equal the built model's per rank.

Precision: vLLM-Omni's BAGEL hard-casts its attention inputs and MLP outputs to bfloat16 (it runs under a
bf16 autocast on GPUs). The fp32 reference is the same vLLM-Omni code with those casts redirected to float32
(its module's `torch.bfloat16` read as `torch.float32`); the bf16 reference is vLLM-Omni's code as shipped with
bf16 weights under a CPU bf16 autocast (what its pipeline does on a GPU).
"""

from __future__ import annotations

import contextlib
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks

PROMPT = [1, 17, 42, 99, 7, 2]  # bos, text, eos (tiny preset ids)
IMAGE = (48, 64)  # pixels: a 3 x 4 latent-token grid (downsample 8 x latent patch 2)
T = 0.6


def _write_folder(rank: int, world_size: int, folder: str) -> None:
    if rank == 0:  # in a rank process, where vLLM-Omni (whose FLUX autoencoder writes ae.safetensors) is loaded
        from model_providers.bagel.provider import write_bagel_folder

        write_bagel_folder(folder, "tiny", seed=3)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("bagel") / "tiny")
    run_ranks(_write_folder, 2, folder, timeout_s=300)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tiny_folder, tmp_path_factory) -> str:
    """The tiny folder converted to a Megatron distributed checkpoint by tools/checkpoint/convert.py (in this
    process: conversion is single-rank)."""
    from tools.checkpoint.convert import main

    out = str(tmp_path_factory.mktemp("bagel-mcore") / "ckpt")
    assert main(["hf-to-mcore", tiny_folder, out, "--no-progress"]) == 0
    return out


class _TorchBf16AsFp32:
    """vLLM-Omni's bagel module's `torch`, with `bfloat16` reading as float32 (for the fp32 reference)."""

    bfloat16 = torch.float32

    def __getattr__(self, name):
        return getattr(torch, name)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _reference(cfg: dict, state: dict, tp: int, dtype: torch.dtype, latents: torch.Tensor) -> dict:
    """vLLM-Omni's velocity [n, p] and the generation inputs it packed (float32 out)."""
    from vllm.transformers_utils.configs.bagel import BagelConfig
    from vllm_omni.diffusion.models.bagel import bagel_transformer as bt

    from megatron_omni.rollout.vllm_omni import inline

    llm = dict(cfg["llm_config"])
    b = cfg["bagel"]
    with inline.vllm_omni_parallel(tp), _default_dtype(dtype):
        lm_cfg = bt.Qwen2MoTConfig(**{k: v for k, v in llm.items() if k not in ("architectures", "model_type")})
        lm = bt.Qwen2MoTForCausalLM(lm_cfg).eval()
        vae = SimpleNamespace(**b["vae_config"])
        bagel = bt.Bagel(lm, None, BagelConfig(llm_config=lm_cfg, visual_und=False, vae_config=vae,
                                               latent_patch_size=b["latent_patch_size"],
                                               max_latent_size=b["max_latent_size"],
                                               timestep_shift=b["timestep_shift"])).eval()
        prefix = "language_model."
        loaded = lm.load_weights((k[len(prefix):], v.to(dtype)) for k, v in state.items() if k.startswith(prefix))
        own = {"time_embedder.mlp.0.weight", "time_embedder.mlp.0.bias", "time_embedder.mlp.2.weight",
               "time_embedder.mlp.2.bias", "vae2llm.weight", "vae2llm.bias", "llm2vae.weight", "llm2vae.bias",
               "latent_pos_embed.pos_embed"}
        params = dict(bagel.named_parameters())
        with torch.no_grad():
            for k in own:
                params[k].copy_(state[k])
        inline.finish_loading(bagel)
        n_params = len({n for n, _ in lm.named_parameters()})
        patched = bt.torch
        if dtype == torch.float32:
            bt.torch = _TorchBf16AsFp32()
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)
        try:
            with torch.no_grad(), autocast:
                ids = torch.tensor(PROMPT)
                cache = bagel.forward_cache_update_text(bt.NaiveCache(llm["num_hidden_layers"]), ids,
                                                        torch.arange(len(PROMPT)), torch.tensor([len(PROMPT)]))
                gen = bagel.prepare_input([len(PROMPT)], [len(PROMPT)], [IMAGE], cfg["tokens"])
                n = gen["packed_init_noises"].shape[0]
                v = bagel.forward_single_branch(
                    x_t=latents.to(dtype), timestep=torch.full((n,), T, dtype=dtype),
                    packed_vae_token_indexes=gen["packed_vae_token_indexes"],
                    packed_vae_position_ids=gen["packed_vae_position_ids"], packed_text_ids=gen["packed_text_ids"],
                    packed_text_indexes=gen["packed_text_indexes"], packed_position_ids=gen["packed_position_ids"],
                    packed_seqlens=gen["packed_seqlens"], past_key_values=cache)
        finally:
            bt.torch = patched
    return {"v": v.float(), "gen": gen, "loaded": len(loaded), "n_params": n_params}


def _ours(cfg: dict, state: dict, layout: ParallelLayout, dtype: torch.dtype, latents: torch.Tensor, gen: dict):
    """Our velocity [n, p] (float32, on the last pipeline stage; None elsewhere) and whether the weights
    gathered back from the shards equal those loaded."""
    from megatron_omni.models.bagel.model import latent_position_ids, pipeline_run
    from model_providers.bagel import provider

    groups = build_parallel_groups(layout)
    seed_everything(0, tp_rank=groups.tp.rank())
    model = provider.build_model(cfg, groups, params_dtype=dtype).eval()
    provider.load_bagel_state(model, state)
    back = provider.export_bagel_state(model)
    exact = all(torch.equal(back[k], state[k].to(dtype)) for k in back)
    ids = torch.tensor(PROMPT)
    h = cfg["llm_config"]["hidden_size"]
    lat_h, lat_w = (s // 16 for s in IMAGE)
    pos = latent_position_ids(lat_h, lat_w, cfg["bagel"]["max_latent_size"])
    assert torch.equal(pos, gen["packed_vae_position_ids"]), "latent position ids differ from BAGEL's"
    markers = torch.tensor([cfg["tokens"]["start_of_image"], cfg["tokens"]["end_of_image"]])
    n = latents.shape[0]
    with torch.no_grad():
        kv_box = {}

        def text_stage(hidden):
            out, kv_box["kv"], _ = model.stage_text(ids, hidden)
            return out

        pipeline_run(text_stage, groups.pp, (len(PROMPT), 1, h), dtype)

        def velocity_stage(hidden):
            return model.stage_velocity(kv_box["kv"], len(PROMPT), markers, latents.to(dtype),
                                        torch.full((n,), T, dtype=dtype), pos, hidden)

        v = pipeline_run(velocity_stage, groups.pp, (n + 2, 1, h), dtype)
    from megatron_omni.models.lora import adapters, add_lora
    from megatron_omni.planner.mot import GEN_LORA_TARGETS, is_generation_tensor, is_trained

    counts = (sum(p.numel() for p in model.parameters()),
              sum(p.numel() for n, p in model.named_parameters() if is_generation_tensor(n)),
              sum(p.numel() for n, p in model.named_parameters() if is_trained(n, "both")))
    add_lora(model, GEN_LORA_TARGETS, 4, 8.0, seed=0, global_name=model.global_name)
    counts += (sum(p.numel() for a in adapters(model).values() for p in a.parameters()),)
    return (v.float() if groups.is_last_stage else None), exact, len(back), counts


def _pp_backward(cfg: dict, state: dict, latents: torch.Tensor) -> dict:
    """Gradients of the generation expert through Megatron-Core's 1F1B schedule at pp 2 (`models.bagel.schedule`,
    2 micro-batches: two timesteps of one image) against plain autograd of the same model at pp 1: the largest
    relative difference over this stage's trained tensors, and how many there are."""
    from megatron_omni.models.bagel.model import latent_position_ids, pipeline_run
    from megatron_omni.models.bagel.schedule import velocity_forward_backward
    from megatron_omni.planner.mot import is_generation_tensor
    from model_providers.bagel import provider

    ids = torch.tensor(PROMPT)
    pos = latent_position_ids(IMAGE[0] // 16, IMAGE[1] // 16, cfg["bagel"]["max_latent_size"])
    markers = torch.tensor([cfg["tokens"]["start_of_image"], cfg["tokens"]["end_of_image"]])
    n = latents.shape[0]
    steps = [(latents, torch.full((n,), t), pos) for t in (T, 0.3)]
    weight = torch.randn(latents.shape, generator=torch.Generator().manual_seed(5))

    def loss_fn(i: int, v: torch.Tensor) -> torch.Tensor:  # a fixed projection of the velocity, per micro-batch
        return (v.float() * weight * (i + 1)).sum()

    grads = {}
    for pp in (1, 2):
        groups = build_parallel_groups(ParallelLayout(pp=pp))
        seed_everything(0, tp_rank=0)
        model = provider.build_model(cfg, groups)
        provider.load_bagel_state(model, state)
        for name, p in model.named_parameters():
            p.requires_grad_(is_generation_tensor(model.global_name(name)))
        kv = {}
        with torch.no_grad():
            def text_stage(hidden, model=model, kv=kv):
                out, kv["kv"], _ = model.stage_text(ids, hidden)
                return out

            pipeline_run(text_stage, groups.pp, (len(PROMPT), 1, cfg["llm_config"]["hidden_size"]), torch.float32)
        if pp == 1:  # plain autograd: the mean of the micro-batches' losses
            sum(loss_fn(i, model.stage_velocity(kv["kv"], len(PROMPT), markers, *s))
                for i, s in enumerate(steps)).div(len(steps)).backward()
        else:
            velocity_forward_backward(model, groups, kv["kv"], len(PROMPT), markers, steps, loss_fn)
        grads[pp] = {model.global_name(k): p.grad for k, p in model.named_parameters() if p.requires_grad}
    diffs = [_rel(g, grads[1][k]) for k, g in grads[2].items()]
    return {"n": len(diffs), "max_rel": max(diffs), "none": sum(g is None for g in grads[2].values())}


def _cp_step(cfg: dict, state: dict, layout: ParallelLayout, dtype: torch.dtype, grid: tuple[int, int],
             backward: bool, gathered_loss: bool = False) -> dict:
    """One generation step of our model at `layout` over a `grid` of latent tokens: the whole velocity [n, p]
    (gathered over cp) and, with `backward`, the gradients of a fixed projection of it, summed over the cp ranks
    (each cp rank's are its shard's share, as data-parallel reduction over dp x cp sums them), plus the latents'.
    The loss is each rank's own shard's, or with `gathered_loss` the whole gathered velocity's divided by cp."""
    from megatron_omni.models.bagel.model import latent_position_ids
    from model_providers.bagel import provider

    b = cfg["bagel"]
    n = grid[0] * grid[1]
    gen = torch.Generator().manual_seed(13)
    latents = torch.randn(n, b["latent_patch_size"] ** 2 * b["vae_config"]["z_channels"], generator=gen)
    weight = torch.randn(latents.shape, generator=gen)
    pos = latent_position_ids(*grid, b["max_latent_size"])
    markers = torch.tensor([cfg["tokens"]["start_of_image"], cfg["tokens"]["end_of_image"]])
    groups = build_parallel_groups(layout)
    seed_everything(0, tp_rank=0)
    model = provider.build_model(cfg, groups, params_dtype=dtype)
    provider.load_bagel_state(model, state)
    with torch.no_grad():
        _, kv, _ = model.stage_text(torch.tensor(PROMPT))
    x = latents.to(dtype).requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        v_local = model.stage_velocity(kv, len(PROMPT), markers, x, torch.full((n,), T, dtype=dtype), pos)
        v = model.gather_velocity(v_local, n)
    out = {"v": v.detach().float(), "n_local": v_local.shape[0]}
    if backward:
        shard = model.query_shard(n)
        if gathered_loss:
            ((v.float() * weight).sum() / groups.cp.size()).backward()
        else:
            lo = max(shard.bounds[0], 1) - 1 if shard is not None else 0
            (v_local.float() * weight[lo:lo + v_local.shape[0]]).sum().backward()
        grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
        grads["latents"] = x.grad
        for g in grads.values():
            torch.distributed.all_reduce(g, group=groups.cp)
        out["grads"] = grads
    return out


def _cp_parity(cfg: dict, state: dict) -> dict:
    """Context parallelism 2 (`ParallelLayout(ulysses=2)`: BAGEL's k/v all-gather over the cp group) against cp 1
    on the same weights: the velocity (fp32 and bf16; an even 3 x 4 and an uneven 3 x 3 split: 14 and 11 packed
    tokens) and, fp32, every gradient."""
    out, fp32 = {}, {}
    for grid in ((3, 4), (3, 3)):
        one = fp32[grid] = _cp_step(cfg, state, ParallelLayout(), torch.float32, grid, backward=True)
        two = _cp_step(cfg, state, ParallelLayout(ulysses=2), torch.float32, grid, backward=True)
        out[f"cp2_{grid[1]}"] = _rel(two["v"], one["v"])
        out[f"cp2_{grid[1]}_n_local"] = two["n_local"]
        g1, g2 = one["grads"], two["grads"]
        out[f"cp2_{grid[1]}_grads"] = (len(g1), set(g1) == set(g2), max(_rel(g2[k], g1[k]) for k in g1))
    g3 = _cp_step(cfg, state, ParallelLayout(ulysses=2), torch.float32, (3, 3), backward=True,
                  gathered_loss=True)["grads"]
    out["cp2_gathered_loss_grads"] = max(_rel(g3[k], g1[k]) for k in g1)
    one16, two16 = (_cp_step(cfg, state, layout, torch.bfloat16, (3, 4), backward=False)["v"]
                    for layout in (ParallelLayout(), ParallelLayout(ulysses=2)))
    ref = fp32[(3, 4)]["v"]
    out["cp2_bf16"] = (_rel(two16, one16), _rel(two16, ref), _rel(one16, ref))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _load_checkpoint(cfg: dict, state: dict, layout: ParallelLayout, ckpt: str) -> bool:
    """Our model at `layout` loaded from the converted checkpoint gathers back to exactly the folder's tensors."""
    from megatron_omni.checkpoint.bagel import load_bagel_checkpoint
    from model_providers.bagel import provider

    groups = build_parallel_groups(layout)
    seed_everything(1, tp_rank=groups.tp.rank())
    model = provider.build_model(cfg, groups)
    load_bagel_checkpoint(model, ckpt)
    back = provider.export_bagel_state(model)
    return bool(back) and all(torch.equal(back[k], state[k]) for k in back)


def _parity(rank: int, world_size: int, folder: str, ckpt: str) -> dict:
    from model_providers.bagel import provider

    cfg, state = provider.read_bagel_folder(folder)
    b = cfg["bagel"]
    n = (IMAGE[0] // 16) * (IMAGE[1] // 16)
    latents = torch.randn(n, b["latent_patch_size"] ** 2 * b["vae_config"]["z_channels"],
                          generator=torch.Generator().manual_seed(11))
    ref = {dt: _reference(cfg, state, 1, dt, latents) for dt in (torch.float32, torch.bfloat16)}
    ref32, ref16 = ref[torch.float32]["v"], ref[torch.bfloat16]["v"]
    ref_tp2 = _reference(cfg, state, 2, torch.float32, latents)["v"]
    out = {"ref_loaded": (ref[torch.float32]["loaded"], ref[torch.float32]["n_params"]),
           "ref_bf16_vs_fp32": _rel(ref16, ref32), "ref_tp2_vs_tp1": _rel(ref_tp2, ref32)}
    gen = ref[torch.float32]["gen"]
    fp32, bf16 = torch.float32, torch.bfloat16
    for name, layout, dt in (("tp1", ParallelLayout(tp=1), fp32), ("tp2", ParallelLayout(tp=2), fp32),
                             ("pp2", ParallelLayout(pp=2), fp32), ("tp1_bf16", ParallelLayout(tp=1), bf16),
                             ("tp2_bf16", ParallelLayout(tp=2), bf16)):
        v, exact, n_mapped, out[f"{name}_numel"] = _ours(cfg, state, layout, dt, latents, gen)
        out[f"{name}_round_trip"] = exact
        out[f"{name}_mapped"] = n_mapped
        if v is not None:
            out[name] = _rel(v, ref32)
            if dt == torch.bfloat16:
                out[f"{name}_vs_ref_bf16"] = _rel(v, ref16)
    out["n_state"] = len(state) - len(provider.frozen_names(state))
    out["ckpt_tp2"] = _load_checkpoint(cfg, state, ParallelLayout(tp=2), ckpt)
    out["ckpt_pp2"] = _load_checkpoint(cfg, state, ParallelLayout(pp=2), ckpt)
    out["pp2_backward"] = _pp_backward(cfg, state, latents)
    out.update(_cp_parity(cfg, state))
    return out


@pytest.fixture(scope="module")
def figures(tiny_folder, checkpoint) -> list[dict]:
    results = run_ranks(_parity, 2, tiny_folder, checkpoint, timeout_s=400)
    print(results)
    return results


def test_reference_loads_every_bagel_tensor(figures) -> None:
    r = figures[0]
    loaded, n_params = r["ref_loaded"]
    assert loaded == n_params, r  # vLLM-Omni's loader found a tensor for every LLM parameter in our folder
    assert r["ref_tp2_vs_tp1"] < 1e-5, r


@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_velocity_fp32_equals_vllm_omni(figures, layout: str) -> None:
    errs = [r[layout] for r in figures if layout in r]
    assert errs and max(errs) < 1e-5, (layout, errs)
    for r in figures:
        assert r[f"{layout}_round_trip"], f"{layout}: weights gathered from the shards differ from those loaded"
    # every BAGEL tensor but the frozen ViT side is mapped (pp: the two stages together)
    assert sum(r[f"{layout}_mapped"] for r in figures) // (1 if layout == "pp2" else 2) == figures[0]["n_state"]


@pytest.mark.parametrize("layout", ["tp1_bf16", "tp2_bf16"])
def test_velocity_bf16_close_to_vllm_omni(figures, layout: str) -> None:
    for r in figures:
        # bf16 has 8 mantissa bits (relative step 2^-8 = 0.4%): both bf16 runs sit within a few steps of fp32.
        assert r[layout] < 3e-2 and r[f"{layout}_vs_ref_bf16"] < 3e-2, (layout, r)
        assert r["ref_bf16_vs_fp32"] < 3e-2, r


# ------------------------------------------------------------------------------------------ conversion


def test_checkpoint_loads_at_tp2_and_pp2(figures) -> None:
    assert all(r["ckpt_tp2"] and r["ckpt_pp2"] for r in figures), figures


def test_folder_round_trip_is_exact(tiny_folder, checkpoint, tmp_path) -> None:
    """BAGEL folder -> Megatron checkpoint -> BAGEL folder: every tensor of ema.safetensors identical (dtype and
    bytes), the configs equal, ae.safetensors copied byte for byte."""
    from safetensors.torch import load_file

    from tools.checkpoint.convert import main

    out = tmp_path / "back"
    assert main(["mcore-to-hf", checkpoint, str(out), "--pipeline-source", tiny_folder, "--no-progress"]) == 0
    a, b = load_file(f"{tiny_folder}/ema.safetensors"), load_file(str(out / "ema.safetensors"))
    assert set(a) == set(b)
    assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    for name in ("config.json", "llm_config.json", "vit_config.json"):
        assert json.loads((out / name).read_text()) == json.loads(open(f"{tiny_folder}/{name}").read()), name
    assert (out / "ae.safetensors").read_bytes() == open(f"{tiny_folder}/ae.safetensors", "rb").read()


def test_bad_folder_fails_naming_the_tensor(tiny_folder, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from megatron_omni.checkpoint.bagel import bagel_to_mcore
    from megatron_omni.checkpoint.errors import CheckpointError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_folder, broken)
    state = load_file(str(broken / "ema.safetensors"))
    gone = "language_model.model.layers.1.self_attn.k_proj_moe_gen.weight"
    del state[gone]
    save_file(state, str(broken / "ema.safetensors"))
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        bagel_to_mcore(broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_pp2_backward_under_1f1b_equals_pp1(figures) -> None:
    """Megatron-Core's 1F1B schedule over BAGEL's MoT layers at pp 2 (2 micro-batches): every trained tensor's
    gradient on each stage equals pp 1's (fp32)."""
    for r in figures:
        g = r["pp2_backward"]
        assert g["n"] > 0 and g["none"] == 0 and g["max_rel"] < 1e-5, g


def test_cp2_generation_step_equals_cp1(figures) -> None:
    """Context parallelism 2 over the image query (k/v all-gathered over the cp group) gives cp 1's velocity and,
    summed over the cp ranks, every gradient (the weights' and the latents'), fp32, on an even (3 x 4 latents: 7 + 7
    packed tokens) and an uneven (3 x 3: 5 + 6) split, with each rank's loss on its shard or on the gathered
    velocity over cp; bf16 within a few bf16 steps of fp32."""
    for rank, r in enumerate(figures):
        for w in (4, 3):
            assert r[f"cp2_{w}"] < 1e-5, r
            n_grads, same_set, max_rel = r[f"cp2_{w}_grads"]
            assert n_grads > 20 and same_set and max_rel < 1e-5, r[f"cp2_{w}_grads"]
        assert r["cp2_4_n_local"] == 6, r  # 14 tokens: [start, 6 latents] | [6 latents, end]
        assert r["cp2_3_n_local"] == 4 + rank, r  # 11 tokens: [start, 4 latents] | [5 latents, end]
        assert all(e < 3e-2 for e in r["cp2_bf16"]), r["cp2_bf16"]
        # a loss on `gather_velocity`'s whole velocity, divided by cp, gives the same gradients
        assert r["cp2_gathered_loss_grads"] < 1e-5, r


@pytest.mark.parametrize("layout,tp,pp", [("tp1", 1, 1), ("tp2", 2, 1), ("pp2", 1, 2)])
def test_planner_counts_equal_the_built_model(figures, layout: str, tp: int, pp: int) -> None:
    """The planner's MoT cost model counts what each rank of the built model holds: all parameters, the
    generation expert's share (what trains when the understanding expert is frozen), what trains with both experts
    (`model.bagel_experts=both`) and LoRA's adapters."""
    from megatron_omni.planner.mot import lora_parameter_counts, rank_parameter_counts

    total = rank_parameter_counts("tiny", tp, pp)
    gen = rank_parameter_counts("tiny", tp, pp, trainable="gen")
    both = rank_parameter_counts("tiny", tp, pp, trainable="both")
    lora = lora_parameter_counts("tiny", tp, pp, rank=4)  # rank-4 adapters on the default generation linears
    for rank, r in enumerate(figures):
        stage = rank if pp > 1 else 0
        assert r[f"{layout}_numel"] == (total[stage], gen[stage], both[stage], lora[stage]), (layout, rank,
                                                                                             r[f"{layout}_numel"])
