"""Every launch script under examples/ runs in dry-run mode on CPU with its own world size, validates its
layout and prints the plan; impossible layouts fail non-zero with a message naming the problem.

The script list is discovered (*.sh, *.sbatch), so a new script is covered without editing this file. Each
script runs in bash as a user runs it (its env knobs, its checks, its exit status), with `PYTHON` a stand-in
interpreter: the `-m megatron_omni.train` call the script execs is recorded (argv and the environment the
interpreter would see, WORLD_SIZE included) instead of started, and the entry point's `main` then runs on exactly
that argv and environment in this process. So the suite pays one megatron-core import, not one per script
(measured back to back for the 26 jobs: 19.5 s CPU against 141 s with an interpreter per script; stdout and exit
status equal, stderr lacking only megatron-core's import warnings, printed once per process). Every other call
of `PYTHON` (the TransformerEngine probe, the token generator, the BAGEL planner of train_bagel.sh, which stays
the one script started end to end through a real interpreter) goes to the real one. The scripts run two at a
time, once per module, and the parametrized tests read their results.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.in_process import call_main

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "examples").rglob("*")
                 if p.suffix in (".sh", ".sbatch") and p.is_file())
# What a Slurm allocation sets (the sbatch script is run with bash, as on a login node).
SLURM_ENV = {"SLURM_NNODES": "2", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[01-02]",
             "SLURM_SUBMIT_DIR": str(ROOT)}
# The world size each known script must plan for (a new script only has to agree with itself).
EXPECTED_WORLD = {
    "examples/qwen_image/train_20b.sh": 6,  # NNODES defaults to 1
    "examples/qwen_image/train_20b_1node.sh": 6,
    "examples/qwen_image/train_20b_2nodes.sh": 16,
    "examples/qwen_image/train_20b_4nodes.sh": 32,
    "examples/qwen_image/slurm_20b.sbatch": 16,
    "examples/qwen_image/train_20b_lora_h800.sh": 3,  # 4 x H800, GPU 3 for the reward
    "examples/tiny/train_tiny.sh": 2,
    "examples/tiny/ocr_miniature.sh": 1,
    "examples/wan/train_wan.sh": 16,  # SIZE defaults to 14b on NNODES=2
    "examples/sd3/train_sd35.sh": 6,  # SIZE=medium on 1 node, GPUs 6,7 for the reward
    "examples/qwen_image_edit/train_edit_20b.sh": 6,  # NNODES defaults to 1, GPUs 6,7 for the reward
}
# What every dry run prints; a video family's plan (planner/video.py) names videos and the planner's CP choice.
PLAN_PARTS = ("memory per GPU:", "optimizer states", "step time:", "images/s/GPU", "reference (VeRL-Omni", "bridge:",
              "dry run OK")
VIDEO_PLAN_PARTS = ("memory per GPU:", "optimizer states", "step time:", "videos/s/GPU",
                    "context parallel chosen by the planner: ulysses=", "dry run OK")
TIMEOUT_S = 300


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "NNODES", "NODE_RANK", "WORLD_SIZE", "REWARD_", "RECIPE", "CFG",
                                "LAUNCH_SCRIPT", "SIZE"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHON=sys.executable, DRY_RUN="1")
    return {**env, **(extra or {})}


def _run(script: str, *args: str, extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = _env({**(SLURM_ENV if script.endswith(".sbatch") else {}), **(extra or {})})
    return subprocess.run(["bash", script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


# Impossible layouts through the scripts (their exit status and message reach the caller):
# (script, args, env, message pattern).
BAD = {
    "world_not_divisible": ("examples/tiny/train_tiny.sh", ["--set", "parallel.tp=3"], {},
                            r"world size 2 is not divisible by tp\*ulysses\*ring\*pp"),
    "heads_not_divisible_by_tp": ("examples/qwen_image/train_20b_2nodes.sh", ["--set", "parallel.tp=5"],
                                  {"GPUS_PER_NODE": "5"}, r"attention heads 24 are not divisible by tp=5"),
    "slurm_node_count": ("examples/qwen_image/slurm_20b.sbatch", [], {"SLURM_NNODES": "3"},
                         r"no layout for 3 nodes"),
    "vlm_judge_without_gpus": ("examples/qwen_image/train_20b_1node.sh", [], {"REWARD_KIND": "vlm", "REWARD_GPUS": ""},
                               r"REWARD_KIND=vlm needs REWARD_GPUS"),
    "wan_unknown_size": ("examples/wan/train_wan.sh", [], {"SIZE": "7b"}, r"SIZE=7b: expected 14b, 5b or a14b"),
    "sd35_unknown_size": ("examples/sd3/train_sd35.sh", [], {"SIZE": "xl"}, r"SIZE=xl: expected medium or large"),
}
# The same checks, in this process (cheap: no interpreter start): (recipe, world size, overrides, rc, pattern).
BAD_IN_PROCESS = {
    "image_tokens_not_divisible_by_cp": ("ocr_20b_1node", 6, ["parallel.tp=2", "parallel.ring=3"], 2,
                                         r"1024 image tokens are not divisible by cp=3"),
    "heads_per_tp_rank_not_divisible_by_ulysses": ("ocr_20b_2nodes", 16, ["parallel.tp=8", "parallel.ulysses=2"],
                                                   2, r"heads per tensor-parallel rank 3 are not divisible by "
                                                      r"ulysses=2"),
    "mini_batch_not_divisible_by_dp": ("ocr_20b_4nodes", 24, ["parallel.tp=8"], 2,
                                       r"256 images per mini-batch are not divisible by dp=3"),
    "does_not_fit": ("ocr_20b_4nodes", 32, ["parallel.tp=1"], 3, r"does not fit in H200 memory"),
    "world_size_vs_script": ("ocr_20b_1node", 8, [], 2, r"world size 8 is not divisible by"),
}


LORA_H800 = "examples/qwen_image/train_20b_lora_h800.sh"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    """Every dry run of this module (scripts as they are, then the bad layouts), two at a time."""
    jobs = ({s: (s, [], {}) for s in SCRIPTS} | {k: v[:3] for k, v in BAD.items()}
            | {f"train_20b_nnodes_{n}": ("examples/qwen_image/train_20b.sh", [], {"NNODES": str(n)}) for n in (2, 4)}
            | {"lora_h800_no_reward_gpu": (LORA_H800, [], {"REWARD_ON_GPU": "0"})}
            | {"wan_5b": ("examples/wan/train_wan.sh", [], {"SIZE": "5b"})}
            # SD3.5-L on 2 nodes through the Slurm script (LAUNCH_SCRIPT), on H800
            | {"sd35_large_slurm_h800": ("examples/qwen_image/slurm_20b.sbatch", [],
                                         {"LAUNCH_SCRIPT": "examples/sd3/train_sd35.sh", "SIZE": "large",
                                          "GPU_KIND": "H800"})}
            | {"rollout_gpus": ("examples/qwen_image/train_20b_1node.sh", [], {"REWARD_GPUS": "", "ROLLOUT_GPUS": "2"}),
               "rollout_gpus_all": ("examples/qwen_image/train_20b_1node.sh", [],
                                    {"REWARD_GPUS": "", "ROLLOUT_GPUS": "8"})})
    folder = tmp_path_factory.mktemp("dry_runs")
    python = _stand_in(folder)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {k: pool.submit(_run, s, *args, extra={**env, "PYTHON": str(python), CAPTURE: str(folder / str(i))})
                   for i, (k, (s, args, env)) in enumerate(jobs.items())}
        scripts = {k: f.result() for k, f in futures.items()}
    # The entry point one at a time (it prints to this process's stdout): what the interpreter would have printed
    # follows what the script printed, and its exit status is the script's (the script execs it).
    return {k: _finish(proc, folder / str(i)) for i, (k, proc) in enumerate(scripts.items())}


CAPTURE = "DRY_RUN_CAPTURE"  # where the stand-in interpreter records the entry point's call (a path prefix)


def _stand_in(folder: Path) -> Path:
    """A `PYTHON` for the scripts: `-m megatron_omni.train ARGS` is recorded (ARGS and the environment,
    NUL-separated, in $DRY_RUN_CAPTURE.argv / .env) and exits 0; any other call runs this interpreter."""
    path = folder / "python"
    path.write_text(f"""#!/usr/bin/env bash
