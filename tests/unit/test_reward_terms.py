"""Weighted rewards term by term: optional terms that fail are left out and named, required ones raise; the
trainer's RewardTerms (exclusion by name, per-term metrics); GDPO-style per-term advantages against the formula;
the server's several-scorer command line and config file."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megatron_omni.algorithms.advantages import group_advantages, term_advantages
from megatron_omni.reward.registry import build_scorer, parse_terms, scorer_names
from megatron_omni.reward.scorers import WeightedSum
from megatron_omni.reward.server import parse_args
from megatron_omni.trainer.rewards import RewardPreflightError, RewardTerms, check_terms

IMAGES = [np.full((16, 16, 3), v, np.uint8) for v in (0, 128, 255)]


def flaky_optional(images, prompts, metadata):  # noqa: ANN001, ANN201 (a user scorer: fn(images, prompts, meta))
    """Mean brightness in [0, 1]; fails the whole batch when a sample's metadata asks."""
    if any(m.get("fail_optional") for m in metadata):
        raise RuntimeError("flaky_optional asked to fail")
    return [float(np.asarray(im).mean() / 255.0) for im in images]


def flaky_required(images, prompts, metadata):  # noqa: ANN001, ANN201
    """1.0 per image; fails when a sample's metadata asks."""
    if any(m.get("fail_required") for m in metadata):
        raise RuntimeError("flaky_required asked to fail")
    return [1.0] * len(images)


OPT = "tests.unit.test_reward_terms:flaky_optional"
REQ = "tests.unit.test_reward_terms:flaky_required"


def test_spec_marks_optional_terms() -> None:
    want = [("jpeg_compressibility", 0.7, True), (OPT, 0.3, False)]
    assert parse_terms(f"0.7*jpeg_compressibility+0.3*{OPT}?") == want
    assert parse_terms("ocr") == [("ocr", 1.0, True)]
    assert scorer_names(f"0.7*jpeg_compressibility+0.3*{OPT}?") == ["jpeg_compressibility", OPT]


def test_failed_optional_term_is_left_out_and_named_required_raises() -> None:
    s = build_scorer(f"0.5*jpeg_compressibility+2*{OPT}?+1*{REQ}")
    assert isinstance(s, WeightedSum) and s.required == {"jpeg_compressibility": True, OPT: False, REQ: True}
    jpeg = build_scorer("jpeg_compressibility")(IMAGES, [""] * 3)
    ok = s(IMAGES, [""] * 3)
    assert ok == pytest.approx([0.5 * j + 2 * (v / 255) + 1.0 for j, v in zip(jpeg, (0, 128, 255))])
    values, failed = s.term_scores(IMAGES, [""] * 3, [{"fail_optional": True}, {}, {}])
    assert set(values) == {"jpeg_compressibility", REQ} and "flaky_optional asked to fail" in failed[OPT]
    assert s(IMAGES, [""] * 3, [{"fail_optional": True}, {}, {}]) == pytest.approx([0.5 * j + 1.0 for j in jpeg])
    with pytest.raises(RuntimeError, match="flaky_required asked to fail"):
        s(IMAGES, [""] * 3, [{"fail_required": True}, {}, {}])


def test_reward_terms_exclude_a_failed_term_for_every_sample() -> None:
    details = [{"terms": {"a": 1.0, "b": 0.5}, "failed": {}, "weights": {"a": 0.7, "b": 0.3}},
               {"terms": {"a": 3.0}, "failed": {"b": "RuntimeError: down"}, "weights": {"a": 0.7, "b": 0.3}}]
    t = RewardTerms.from_details(details)
    assert t.names == ["a", "b"] and t.excluded() == ["b"]
    # b scored on sample 0 but failed on sample 1: it is left out of both, so the group compares like with like.
    assert t.combined().tolist() == pytest.approx([0.7, 2.1])
    assert t.combined([]).tolist()[0] == pytest.approx(0.7 + 0.15)
    m = t.metrics(t.excluded())
    assert m["reward_term/a_mean"] == 2.0 and m["reward_term/a_std"] == 1.0 and m["reward_term/b_mean"] == 0.5
    assert m["reward_term/b_failed"] == 1.0 and m["reward_term/a_failed"] == 0.0
    first, second = t.rows(0, 1), t.rows(1, 2)  # the asynchronous loop's shares per data-parallel rank
    assert first.failed == {} and second.failed == {"b": "RuntimeError: down"} and first.excluded() == []
    assert RewardTerms.concat([first, second]).excluded() == ["b"]  # gathered again: left out everywhere
    both = RewardTerms.concat([t, RewardTerms.from_details(details[:1])])
    assert both.values.shape == (3, 2) and RewardTerms.from_details([{"terms": {}, "weights": {}}]) is None


