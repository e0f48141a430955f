"""FlowGRPO with LoRA end to end, as users run it (`python -m megatron_omni.train --set model.lora.rank=8`):

- diffusers engine, bf16 base and bf16 engine, adapter-only sync through peft: the reward rises, the probe
  after every sync is exact, a SIGKILLed run resumed with `--resume auto` ends bit-identical to an
  uninterrupted one (adapters, their Adam state, the rewards), its checkpoints hold the adapters only and the
  base's identity, a resume with other LoRA settings is refused naming them, and `convert.py lora-to-hf`
  (adapter file and `--merge` pipeline) exports the final checkpoint;
- vLLM-Omni's real `Omni` engine (the default `rollout.vllm_omni_process=engine`: worker processes), the adapters
  alone over `collective_rpc` into vLLM-Omni's own LoRA layers in every worker (`rollout.lora_sync=auto` picks
  it): the reward rises, probe-checked after every sync.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.test_flowgrpo_train import (
    FP32_VAE,
    ROOT,
    _assert_same_state,
    _Background,
    _env,
    _final_state,
    _kill_after_checkpoint,
    _rewards,
    _train,
    reward_gain,
)

LORA = ["--set", "model.lora.rank=8", "--set", "model.lora.alpha=16", "--set", "optim.lr=5e-2"]


def _metric(run_dir: Path, key: str) -> list[float]:
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rises(r: list[float]) -> bool:
    return reward_gain(r) > 0.05


@pytest.fixture(scope="module")
def vllm_lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, _Background]]:
    """The vLLM-Omni LoRA run, started when the module's first test starts and read by its own test: it depends on
    nothing else and fills the cores the bf16 test's one-rank runs leave idle (the suite's budget)."""
    run = tmp_path_factory.mktemp("vllm_lora") / "vllm_lora"
    with _Background(run, *LORA, "--set", "rollout.engine=vllm_omni", "--set", "steps=6") as background:
        yield run, background


@pytest.mark.slow
def test_lora_bf16_reward_rises_resumes_bit_identically_and_exports(vllm_lora: tuple, tmp_path: Path) -> None:
    steps = [*LORA, "--set", "model.params_dtype=bf16", "--set", "rollout.dtype=bf16", *FP32_VAE,
             "--set", "rollout.transformer=engine", "--set", "steps=4", "--set", "checkpoint.every=2",
             "--set", "checkpoint.keep=5"]
    ref, run = tmp_path / "uninterrupted", tmp_path / "killed"
    # One rank each: the uninterrupted run goes on while the other is killed, refused and resumed.
    with _Background(ref, *steps) as uninterrupted:
        _kill_after_checkpoint(run, 2, *steps)
        assert not (run / "checkpoints" / "step_000004").exists(), "the run finished before it was killed"
        other = _train(run, *steps, "--set", "model.lora.rank=4", "--resume", "auto")
        assert other.returncode == 2 and "its lora is" in other.stderr, other.stderr[-2000:]
        with _Background(run, *steps, "--resume", "auto") as resuming:
            proc = uninterrupted.result()
            assert proc.returncode == 0, proc.stderr[-3000:]
            r = _rewards(ref)
            print("LoRA bf16 diffusers reward per step:", [f"{x:.3f}" for x in r])
            assert len(r) == 4 and _rises(r), r
            assert max(_metric(ref, "sync_probe_max_diff")) == 0.0  # bf16 trainer and bf16 engine: the same math

            final = _final_state(ref, 4)
            assert final["model"] and all(k.startswith("lora.") for k in final["model"]), sorted(final["model"])[:4]
            from megatron_omni.checkpoint.sharded_state import read_content_metadata

            meta = read_content_metadata(ref / "checkpoints" / "step_000004")
            assert meta["lora"]["rank"] == 8 and meta["lora"]["base"]["path"] == str((ref / "pipeline").resolve())

            # The two exports of the final checkpoint at once (independent one-process commands).
            exports = {}
            for extra in ([], ["--merge"]):
                out = tmp_path / f"export{''.join(extra)}"
                cmd = [sys.executable, "tools/checkpoint/convert.py", "lora-to-hf",
                       str(ref / "checkpoints" / "step_000004"), str(out), *extra]
                exports[out, "model_index.json" if extra else "pytorch_lora_weights.safetensors"] = subprocess.Popen(
                    cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                for (out, name), export in exports.items():
                    err = export.communicate(timeout=300)[1]
                    assert export.returncode == 0, err[-2000:]
                    assert (out / name).is_file()
            finally:
                for export in exports.values():
                    if export.poll() is None:
                        export.kill()
                        export.communicate()
            resumed = resuming.result()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    _assert_same_state(final, _final_state(run, 4))
    assert _rewards(ref) == _rewards(run)


@pytest.mark.slow
def test_lora_adapters_into_vllm_omni_reward_rises(vllm_lora: tuple) -> None:
    run, background = vllm_lora
    proc = background.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout.lora_sync=auto: adapter (vllm_omni engine)" in proc.stdout, proc.stdout[-2000:]
    r = _rewards(run)
    print("LoRA vllm_omni (adapter sync) reward per step:", [f"{x:.3f}" for x in r])
    assert len(r) == 6 and _rises(r), r
    assert max(_metric(run, "sync_probe_max_diff")) < 1e-5