if [[ "${{1:-}}" == -m && "${{2:-}}" == megatron_omni.train ]]; then
    shift 2
    printf '%s\\0' "$@" > "${{{CAPTURE}}}.argv"
    env -0 > "${{{CAPTURE}}}.env"
    exit 0
fi
exec {shlex.quote(sys.executable)} "$@"
""")
    path.chmod(0o755)
    return path


def _finish(script: subprocess.CompletedProcess, capture: Path) -> subprocess.CompletedProcess:
    """The script's result when it stopped before the entry point (a bad knob); else the entry point's `main` on
    the recorded argv in the recorded environment, its output after the script's."""
    argv_file, env_file = capture.with_suffix(".argv"), capture.with_suffix(".env")
    if not env_file.exists():
        return script
    assert script.returncode == 0, script.stderr  # nothing after the exec
    argv = argv_file.read_text().split("\0")[:-1]
    env = dict(item.split("=", 1) for item in env_file.read_text().split("\0")[:-1])
    env.pop(CAPTURE)
    from megatron_omni.train import main

    entry = call_main(main, argv, env)  # `python -m megatron_omni.train ARGV` in this process
    return subprocess.CompletedProcess(script.args, entry.returncode, script.stdout + entry.stdout,
                                       script.stderr + entry.stderr)