@pytest.mark.parametrize("std_mode", ["global", "group"])
def test_term_advantages_normalise_each_term_before_the_sum(std_mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    gids = torch.arange(4).repeat_interleave(4)
    terms = torch.stack([20 + 2 * torch.randn(16, generator=g), torch.rand(16, generator=g)], dim=1)
    w = torch.tensor([0.7, 0.3])
    got = term_advantages(terms, w, gids, std_mode=std_mode, clip=None).advantages.double()
    t = terms.double().numpy()
    s = np.zeros(16)
    for k in range(2):
        r = t[:, k]
        mean = np.array([r[gids.numpy() == i].mean() for i in gids.numpy()])
        std = r.std() if std_mode == "global" else np.array([r[gids.numpy() == i].std() for i in gids.numpy()])
        s += w[k].item() * (r - mean) / (std + 1e-4)
    want = (s - s.mean()) / (s.std() + 1e-4)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6, atol=1e-6)
    # Not the same as normalising the weighted sum: the large-scale term no longer dominates.
    plain = group_advantages((terms * w).sum(1), gids, std_mode=std_mode, clip=None).advantages.double()
    assert not torch.allclose(plain, got, atol=1e-2)


def test_preflight_terms_must_match_the_config() -> None:
    served = {"pickscore": {"weight": 0.7, "required": True}, "ocr": {"weight": 0.3, "required": False}}
    check_terms("http://x", "0.7*pickscore+0.3*ocr?", served)
    with pytest.raises(RewardPreflightError, match=r"serves the reward 0.7\*pickscore\+0.3\*ocr\? but"):
        check_terms("http://x", "0.7*pickscore+0.3*ocr", served)


def test_server_cli_several_scorers_and_config_file(tmp_path, capsys: pytest.CaptureFixture) -> None:
    cfg, _ = parse_args(["--scorer", "pickscore@type:6,type:7", "--scorer", "ocr@cpu", "--reward",
                         "0.7*pickscore+0.3*ocr?", "--scorer-kwargs", '{"pickscore": {"model": "/m"}}'])
    assert cfg.scorers == {"pickscore": ["type:6", "type:7"], "ocr": [None]}
    assert cfg.reward == "0.7*pickscore+0.3*ocr?" and cfg.options == {"pickscore": {"model": "/m"}}
    conf = tmp_path / "reward.json"
    conf.write_text(json.dumps({"reward": "pickscore+ocr", "scorers": {
        "pickscore": {"devices": ["type:1"], "kwargs": {"model": "/m"}}, "ocr": {}}}))
    cfg, _ = parse_args(["--config", str(conf)])
    assert cfg.scorers == {"pickscore": ["type:1"], "ocr": [None]} and cfg.options["pickscore"] == {"model": "/m"}
    for argv, msg in ((["--scorer", "0.5*ocr+0.5*pickscore@cpu"], "is not one scorer"),
                      (["--scorer", "nosuch@cpu"], "unknown scorer 'nosuch'"),
                      (["--scorer", "ocr@cpu", "--scorer", "ocr@cpu"], "given twice"),
                      (["--scorer", "ocr@cpu", "--reward", "0.5*ocr+0.5*pickscore"], "names the terms")):
        with pytest.raises(SystemExit) as info:
            parse_args(argv)
        assert info.value.code == 2 and msg in capsys.readouterr().err, argv


