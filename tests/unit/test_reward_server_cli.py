"""The reward server's command line (megatron_omni/reward/server.py parse_args)."""

from __future__ import annotations

import pytest

from megatron_omni.reward.server import LOOPBACK, parse_args


def test_defaults_bind_loopback() -> None:
    cfg, port_file = parse_args(["--scorer", "ocr"])
    assert cfg.host == LOOPBACK and cfg.port == 8000 and cfg.workers == 1 and cfg.devices is None
    assert cfg.token is None and port_file is None and cfg.scorer == "ocr"


def test_all_options() -> None:
    cfg, port_file = parse_args([
        "--scorer", '{"weighted": [{"scorer": "ocr", "weight": 1}]}', "--scorer-kwargs", '{"quality": 90}',
        "--host", "0.0.0.0", "--port", "0", "--devices", "cpu, cpu", "--max-queue", "8", "--max-batch", "4",
        "--batch-wait-ms", "5", "--timeout", "2.5", "--token", "t", "--port-file", "/tmp/p",
    ])  # fmt: skip
    assert cfg.scorer == {"weighted": [{"scorer": "ocr", "weight": 1}]} and cfg.scorer_kwargs == {
        "quality": 90
    }
    assert cfg.host == "0.0.0.0" and cfg.port == 0 and cfg.devices == ["cpu", "cpu"]
    assert (cfg.max_queue, cfg.max_batch, cfg.batch_wait_s, cfg.timeout_s) == (8, 4, 0.005, 2.5)
    assert cfg.token == "t" and port_file == "/tmp/p"


def test_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWARD_SERVER_TOKEN", "from-env")
    cfg, _ = parse_args(["--scorer", "ocr"])
    assert cfg.token == "from-env"


def test_bad_scorer_kwargs_exit(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--scorer", "ocr", "--scorer-kwargs", "[1]"])
    assert "JSON object" in capsys.readouterr().err


def test_cpus_pin_list() -> None:
    first = min(__import__("os").sched_getaffinity(0))
    cfg, _ = parse_args(["--scorer", "ocr", "--cpus", f"{first}-{first},{first}"])
    assert cfg.cpus == {first}
    assert parse_args(["--scorer", "ocr"])[0].cpus is None


@pytest.mark.parametrize("spec", ["x", "1-", "99999", ""])
def test_bad_cpus_exit(spec: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_args(["--scorer", "ocr", "--cpus", spec])
    assert exc.value.code == 2 and "--cpus" in capsys.readouterr().err