def test_scripts_discovered() -> None:
    assert set(EXPECTED_WORLD) <= set(SCRIPTS), f"missing launch scripts: {set(EXPECTED_WORLD) - set(SCRIPTS)}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_dry_run_plans_its_world(script: str, results: dict) -> None:
    proc = results[script]
    out = proc.stdout
    assert proc.returncode == 0, f"{script} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    launched = re.search(r"= world size (\d+)", out)
    planned = re.search(r"dry run: world size (\d+) trainer ranks", out)
    assert launched and planned, out[-2000:]
    assert launched.group(1) == planned.group(1), "the script's world size did not reach the entry point"
    if script in EXPECTED_WORLD:
        assert int(planned.group(1)) == EXPECTED_WORLD[script]
    for part in VIDEO_PLAN_PARTS if script.startswith("examples/wan/") else PLAN_PARTS:
        assert part in out, f"{script}: the plan lacks {part!r}:\n{out[-2000:]}"
    assert "torch.distributed.run" not in proc.stderr  # nothing was launched


@pytest.mark.parametrize("case", sorted(BAD))
def test_impossible_layout_fails_with_message(case: str, results: dict) -> None:
    proc = results[case]
    assert proc.returncode != 0, f"{case}: expected a failure, got rc 0:\n{proc.stdout[-2000:]}"
    assert re.search(BAD[case][3], proc.stderr), f"{case}: message not found in:\n{proc.stderr[-2000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("case", sorted(BAD_IN_PROCESS))