def test_eval_grid_and_curve_show_every_term(tmp_path) -> None:
    from PIL import Image

    from megatron_omni.trainer.evaluation import EvalResult
    from megatron_omni.trainer.metrics import reward_captions, save_reward_curve

    terms = RewardTerms(["pickscore", "ocr"], [0.7, 0.3],
                        torch.tensor([[20.0, 0.5], [22.0, float("nan")], [18.0, 1.0]], dtype=torch.float64))
    res = EvalResult(["a", "b", "c"], [1, 2, 3], torch.rand(3, 3, 8, 8), torch.tensor([1.0, 2.0, 3.0]), terms)
    summary = res.summary(seen={"a"})
    assert summary["reward_term/pickscore_mean"] == 20.0 and summary["reward_term/ocr_mean"] == 0.75
    res.save(tmp_path / "e.npz")
    back = EvalResult.load(tmp_path / "e.npz")
    assert back.terms.names == terms.names and torch.equal(back.terms.values.isnan(), terms.values.isnan())
    caps = reward_captions(res.prompts, res.rewards.tolist(), terms)
    assert caps[0] == "a\nr=1\npickscore=20 ocr=0.5" and caps[1].endswith("ocr=-")
    assert reward_captions(["a"], [1.0]) == ["a\nr=1"]
    history = [{"step": s, "reward_mean": 0.1 * s, "reward_std": 0.1, "reward_term/pickscore_mean": 20 + s,
                "reward_term/pickscore_std": 1.0, "reward_term/ocr_mean": 0.1 * s, "reward_term/ocr_std": 0.0}
               for s in range(3)]
    save_reward_curve(history, tmp_path / "with.png", [{"step": 2, "reward_mean": 0.3, "reward_term/ocr_mean": 0.2}])
    save_reward_curve([{k: h[k] for k in ("step", "reward_mean", "reward_std")} for h in history], tmp_path / "no.png")
    # One panel per term below the combined reward's.
    assert Image.open(tmp_path / "with.png").height > 2 * Image.open(tmp_path / "no.png").height


@pytest.mark.parametrize("per_term", [False, True])
def test_trainer_leaves_a_failed_optional_term_out_of_the_step(per_term: bool) -> None:
    from types import SimpleNamespace

    from megatron_omni.trainer.config import JobConfig
    from megatron_omni.trainer.flowgrpo import FlowGRPOTrainer

    cfg = JobConfig()
    cfg.reward.term_advantages = per_term
    g = torch.Generator().manual_seed(1)
    values = torch.stack([20 + torch.randn(8, generator=g, dtype=torch.float64),
                          torch.rand(8, generator=g, dtype=torch.float64)], dim=1)
    values[3, 1] = float("nan")  # the optional OCR term failed on one sample's batch
    terms = RewardTerms(["pickscore", "ocr"], [0.7, 0.3], values, {"ocr": "RuntimeError: down"})
    one_rank = SimpleNamespace(size=lambda: 1)
    trainer = SimpleNamespace(cfg=cfg, reward_fn=SimpleNamespace(terms=terms), groups=SimpleNamespace(dp=one_rank))
    gids = torch.arange(2).repeat_interleave(4)
    served = torch.zeros(8)  # what the server summed per sample; the step recombines without the failed term
    adv, rewards, metrics = FlowGRPOTrainer.advantages_of(trainer, served, served, gids)
    torch.testing.assert_close(rewards, (0.7 * values[:, 0]).float())
    assert metrics["reward_term/ocr_failed"] == 1.0 and metrics["reward_term/pickscore_failed"] == 0.0
    want = (term_advantages(values[:, :1], torch.tensor([0.7]), gids) if per_term
            else group_advantages(rewards, gids))
    torch.testing.assert_close(adv.advantages, want.advantages)
    # Without terms (one scorer) the gathered rewards are used as they are.
    trainer.reward_fn.terms = None
    adv, rewards, metrics = FlowGRPOTrainer.advantages_of(trainer, served + 1, served + 1, gids)
    assert metrics == {} and torch.equal(rewards, served + 1)
