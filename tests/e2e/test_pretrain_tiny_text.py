"""tools/pretrain_tiny_text.py as users run it, shortened: the folder it writes is a complete offline
pipeline, the same seed rebuilds it bit for bit, TP=2 (torchrun) trains the same model as TP=1, and an
existing folder is refused without being touched."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from megatron_omni.parallel.rank_pool import free_port
from tests.e2e import zygote
from tests.e2e.in_process import call_main

ROOT = Path(__file__).resolve().parents[2]
TOOL = str(ROOT / "tools" / "pretrain_tiny_text.py")
SHORT = ["--vae-steps", "3", "--vae-batch", "4", "--dataset-size", "64", "--max-steps", "4", "--batch-size", "8",
         "--eval-every", "2", "--eval-steps", "2", "--stop-ocr", "2.0"]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _command(out: Path, *args: str, nproc: int = 1) -> list[str]:
    """The tool (through torchrun for `nproc` > 1), each rank forked from this worker's zygote (tests/e2e/zygote)."""
    cmd = [*zygote.python_script(TOOL), "--out", str(out), *SHORT, *args]
    return cmd if nproc == 1 else zygote.torchrun(nproc, free_port(), cmd)


def _pretrain_at_once(*runs: tuple[Path, list[str], int]) -> None:
    """The tool run for each (out, args, nproc), all at the same time: independent runs (own folders and ports, one core
    per rank at OMP_NUM_THREADS=1) overlap on the two cores instead of waiting for each other (the suite's budget)."""
    procs = [subprocess.Popen(_command(out, *args, nproc=nproc), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for out, args, nproc in runs]
    try:
        for proc in procs:
            out = proc.communicate(timeout=600)[0]
            assert proc.returncode == 0, out[-6000:]
    finally:  # a failed or timed-out run: none of the others outlives the test
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()


def _assert_refused(argv: list[str], message: str, out: Path) -> None:
    """The tool's argument checks, in this process (no interpreter start per case): exit status 2, `message` on
    stderr, `out` not created."""
    import contextlib
    import io

    err = io.StringIO()
    with pytest.raises(SystemExit) as stop, contextlib.redirect_stderr(err):
        _tool().parse_args(argv)
    assert stop.value.code == 2 and message in err.getvalue() and not out.exists(), (argv, err.getvalue())


def _tool():
    """tools/pretrain_tiny_text.py as a module (tools/ is no package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_tiny_text", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> tuple[Path, Path]:
    """The default command run twice at once into two folders: the module's pipeline and its rebuild (same seed)."""
    root = tmp_path_factory.mktemp("pretrain")
    _pretrain_at_once((root / "pipeline", [], 1), (root / "again", [], 1))
    return root / "pipeline", root / "again"


@pytest.fixture(scope="module")
def built(builds: tuple[Path, Path]) -> Path:
    return builds[0]


def test_folder_is_a_complete_offline_pipeline(built: Path) -> None:
    from megatron_omni.rollout.base import SamplingParams
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
    from model_providers.ocr_miniature.text_miniature import MINIATURE

    record = json.loads((built / "pretrain.json").read_text())
    assert record["seed"] == 0 and record["transformer_steps"] == 4
    assert record["command"].startswith("python ") and "--max-steps 4" in record["command"]
    assert [h["step"] for h in record["history"]] == [2, 4]
    assert (built / "samples.png").stat().st_size > 0
    vae = json.loads((built / "vae" / "config.json").read_text())
    assert len(vae["latents_mean"]) == len(vae["latents_std"]) == 16 and vae["dim_mult"] == [1, 2, 2]
    engine = DiffusersRolloutEngine(built)
    assert engine.pipe.vae_scale_factor == 4
    assert engine.transformer.config.num_layers == MINIATURE.transformer.num_layers
    traj = engine.generate(['text "CAT"'], SamplingParams(height=64, width=64, num_steps=2, noise_level=0.0))
    assert traj.images.shape == (1, 3, 64, 64)
    assert traj.latents.shape[-2] == 64  # 16 x 16 latent packed 2 x 2: 64 image tokens


def test_same_seed_rebuilds_the_same_folder(builds: tuple[Path, Path]) -> None:
    built, again = builds
    for part in ("transformer", "vae", "text_encoder"):
        for f in sorted((built / part).glob("*.safetensors")):
            assert f.read_bytes() == (again / part / f.name).read_bytes(), f"{part}/{f.name} differs"
    assert json.loads((built / "vae" / "config.json").read_text()) == \
        json.loads((again / "vae" / "config.json").read_text())


def _weights(folder: Path, part: str) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted((folder / part).glob("*.safetensors")):
        out.update(load_file(f))
    return out


# The text-encoder-training command the interrupt, text-encoder and TP=2 cases share (one set of runs for the
# three: the suite's budget).
TRAIN_TEXT = ["--text-encoder", "train"]


# The pixel-space command test_pixel_space_folder_continues_and_lends_its_vae starts from.
PIXEL = ["--space", "pixel", "--max-offset", "8", "--offset-step", "8", "--font-sizes", "14", "15"]


@pytest.fixture(scope="module")
def pixel_started(tmp_path_factory) -> Iterator[tuple[Path, subprocess.Popen, Path]]:
    """The `PIXEL` run started now and finished by its test (`_finished`): `trained` asks for it first, so it runs
    beside the interrupted run, the one run of this module that would otherwise have a core to itself (one rank,
    OMP_NUM_THREADS=1). Yields (run folder, process, its output file); killed at the module's end if still going."""
    root = tmp_path_factory.mktemp("pixel")
    log = root / "output.txt"
    with log.open("w") as out:
        proc = subprocess.Popen(_command(root / "pixel", *PIXEL), cwd=ROOT, env=_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    yield root / "pixel", proc, log
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _finished(started: tuple[Path, subprocess.Popen, Path]) -> Path:
    out, proc, log = started
    try:
        proc.wait(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, log.read_text()[-6000:]
    return out


@pytest.fixture(scope="module")
def trained(built: Path, pixel_started: tuple, tmp_path_factory) -> dict:
    """`--text-encoder train --vae-from built`: a run SIGTERMed mid-run ("interrupted": steps and evaluations
    keep going until the signal lands), the same command stopped at the step whose model the interrupted run
    wrote ("reference", TP=1) and at TP=2 ("tp2", torchrun); "steps": that step. `pixel_started` only so that
    the pixel run overlaps the interrupted one."""
    root = tmp_path_factory.mktemp("trained")
    out, log = root / "interrupted", root / "stderr.txt"
    args = [*SHORT, "--max-steps", "100000", *TRAIN_TEXT, "--vae-from", str(built)]
    with log.open("w") as err:
        proc = subprocess.Popen([*zygote.python_script(TOOL), "--out", str(out), *args], cwd=ROOT,
                                env={**_env(), "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            for line in proc.stdout:
                m = re.match(r"step (\d+): OCR similarity", line)
                if m and int(m.group(1)) >= 6:
                    time.sleep(1.5)  # into later steps and evaluations: the weights have moved on since
                    proc.send_signal(signal.SIGTERM)
                    break
            rest = proc.communicate(timeout=300)[0]
        finally:
            proc.kill()
    assert proc.returncode == 0, rest + log.read_text()[-3000:]
    steps = json.loads((out / "pretrain.json").read_text())["transformer_steps"]
    same = [*args[len(SHORT):], "--max-steps", str(steps)]
    _pretrain_at_once((root / "reference", same, 1), (root / "tp2", [*same, "--tp", "2"], 2))
    return {"interrupted": out, "reference": root / "reference", "tp2": root / "tp2", "steps": steps}


def test_tp2_trains_the_same_model(trained: dict) -> None:
    """Two torchrun ranks at TP=2 see the same batches: the loss at every evaluation matches TP=1, and the
    trained text encoder's gradient reaches both ranks whole (the column-parallel input all-reduces it): the
    same text encoder as one rank."""
    one = json.loads((trained["reference"] / "pretrain.json").read_text())["history"]
    two = json.loads((trained["tp2"] / "pretrain.json").read_text())["history"]
    assert [h["step"] for h in two] == [h["step"] for h in one] and len(one) >= 3
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), (one, two)
    tp2_weights, ref = _weights(trained["tp2"], "text_encoder"), _weights(trained["reference"], "text_encoder")
    assert tp2_weights.keys() == ref.keys()
    assert all(torch.allclose(tp2_weights[k], ref[k], atol=1e-5) for k in ref)


def test_text_encoder_training_and_vae_from(built: Path, trained: dict, tmp_path: Path) -> None:
    """`--text-encoder train` moves the text encoder's weights off their seeded start; the default keeps the
    seeded encoder; `--vae-from` takes the given folder's VAE and latent statistics unchanged."""
    from model_providers.ocr_miniature.text_miniature import MINIATURE
    from model_providers.qwen_image.tiny_pipeline import build_components

    build_components(MINIATURE, 0)["text_encoder"].save_pretrained(tmp_path / "seeded")
    seeded = _weights(tmp_path, "seeded")
    reference = trained["reference"]
    trained_te, start = _weights(reference, "text_encoder"), _weights(built, "text_encoder")
    assert trained_te.keys() == start.keys() == seeded.keys()
    assert json.loads((built / "pretrain.json").read_text())["args"]["text_encoder"] == "frozen"
    assert all(torch.equal(start[k], seeded[k]) for k in seeded)
    moved = [k for k in trained_te if not torch.equal(trained_te[k], start[k])]
    assert "embed_tokens" in " ".join(moved) and len(moved) > len(trained_te) // 2, moved
    lent, own = _weights(reference, "vae"), _weights(built, "vae")
    assert lent.keys() == own.keys() and all(torch.equal(v, own[k]) for k, v in lent.items())
    assert json.loads((reference / "vae" / "config.json").read_text()) == \
        json.loads((built / "vae" / "config.json").read_text())
    record = json.loads((reference / "pretrain.json").read_text())
    assert record["vae_from"] == str(built) and record["args"]["text_encoder"] == "train"
    assert record["vae_source"] == json.loads((built / "pretrain.json").read_text())
    _assert_refused(["--out", str(tmp_path / "both"), *SHORT, "--init-from", str(built), "--vae-from", str(built)],
                    "--vae-from", tmp_path / "both")


def test_pixel_space_folder_continues_and_lends_its_vae(pixel_started: tuple, tmp_path: Path) -> None:
    """`--space pixel` writes a pipeline whose VAE is the exact PixelShuffleVAE with the dataset's latent
    statistics, that samples through the diffusers engine, continues with `--init-from` (on the folder's
    dataset layout but for what a flag changes) and lends its VAE with `--vae-from`; `--space pixel` beside
    either of those is refused, and so are a bad --max-offset and --offset-step 0."""
    from megatron_omni.rollout.base import SamplingParams
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine
    from model_providers.ocr_miniature.pixel_vae import PixelShuffleVAE

    pixel = _finished(pixel_started)  # PIXEL
    index = json.loads((pixel / "model_index.json").read_text())
    assert index["vae"] == ["model_providers.ocr_miniature.pixel_vae", "PixelShuffleVAE"]
    record = json.loads((pixel / "pretrain.json").read_text())
    assert record["args"]["space"] == "pixel" and 0.0 < record["vae_mse"] < 0.1  # colour -> gray, nothing else
    layout = {"max_offset": 8, "font_sizes": [14, 15], "colours": "random", "offset_step": 8}
    assert record["layout"] == layout
    engine = DiffusersRolloutEngine(pixel)
    stats = engine.pipe.vae.config
    assert isinstance(engine.pipe.vae, PixelShuffleVAE) and engine.pipe.vae_scale_factor == 4
    assert 0.3 < stats.latents_mean[0] < 1.0 and len(set(stats.latents_std)) > 1  # light backgrounds, per channel
    traj = engine.generate(['text "CAT"'], SamplingParams(height=64, width=64, num_steps=2, noise_level=0.0))
    gray = traj.images[0]
    assert gray.shape == (3, 64, 64) and torch.equal(gray[0], gray[1]) and torch.equal(gray[1], gray[2])
    # One continuation for both halves of the layout rule: the flag given (--max-offset) wins, every other key
    # (font sizes, colours, offset step: none of them the defaults) is the folder's.
    more, lent = tmp_path / "more", tmp_path / "lent"
    _pretrain_at_once((more, ["--init-from", str(pixel), "--seed", "1", "--max-offset", "0"], 1),
                      (lent, ["--vae-from", str(pixel)], 1))
    assert json.loads((more / "model_index.json").read_text())["vae"] == index["vae"]
    continued = json.loads((more / "pretrain.json").read_text())
    assert continued["args"]["space"] == "pixel" and continued["layout"] == {**layout, "max_offset": 0}
    vae_config = json.loads((pixel / "vae" / "config.json").read_text())
    assert json.loads((more / "vae" / "config.json").read_text()) == vae_config
    assert json.loads((lent / "vae" / "config.json").read_text()) == vae_config
    for flag in ("--init-from", "--vae-from"):
        _assert_refused(["--out", str(tmp_path / "refused"), *SHORT, flag, str(pixel), "--space", "pixel"],
                        "drop --space", tmp_path / "refused")
    for bad, message in ((["--max-offset", "left"], "--max-offset must be"),
                         (["--offset-step", "0"], "offset_step must be >= 1")):
        _assert_refused(["--out", str(tmp_path / "refused"), *SHORT, *bad], message, tmp_path / "refused")


def test_interrupt_writes_the_model_of_the_last_evaluation(trained: dict) -> None:
    """SIGTERM mid-run (steps and evaluations keep going until it lands) writes the model the last finished
    evaluation scored: transformer and trained text encoder equal, byte for byte, to those of the same
    command stopped at that step."""
    out, steps = trained["interrupted"], trained["steps"]
    record = json.loads((out / "pretrain.json").read_text())
    assert record["interrupted"] and steps >= 6 and steps == record["history"][-1]["step"]
    for part in ("transformer", "text_encoder"):
        ours, ref = _weights(out, part), _weights(trained["reference"], part)
        assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref), \
            f"{part} is not the step-{steps} model"


def test_existing_folder_is_refused_untouched(built: Path) -> None:
    """The tool's `main` in this process (its refusal comes before any work: no interpreter start for it) exits 2
    naming the folder, which stays as it was."""
    before = {p: p.stat().st_mtime_ns for p in built.rglob("*")}
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]
    argv = ["--out", str(built), *SHORT]
    proc = call_main(_tool().main, argv, _env(), args=[sys.executable, TOOL, *argv])
    assert proc.returncode == 2 and f"{built} exists" in proc.stderr, proc.stderr[-3000:]
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == handlers  # a refusal installs none
    assert {p: p.stat().st_mtime_ns for p in built.rglob("*")} == before