def test_impossible_layout_in_process(case: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from megatron_omni.train import main

    recipe, world, overrides, rc, pattern = BAD_IN_PROCESS[case]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.delenv("QWEN_IMAGE_PIPELINE", raising=False)
    monkeypatch.delenv("OCR_PROMPTS", raising=False)
    monkeypatch.setenv("MODEL_BACKEND", "local")  # what the launch scripts' dry run sets without TransformerEngine
    args = ["--dry-run", "--recipe", f"examples.qwen_image.recipe:{recipe}"]
    for o in overrides:
        args += ["--set", o]
    assert main(args) == rc
    err = capsys.readouterr().err
    assert re.search(pattern, err), f"{case}: message not found in:\n{err}"


def test_dry_run_reads_measured_mfu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`--mfu-from` (the JSON tools/gpu_check.sh writes) replaces the assumed MFU; a bad file exits 2."""
    from megatron_omni.train import main

    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("MODEL_BACKEND", "local")
    monkeypatch.delenv("QWEN_IMAGE_PIPELINE", raising=False)
    args = ["--dry-run", "--recipe", "examples.qwen_image.recipe:ocr_20b_2nodes"]
    assert main(args) == 0
    assumed = capsys.readouterr().out
    measured = tmp_path / "gpu_check.json"
    measured.write_text('{"mfu": 0.5}')
    assert main(args + ["--mfu-from", str(measured)]) == 0
    out = capsys.readouterr().out
    assert f"MFU 0.500 from {measured}" in out and "assumption: MFU 0.50 of" in out
    step = lambda text: float(re.search(r"step +([\d.]+) s", text).group(1))  # noqa: E731
    assert step(out) < step(assumed)
    measured.write_text('{"mfu": "fast"}')
    assert main(args + ["--mfu-from", str(measured)]) == 2
    assert "--mfu-from" in capsys.readouterr().err
    assert main(["--recipe", "examples.qwen_image.recipe:ocr_20b_2nodes", "--mfu-from", str(measured)]) == 2
    assert "read by --dry-run only" in capsys.readouterr().err


@pytest.mark.parametrize("case,world,reward", [(LORA_H800, 3, 1), ("lora_h800_no_reward_gpu", 4, 0)])
def test_lora_h800_script_plans_lora_in_80gb(case: str, world: int, reward: int, results: dict) -> None:
    """The 20B LoRA script on one node of 4 x H800, with and without a reward GPU: its plan counts the adapters
    (the LoRA line) and fits in the H800's memory."""
    proc = results[case]
    out = proc.stdout
    assert proc.returncode == 0, f"{case} failed ({proc.returncode}):\n{out[-2000:]}\n{proc.stderr[-3000:]}"
    assert f"dry run: world size {world} trainer ranks + {reward} reward GPUs" in out
    assert "model 20b on 4 x H800" in out and "LoRA: rank 64, alpha 128 on 480 linears" in out
    assert re.search(r"total +[\d.]+ GiB of 79\.6 GiB -> fits", out), out[-2000:]


WRAPPERS = {1: "examples/qwen_image/train_20b_1node.sh", 2: "examples/qwen_image/train_20b_2nodes.sh",
            4: "examples/qwen_image/train_20b_4nodes.sh"}


@pytest.mark.parametrize("nnodes", sorted(WRAPPERS))
def test_one_20b_script_equals_the_per_size_names(nnodes: int, results: dict) -> None:
    """train_20b.sh with NNODES=n plans exactly what the per-size script of n nodes plans."""
    one = results["examples/qwen_image/train_20b.sh" if nnodes == 1 else f"train_20b_nnodes_{nnodes}"]
    wrapper = results[WRAPPERS[nnodes]]
    assert one.returncode == wrapper.returncode == 0, one.stderr[-2000:]
    assert one.stdout == wrapper.stdout
    assert f"launch: {nnodes} node(s)" in one.stdout and f"ocr_20b_{nnodes}node" in one.stdout


def _echo(script: str, extra: dict[str, str]) -> subprocess.CompletedProcess:
    """LAUNCH_ECHO=1: the script prints what it would start (no torch import, nothing started)."""
    return _run(script, extra={"DRY_RUN": "0", "LAUNCH_ECHO": "1", **extra})


def _fingerprints(out: str) -> list[str]:
    return re.findall(r"would run \[REWARD_SERVER_TOKEN ([^\]]+)\]", out)


def test_reward_token_generated_per_job_and_exported_to_server_and_trainer() -> None:
    import hashlib

    first = _echo("examples/qwen_image/train_20b.sh", {"NNODES": "1"})
    assert first.returncode == 0, first.stderr
    assert "generated a reward server token" in first.stdout
    prints = _fingerprints(first.stdout)
    lines = [x for x in first.stdout.splitlines() if "would run" in x]
    assert len(prints) == 2 and "megatron_omni.reward.server" in lines[0] and "torch.distributed.run" in lines[1]
    assert prints[0] == prints[1] != "unset"  # the server and the trainer see one token
    second = _echo("examples/qwen_image/train_20b.sh", {"NNODES": "1"})
    assert _fingerprints(second.stdout)[0] != prints[0]  # a new one per job
    assert "--token" not in first.stdout  # never on a command line (`ps` would show it)
    given = _echo("examples/qwen_image/train_20b.sh", {"NNODES": "1", "REWARD_SERVER_TOKEN": "s3cret"})
    want = "sha256:" + hashlib.sha256(b"s3cret").hexdigest()[:12]
    assert _fingerprints(given.stdout) == [want, want] and "generated" not in given.stdout
    # Several nodes cannot each make up their own: the plain script asks for one, the sbatch makes one per job.
    multi = _echo("examples/qwen_image/train_20b.sh", {"NNODES": "2"})
    assert multi.returncode == 2 and "REWARD_SERVER_TOKEN is not set" in multi.stderr
    slurm = _echo("examples/qwen_image/slurm_20b.sbatch", {})
    assert slurm.returncode == 0, slurm.stderr
    assert len(set(_fingerprints(slurm.stdout))) == 1 and "unset" not in _fingerprints(slurm.stdout)
    assert "world size 16" in slurm.stdout


def test_sbatch_sends_sigterm_before_the_limit_and_documents_exit_5() -> None:
    text = (ROOT / "examples/qwen_image/slurm_20b.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=B:TERM@\d+$", text, re.M)
    assert "kill -TERM \"$SRUN_PID\"" in text  # the batch shell passes it on to the srun step
    lib = (ROOT / "examples/qwen_image/launch_lib.bash").read_text()
    assert "kill -TERM \"$pid\"" in lib and "exit 5" in lib and "--resume auto" in lib


def test_a_bad_config_stops_the_launch_with_rc_2_before_anything_starts(tmp_path: Path) -> None:
    """A real (not dry) launch: the script checks the config before it starts the reward server or torchrun
    (torchrun itself reports any failed worker as rc 1), so the caller sees the entry point's rc 2 and one
    line naming the field, in seconds."""
    import time

    run_dir = tmp_path / "run"
    start = time.monotonic()
    done = subprocess.run(["bash", "examples/tiny/train_tiny.sh", "--set", "optim.lr=-1"], cwd=ROOT,
                          env=_env({"DRY_RUN": "0", "REWARD_SERVER": "1", "RUN_DIR": str(run_dir),
                                    "LOG_DIR": str(tmp_path / "logs")}),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if "optim.lr" in line]
    assert len(errors) == 1 and errors[0].startswith("config error:"), done.stderr[-2000:]
    assert "launch: reward server (pid" not in done.stdout, "nothing is started before the check"
    assert not (tmp_path / "logs" / "reward_server.log").exists()
    assert time.monotonic() - start < 60
    assert not (run_dir / "config.json").exists()


@pytest.mark.parametrize("case,world,ulysses", [("examples/wan/train_wan.sh", 16, 4), ("wan_5b", 8, 1)])
def test_wan_dry_run_plans_the_clip_with_the_planners_cp(case: str, world: int, ulysses: int, results: dict) -> None:
    """Wan2.1-14B's 81-frame 480p clip (32,760 video tokens) does not fit one GPU per replica at 16 GPUs: the
    planner chooses Ulysses 4 (1 and 2 do not fit beside the resident umT5-XXL and VAE) and the layout carries
    it; Wan2.2-5B's 121-frame 720p clip fits without CP at 8."""
    proc = results[case]
    out = proc.stdout
    assert proc.returncode == 0, f"{case} failed ({proc.returncode}):\n{out[-2000:]}\n{proc.stderr[-3000:]}"
    assert f"dry run: world size {world} trainer ranks" in out
    assert f"context parallel chosen by the planner: ulysses={ulysses} " in out
    assert re.search(rf"layout: tp=1 ulysses={ulysses} ring=1 pp=1 dp={world // ulysses},", out), out[-2000:]
    assert re.search(r"clip: \d+ frames \d+x\d+ -> patch grid \d+x\d+x\d+ = \d+ video tokens", out), out[-2000:]


def test_rollout_gpus_plans_the_disaggregated_layout(results: dict) -> None:
    """ROLLOUT_GPUS=2 on one node of 8 (no reward GPUs): placement.mode=disaggregated with the last 2 ranks rolling
    out and staleness 1; the dry run prints both sides' memory and the disaggregated step next to the colocated one
    on 8 GPUs, and passes (rc 0): the recipe's vLLM-Omni engine runs on the rollout ranks (one `Omni` engine each at
    rollout tp 1, the push into its workers' back buffer)."""
    proc = results["rollout_gpus"]
    out, err = proc.stdout, proc.stderr
    assert "world size 8 (6 train + 2 roll out: ROLLOUT_GPUS, staleness 1)" in out, out[-2000:]
    assert "dry run: world size 8 = 6 trainer ranks + 2 rollout ranks (disaggregated)" in out, out[-2000:]
    assert "rollout tp=1 (2 own GPUs)" in out and "(full mode, vllm_omni engine tp=1)" in out
    for part in ("disaggregated: 6 trainer + 2 rollout GPUs, staleness 1", "trainer GPU memory", "rollout GPU memory",
                 "no optimizer state", "colocated on 8 GPUs", "disaggregated/colocated = ",
                 "assumption: disaggregated model", "dry run OK: the disaggregated layout is valid"):
        assert part in out, f"the plan lacks {part!r}:\n{out[-3000:]}"
    step = re.search(r"  step +([\d.]+) s \((rollout|trainer)-bound\) -> ([\d.]+) images/s/GPU", out)
    rollout = re.search(r"rollout side +([\d.]+) s on 2 GPUs", out)
    trainer = re.search(r"trainer side +([\d.]+) s on 6 GPUs", out)
    assert step and rollout and trainer, out[-3000:]
    assert float(step.group(1)) == pytest.approx(max(float(rollout.group(1)), float(trainer.group(1))), abs=0.06)
    assert proc.returncode == 0 and "not runnable yet" not in out, (out + err)[-2000:]
    assert "Traceback" not in err and "torch.distributed.run" not in err
    lost = results["rollout_gpus_all"]
    assert lost.returncode == 2 and "ROLLOUT_GPUS=8 leaves no trainer rank in world size 8" in lost.stderr


def test_several_scorers_start_in_one_server_with_their_weights() -> None:
    out = _echo("examples/tiny/train_tiny.sh", {"REWARD_SERVER": "1", "REWARD_SCORERS": "pickscore@cpu ocr@cpu",
                                                 "REWARD_SCORER": "0.7*pickscore+0.3*ocr?",
                                                 "REWARD_OPTIONS": '{"pickscore": {"model": "/m"}}'})
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stdout.splitlines() if "would run" in x]
    assert len(lines) == 2 and "megatron_omni.reward.server" in lines[0]
    assert "--scorer pickscore@cpu --scorer ocr@cpu --reward '0.7*pickscore+0.3*ocr?'" in lines[0]
    assert """--scorer-kwargs '{"pickscore": {"model": "/m"}}'""" in lines[0]
    assert "'reward.scorer=0.7*pickscore+0.3*ocr?'" in lines[1]  # the trainer checks the server's terms against it


