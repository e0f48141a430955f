"""Converted checkpoints meet the Megatron model at real layouts.

- Round trip: diffusers -> `hf-to-mcore` -> loaded into the model at TP=2 x PP=2 and saved again by
  Megatron's own `dist_checkpointing.save` (4 ranks, each writing its shards) -> `mcore-to-hf` ->
  diffusers, with byte-identical tensors, for the tiny preset (fp32) and a random shape (bf16).
- Forward: the converted checkpoint loaded at TP=2 and at TP=1 gives the same forward as diffusers on
  the original weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_omni.checkpoint.convert import hf_to_mcore, mcore_to_hf
from megatron_omni.checkpoint.sharded_state import load_model_checkpoint, read_content_metadata, save_model_checkpoint
from megatron_omni.checkpoint.summary import inspect_checkpoint
from megatron_omni.models.dit.model import DiTBatch
from megatron_omni.parallel import ParallelLayout, build_parallel_groups
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.parallel.rank_pool import run_ranks
from model_providers.qwen_image import provider
from tests.unit.test_checkpoint_convert import random_config, tensor_hashes, write_diffusers

GRID = (1, 4, 6)
S_TXT = 5


def _resave(rank: int, world_size: int, jobs: list[tuple[str, str, str]]) -> list[int]:
    """Load each converted checkpoint at TP=2 x PP=2 and save it again from the sharded model."""
    params = []
    for ckpt_in, ckpt_out, dtype in jobs:
        groups = build_parallel_groups(ParallelLayout(tp=2, pp=2))
        seed_everything(0, tp_rank=groups.tp.rank())
        diffusers_config = read_content_metadata(ckpt_in)["diffusers_config"]
        cfg = provider.transformer_config(diffusers_config, tp=2, pp=2, params_dtype=getattr(torch, dtype))
        # As Megatron's Float16Module does for bf16 training: the non-Megatron layers (nn.Linear/RMSNorm)
        # are built in fp32 and cast with the rest.
        model = provider.build_model(cfg, groups).to(getattr(torch, dtype))
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # anything the load does not overwrite would show in the hashes
        load_model_checkpoint(model, ckpt_in)
        save_model_checkpoint(model, ckpt_out, "qwen_image", diffusers_config)
        params.append(sum(p.numel() for p in model.parameters()))
    return params


def test_round_trip_through_tp2_pp2(tmp_path: Path) -> None:
    cases = [("tiny", torch.float32), (random_config(11), torch.bfloat16)]
    jobs, sources = [], []
    for i, (config, dtype) in enumerate(cases):
        src = write_diffusers(tmp_path / f"hf{i}", config, seed=i, dtype=dtype)
        hf_to_mcore(src, tmp_path / f"mcore{i}", progress=False)
        jobs.append((str(tmp_path / f"mcore{i}"), str(tmp_path / f"tp2pp2-{i}"), str(dtype).removeprefix("torch.")))
        sources.append(src)
    per_rank = run_ranks(_resave, 4, jobs, timeout_s=300)
    for i, (config, _) in enumerate(cases):
        # Each rank held a quarter of the blocks' tp-split weights: the checkpoint really was sharded.
        assert sum(r[i] for r in per_rank) < 2 * provider.parameter_count(config)
        info = inspect_checkpoint(tmp_path / f"tp2pp2-{i}")
        assert info["layout"].startswith("saved at tp=2 pp=2"), info["layout"]
        mcore_to_hf(tmp_path / f"tp2pp2-{i}", tmp_path / f"back{i}", progress=False)
        assert tensor_hashes(tmp_path / f"back{i}") == tensor_hashes(sources[i]), config


def _forward(rank: int, world_size: int, hf_dir: str, ckpt: str) -> dict[str, float]:
    from diffusers import QwenImageTransformer2DModel

    g = torch.Generator().manual_seed(5)
    cfg = provider.hf_config("tiny")
    s_img = GRID[0] * GRID[1] * GRID[2]
    latents = torch.randn(2, s_img, cfg["in_channels"], generator=g)
    prompt = torch.randn(2, S_TXT, cfg["joint_attention_dim"], generator=g)
    mask = torch.ones(2, S_TXT, dtype=torch.bool)
    mask[1, 3:] = False
    sigma = torch.rand(2, generator=g)
    ref_model = QwenImageTransformer2DModel.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        ref = ref_model(hidden_states=latents, encoder_hidden_states=prompt, encoder_hidden_states_mask=mask,
                        timestep=sigma, img_shapes=[[GRID]] * 2).sample
    errors = {}
    for tp in (2, 1):  # tp=1 on two ranks: two data-parallel replicas, each loading the whole model
        groups = build_parallel_groups(ParallelLayout(tp=tp))
        seed_everything(0, tp_rank=groups.tp.rank())
        model = provider.build_model(provider.transformer_config("tiny", tp=tp), groups).eval()
        load_model_checkpoint(model, ckpt)
        with torch.no_grad():
            out = model(DiTBatch(latents, prompt, mask, sigma, GRID))
        errors[f"tp{tp}"] = float((out - ref).norm() / ref.norm())
    return errors


def test_converted_checkpoint_forward_matches_diffusers(tmp_path: Path) -> None:
    src = write_diffusers(tmp_path / "hf", "tiny", seed=3)
    hf_to_mcore(src, tmp_path / "mcore", progress=False)
    for errors in run_ranks(_forward, 2, str(src), str(tmp_path / "mcore"), timeout_s=300):
        assert set(errors) == {"tp2", "tp1"}
        for layout, err in errors.items():
            assert err < 1e-5, (layout, err)
