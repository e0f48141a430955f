"""A weighted reward of two scorers served on their own workers, through a real training run:
`--set reward.scorer="0.7*pickscore+0.3*ocr"` (PickScore a tiny random CLIP in the PickScore_v1 folder layout)
writes each term's mean/std beside the combined reward; missing weights stop the server with exit 2 naming the
path; a server that combines other terms than the config names is refused by the trainer's preflight."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from megatron_omni.reward.errors import RewardServiceError
from megatron_omni.reward.launcher import RewardServerProcess
from megatron_omni.trainer.rewards import RewardPreflightError, preflight
from tests.e2e import zygote
from tests.unit.reward_models import save_clip_folder

ROOT = Path(__file__).resolve().parents[2]
SPEC = "0.7*pickscore+0.3*ocr"


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = str(tmp_path_factory.mktemp("pickscore") / "PickScore_v1")
    save_clip_folder(folder, seed=5)
    return folder


def _server(folder: str, reward: str = SPEC) -> RewardServerProcess:
    return RewardServerProcess("pickscore@cpu", extra_args=[
        "--scorer", "ocr@cpu", "--reward", reward, "--scorer-kwargs", json.dumps({"pickscore": {"model": folder}})])


def _train(run_dir: Path, url: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [*zygote.python_m("megatron_omni.train"), "--recipe", "examples.tiny.recipe:ocr_demo",
           "--set", f"run_dir={run_dir}", "--set", "steps=2", "--set", "rollout.prompts_per_step=2",
           "--set", "rollout.group_size=2", "--set", "checkpoint.every=0", "--set", "logging.image_every=0",
           "--set", f"reward.url={url}", "--set", f"reward.scorer={SPEC}", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_weighted_reward_through_the_server_logs_each_term(clip_folder: str, tmp_path: Path) -> None:
    with _server(clip_folder) as srv:
        health = srv.health()
        assert health["scorers"]["pickscore"]["ready"] and health["scorers"]["ocr"]["devices"] == ["cpu"]
        assert health["terms"] == {"pickscore": {"weight": 0.7, "required": True},
                                   "ocr": {"weight": 0.3, "required": True}}
        proc = _train(tmp_path / "run", srv.url, "--set", "logging.tensorboard=true",
                      "--set", "reward.term_advantages=true")  # GDPO advantages on the trainer's path
        assert proc.returncode == 0, proc.stderr[-3000:]
        # The trainer's preflight refuses a server whose terms differ from its reward.scorer.
        with pytest.raises(RewardPreflightError, match=r"serves the reward 0.7\*pickscore\+0.3\*ocr but"):
            preflight(srv.url, scorer="0.5*pickscore+0.5*ocr")
        assert preflight(srv.url, scorer=SPEC)["status"] == "ok"
    assert (tmp_path / "run" / "reward_curve.png").exists() and list((tmp_path / "run" / "samples").glob("*.png"))
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        p, o = r["reward_term/pickscore_mean"], r["reward_term/ocr_mean"]
        assert 0.0 <= o <= 1.0 and r["reward_term/pickscore_failed"] == 0.0 and r["reward_term/ocr_failed"] == 0.0
        assert r["reward_mean"] == pytest.approx(0.7 * p + 0.3 * o, abs=1e-5)
        assert r["reward_term/pickscore_std"] >= 0.0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = [d for d in (tmp_path / "run").rglob("events.out.tfevents*")]
    assert tb, "no TensorBoard events"
    acc = EventAccumulator(str(tb[0].parent))
    acc.Reload()
    assert {"reward_term/pickscore_mean", "reward_term/ocr_mean"} <= set(acc.Tags()["scalars"])


def test_missing_weights_stop_the_server_with_exit_2(tmp_path: Path) -> None:
    missing = str(tmp_path / "no_such_folder")
    server = RewardServerProcess("pickscore@cpu", extra_args=[  # one worker: only the failing scorer is built
        "--scorer-kwargs", json.dumps({"pickscore": {"model": missing}})])
    with pytest.raises(RewardServiceError) as info:
        server.start()
    msg = str(info.value)
    assert "exited with 2" in msg and missing in msg and "PickScore_v1" in msg, msg


def test_failed_optional_term_is_named_required_one_fails_the_request() -> None:
    from megatron_omni.reward.client import RewardClient
    from megatron_omni.reward.errors import RewardServiceError as ServiceError

    opt, req = "tests.unit.test_reward_terms:flaky_optional", "tests.unit.test_reward_terms:flaky_required"
    srv = RewardServerProcess("jpeg_compressibility@cpu", extra_args=[
        "--scorer", f"{opt}@cpu", "--scorer", f"{req}@cpu", "--reward", f"0.5*jpeg_compressibility+2*{opt}?+{req}"])
    image = np.full((16, 16, 3), 255, np.uint8)
    with srv, RewardClient(srv.url, timeout_s=30) as client:
        jpeg = client.score([image], [""])[0] - 2.0 - 1.0  # all terms up: 0.5*jpeg + 2*1.0 + 1.0
        client.submit(0, image, "", {"fail_optional": True})
        client.submit(1, image, "")
        r = client.gather()
        failed, ok = client.last_details
        assert "flaky_optional asked to fail" in failed["failed"][opt] and opt not in failed["terms"]
        assert r[0] == pytest.approx(jpeg + 1.0) and r[1] == pytest.approx(jpeg + 3.0) and ok["failed"] == {}
        assert ok["terms"][opt] == 1.0 and ok["weights"] == {"jpeg_compressibility": 0.5, opt: 2.0, req: 1.0}
        with pytest.raises(ServiceError, match="500 scorer .*flaky_required failed"):
            client.score([image], [""], [{"fail_required": True}])
        health = srv.health()
    assert health["pending"] == 0 and health["stats"]["errors"] == 1
    assert set(health["scorers"]) == {"jpeg_compressibility", opt, req}