def test_sd35_large_plans_two_nodes_through_slurm(results: dict) -> None:
    """SD3.5-L through the Slurm script's LAUNCH_SCRIPT: 16 trainer ranks at tp=1 x dp=16 fit an H800."""
    proc = results["sd35_large_slurm_h800"]
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-2000:]}\n{proc.stderr[-3000:]}"
    assert "dry run: world size 16 trainer ranks" in out and "model sd35-large on 16 x H800" in out
    assert "recipe examples.sd3.recipe:sd35_large_ocr" in out and "/models/stable-diffusion-3.5-large" in out
    assert re.search(r"total +[\d.]+ GiB of 79\.6 GiB -> fits", out), out[-2000:]


@pytest.mark.parametrize("recipe,world,reward_gpus,gpu,rc,rollout_gib", [
    ("edit_20b_2nodes", 16, 0, "H200", 0, "53.7"), ("edit_20b_1node", 6, 2, "H800", 3, "53.7"),
    ("edit_20b_2nodes_h800", 16, 0, "H800", 0, "31.6"), ("edit_20b_1node_h800", 6, 2, "H800", 0, "32.6")])
def test_edit_20b_plans_the_source_image(recipe: str, world: int, reward_gpus: int, gpu: str, rc: int,
                                         rollout_gib: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Qwen-Image-Edit 20B (train_edit_20b.sh's recipes, in this process): the plan counts the source image, its
    latents in the image stream (4096 tokens after the 1024 generated ones) and its 196 vision tokens in the text
    stream; the 2-node layout fits an H200, the 1-node one does not fit an H800 (the embedded engine's copy alone is
    53.7 GiB), rc 3; the 2-node H800 layout fits with the vLLM-Omni engine at rollout tp 8 (31.6 GiB, asleep while
    the trainer updates), the 1-node H800 one with LoRA adapters and the engine at rollout tp 6 (32.6 GiB)."""
    from megatron_omni.train import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MODEL_BACKEND", "local")
    monkeypatch.setenv("QWEN_IMAGE_EDIT_PIPELINE", "/nonexistent/edit")
    monkeypatch.delenv("EDIT_DATA", raising=False)
    assert main(["--dry-run", "--gpu", gpu, "--reward-gpus", str(reward_gpus), "--recipe",
                 f"examples.qwen_image_edit.recipe:{recipe}"]) == rc
    out = capsys.readouterr().out
    assert "5120 image (of them 4096 source-image) + 452 text tokens" in out, out[-2000:]
    assert f"model 20b on {world + reward_gpus} x {gpu}" in out
    assert re.search(rf"rollout weights +{re.escape(rollout_gib)} GiB", out), out[-2000:]
    if recipe == "edit_20b_1node_h800":
        assert "LoRA: rank 32, alpha 64" in out and "engine asleep during the update" in out, out[-2000:]
