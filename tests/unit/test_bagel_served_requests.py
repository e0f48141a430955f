"""The served BAGEL engine's request protocol and folder check (`rollout.vllm_omni.bagel_served`), without an engine:
a request carries what the worker's sample needs and parses back to it; the workers' one-sample records join into the
call's trajectory in row order, and records of different calls are refused; a folder missing a file of the published
layout is refused by name before any engine starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_omni.rollout.vllm_omni.bagel import BagelSampling, BagelTrajectory
from megatron_omni.rollout.vllm_omni.bagel_served import (
    check_folder,
    concat_records,
    parse_request,
    sample_request,
    sampling_extra,
    trajectory_record,
)
from megatron_omni.rollout.vllm_omni.pipeline import EXTRA_KEY


def _one(seed: int, noise_level: float = 0.7) -> BagelTrajectory:
    g = torch.Generator().manual_seed(seed)
    return BagelTrajectory(
        prompt_ids=[torch.tensor([1, 10 + seed, 2])], latents=torch.randn(1, 2, 4, 16, generator=g),
        next_latents=torch.randn(1, 2, 4, 16, generator=g), sigmas=torch.rand(1, 2, generator=g),
        sigmas_next=torch.rand(1, 2, generator=g), cfg_scales=torch.ones(1, 2),
        log_probs=torch.randn(1, 2, generator=g),
        sigma_after_one=torch.full((1,), 0.9), noise_level=noise_level, sde_type="sde", cfg_renorm_min=0.0,
        cfg_img_scale=1.0, grid=(2, 2), images=torch.rand(1, 3, 32, 32, generator=g), group_ids=torch.tensor([seed]),
        seeds=[seed], final_latents=torch.randn(1, 4, 16, generator=g))


def test_a_request_parses_back_to_its_sample() -> None:
    sampling = BagelSampling(num_timesteps=5, window_range=(0, 2), cfg_text_scale=4.0, cfg_interval=(0.4, 1.0))
    prompt = sample_request(torch.tensor([1, 17, 42, 2]), seed=7, index=3, group_id=1)
    sp = SimpleNamespace(extra_args={EXTRA_KEY: sampling_extra(sampling)})
    ids, parsed, seed, index, group = parse_request(prompt, sp)
    assert ids.tolist() == [1, 17, 42, 2] and (seed, index, group) == (7, 3, 1)
    assert parsed == sampling  # tuples restored (window range, CFG interval)
    with pytest.raises(ValueError, match="extra_args"):
        parse_request(prompt, SimpleNamespace(extra_args={}))
    with pytest.raises(ValueError, match=r"lacks \['seed'\]"):
        info = dict(prompt["additional_information"][EXTRA_KEY])
        del info["seed"]
        parse_request({"prompt": "", "additional_information": {EXTRA_KEY: info}}, sp)


def test_records_join_in_row_order_and_other_calls_are_refused() -> None:
    parts = [_one(s) for s in (5, 6, 7)]
    records = [trajectory_record(t, i) for i, t in enumerate(parts)]
    joined = concat_records([records[2], records[0], records[1]])  # in the order they finished
    assert joined.seeds == [5, 6, 7] and len(joined) == 3
    for f in dataclasses.fields(BagelTrajectory):
        value = getattr(joined, f.name)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, torch.cat([getattr(t, f.name) for t in parts])), f.name
    with pytest.raises(ValueError, match="disagree on noise_level"):
        concat_records([records[0], trajectory_record(_one(8, noise_level=1.0), 1)])


def test_a_folder_missing_a_file_is_refused_by_name(tmp_path: Path) -> None:
    import json

    from model_providers.bagel.provider import bagel_config

    cfg, folder = bagel_config("tiny"), tmp_path  # the published layout's files (the weights' contents unread)
    (folder / "config.json").write_text(json.dumps(dict(cfg["bagel"], new_token_ids=cfg["tokens"])))
    for name in ("llm_config", "vit_config"):
        (folder / f"{name}.json").write_text(json.dumps(cfg[name]))
    for name in ("ema.safetensors", "ae.safetensors"):
        (folder / name).write_bytes(b"")
    check_folder(folder)
    (folder / "ae.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no ae.safetensors"):
        check_folder(folder)
    (folder / "llm_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="llm_config.json is missing"):
        check_folder(folder)
