"""Config validation is complete: every field's bad value is refused before any work, with one line naming the
field (JobConfig.validate and `python -m megatron_omni.train`'s exit 2).

The table cases are generated from megatron_omni/trainer/config_checks.py's BOUNDS and CHOICES, and a test
checks those tables cover every numeric and every fixed-set field of the config dataclasses."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

from megatron_omni import train
from megatron_omni.trainer.config import KEYWORD_FIELDS, ConfigError, JobConfig, apply_overrides
from megatron_omni.trainer.config_checks import BOUNDS, CHOICES, _fields, read_prompts_file


def _numeric(hint: typing.Any) -> type | None:
    args = typing.get_args(hint) or (hint,)
    for t in (int, float):
        if t in args:
            return t
    return None


def _bad_values(name: str) -> list[typing.Any]:
    """Values just outside the field's bounds."""
    hint = {n: h for n, h, _ in _fields(JobConfig())}[name]
    typ = _numeric(hint)
    (_, lo, lo_in, hi, hi_in) = next(row for row in BOUNDS if row[0] == name)
    out = []
    if lo is not None:
        out.append(typ(lo - 1) if lo_in else typ(lo))
    if hi is not None:
        out.append(typ(hi) if not hi_in else typ(hi + 1))
    return out


BOUND_CASES = [(name, v) for name, *_ in BOUNDS for v in _bad_values(name)]


def _set(cfg: JobConfig, dotted: str, value: typing.Any) -> None:
    *parents, leaf = dotted.split(".")
    target = cfg
    for p in parents:
        target = getattr(target, KEYWORD_FIELDS.get(p, p))  # `async` is the field async_
    setattr(target, leaf, value)


def _refused(cfg: JobConfig, field_name: str, world_size: int = 1) -> str:
    with pytest.raises(ConfigError) as info:
        cfg.validate(world_size)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(field_name), f"{field_name}: {message}"
    return message


def test_the_defaults_are_valid() -> None:
    JobConfig().validate(1)


def test_a_dit_family_refuses_bagels_experts() -> None:
    cfg = JobConfig()
    cfg.model.bagel_experts = "both"
    assert "the experts are BAGEL's" in _refused(cfg, "model.bagel_experts")


def test_guidance_scale_2_is_wans_and_needs_cfg() -> None:
    """`rollout.guidance_scale_2` (Wan2.2 A14B's low-noise guidance) reaches the sampler by name; an image family
    refuses it, and so does a Wan run without true CFG."""
    from examples.wan.recipe import wan_video_demo
    from megatron_omni.rollout.base import SamplingParams

    cfg = apply_overrides(JobConfig(), ["rollout.guidance_scale=4", "rollout.negative_prompt=x",
                                        "rollout.guidance_scale_2=3"])
    assert "A14B's low-noise expert" in _refused(cfg, "rollout.guidance_scale_2")
    cfg = apply_overrides(wan_video_demo(), ["rollout.guidance_scale_2=3"])
    assert "needs true CFG on" in _refused(cfg, "rollout.guidance_scale_2")
    cfg = apply_overrides(cfg, ["rollout.guidance_scale=5", "rollout.negative_prompt=blurry"])
    cfg.validate(1)
    assert SamplingParams.from_config(cfg.rollout).guidance_scale_2 == 3.0


def test_tables_cover_every_numeric_and_fixed_set_field() -> None:
    bounded = {row[0] for row in BOUNDS}
    # Fields that are numbers without a bound of their own: checked together with other fields.
    exempt = {"rollout.window_range"}
    numeric = {n for n, h, _ in _fields(JobConfig()) if _numeric(h) is not None and typing.get_origin(h) is not list}
    assert numeric - bounded - exempt == set(), "numeric fields without a BOUNDS row"
    assert set(CHOICES) <= {n for n, _, _ in _fields(JobConfig())}
    for name, allowed in CHOICES.items():
        default = {n: v for n, _, v in _fields(JobConfig())}[name]
        assert default in allowed, name


@pytest.mark.parametrize(("field_name", "value"), BOUND_CASES, ids=[f"{n}={v}" for n, v in BOUND_CASES])
def test_out_of_bounds_is_refused(field_name: str, value: typing.Any) -> None:
    cfg = JobConfig()
    _set(cfg, field_name, value)
    message = _refused(cfg, field_name)
    assert "must be" in message


@pytest.mark.parametrize("field_name", sorted(CHOICES))
def test_value_outside_the_set_is_refused(field_name: str) -> None:
    cfg = JobConfig()
    _set(cfg, field_name, "nosuch")
    message = _refused(cfg, field_name)
    for allowed in CHOICES[field_name]:
        if allowed is not None:
            assert str(allowed) in message


@pytest.mark.parametrize(("field_name", "value"), [
    ("steps", "3"), ("optim.lr", "big"), ("logging.tensorboard", 1), ("prompts", "a cat"), ("seed", 1.5),
])
def test_wrong_type_is_refused(field_name: str, value: typing.Any) -> None:
    cfg = JobConfig()
    _set(cfg, field_name, value)
    assert "is not a" in _refused(cfg, field_name)


@pytest.mark.parametrize(("overrides", "field_name"), [
    (["rollout.num_steps=6", "rollout.window_size=7"], "rollout.window_size"),
    (["rollout.num_steps=6", "rollout.window_range=[0, 9]"], "rollout.window_range"),
    (["rollout.window_range=[3, 3]"], "rollout.window_range"),
    (["rollout.window_range=[0, 1]"], "rollout.window_range"),  # shorter than window_size 2
    (["rollout.window_range=[1]"], "rollout.window_range"),
    (["run_dir= "], "run_dir"),
    (["model.pipeline="], "model.pipeline"),
    (["checkpoint.resume="], "checkpoint.resume"),
    (["prompts=[\"a cat\", \"  \"]"], "prompts[1]"),
    (["eval.prompts=[\"\"]"], "eval.prompts[0]"),
    (["reward.scorer=nosuch"], "reward.scorer"),
    (["reward.scorer=0.5*ocr+nosuch"], "reward.scorer"),
    (["reward.scorer=no_such_module_xyz:fn"], "reward.scorer"),
    (["reward.scorer=jpeg_compressibility", "reward.options={\"pickscore\": {\"model\": \"/m\"}}"],
     "reward.options"),
    (["reward.url=notaurl"], "reward.url"),
    (["reward.url=ftp://127.0.0.1:8000"], "reward.url"),
    (["reward.url=http://:8000"], "reward.url"),
    (["reward.url=http://127.0.0.1:99999"], "reward.url"),
    (["reward.url=http://127.0.0.1:port"], "reward.url"),
    (["reward.scorer=ocr"], "prompts[0]"),  # the default prompts quote no text
    (["reward.scorer=0.8*ocr+0.2*jpeg_compressibility", "prompts=[\"a sign \\\"HI\\\"\", \"a cat\"]"], "prompts[1]"),
    (["reward.scorer=ocr", "prompts=[\"a sign \\\"HI\\\"\"]", "eval.prompts=[\"a dog\"]"], "eval.prompts[0]"),
])
def test_cross_field_and_reward_checks(overrides: list[str], field_name: str) -> None:
    cfg = apply_overrides(JobConfig(), overrides)
    message = _refused(cfg, field_name)
    if field_name.startswith("prompts[") or field_name.startswith("eval.prompts["):
        assert "quote" in message or "blank" in message


def test_valid_reward_specs_pass() -> None:
    cfg = apply_overrides(JobConfig(), ["reward.url=https://reward-node:8443/", "prompts=[\"a sign \\\"OPEN\\\"\"]",
                                        "reward.scorer=0.8*ocr+0.2*jpeg_compressibility"])
    cfg.validate(1)


def test_prompts_file_not_utf8_names_file_and_offset(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_bytes('a sign "OK"\nna\u00efve\n'.encode() + b"bad \xff byte\n")
    with pytest.raises(ConfigError) as info:
        read_prompts_file(path, "OCR_PROMPTS")
    offset = len('a sign "OK"\nna\u00efve\n'.encode()) + len(b"bad ")
    assert str(info.value) == (f"OCR_PROMPTS={str(path)!r} is not UTF-8: byte 0xff at offset {offset} (line 3)")
    good = tmp_path / "good.txt"
    good.write_text('a sign "OK"\n\n  na\u00efve "CAF\u00c9"  \n', encoding="utf-8")
    assert read_prompts_file(good, "OCR_PROMPTS") == ['a sign "OK"', 'na\u00efve "CAF\u00c9"']
    with pytest.raises(ConfigError, match="is not a file"):
        read_prompts_file(tmp_path / "missing.txt", "OCR_PROMPTS")


def _main(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    rc = train.main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    return rc, "\n".join(line for line in err if "Warning" not in line and "warnings.warn" not in line)


@pytest.mark.parametrize("argv", [
    ["--dry-run", "--set", "reward.scorer=nosuch"],
    ["--dry-run", "--set", "reward.url=notaurl"],
    ["--set", "reward.url=notaurl"],
    ["--set", "checkpoint.keep=0"],
    ["--set", "algorithm.clip_range=0"],
    ["--set", "rollout.max_batch_size=0"],
])
def test_cli_exits_2_with_one_line(capsys: pytest.CaptureFixture, argv: list[str]) -> None:
    rc, err = _main(capsys, *argv)
    field_name = argv[-1].split("=")[0]
    assert rc == 2 and err.count("\n") == 0 and err.startswith(f"config error: {field_name}"), err


def test_cli_files_are_checked_before_work(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    rc, err = _main(capsys, "--set", f"model.pipeline={tmp_path / 'nope'}", "--set", f"run_dir={tmp_path / 'run'}")
    assert rc == 2 and "model.pipeline=" in err and "is not a folder" in err, err
    (tmp_path / "pipe").mkdir()
    rc, err = _main(capsys, "--set", f"model.pipeline={tmp_path / 'pipe'}", "--set", f"run_dir={tmp_path / 'run'}")
    assert rc == 2 and "model_index.json" in err, err
    blocker = tmp_path / "file"
    blocker.write_text("x")
    rc, err = _main(capsys, "--set", f"run_dir={blocker / 'run'}")
    assert rc == 2 and err.startswith("config error: run_dir=") and "not writable" in err, err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_cli_config_error_prints_on_rank0_only(capsys: pytest.CaptureFixture,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    rc, err = _main(capsys, "--set", "checkpoint.keep=0")
    assert rc == 2 and err == ""
    monkeypatch.setenv("RANK", "0")
    rc, err = _main(capsys, "--set", "checkpoint.keep=0")
    assert rc == 2 and err == "config error: checkpoint.keep=0 must be >= 1"


def test_the_exit_without_teardown_runs_the_exit_hooks_and_stops_idle_pool_workers(tmp_path: Path) -> None:
    """The entry point's exit keeps a normal exit's order (threading's hooks, the joins, atexit) and its status:
    an idle thread pool's workers (non-daemon, stopped by threading's hook) must not keep the process alive."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import atexit, concurrent.futures, threading, time\n"
        "from megatron_omni.train import exit_without_teardown\n"
        "concurrent.futures.ThreadPoolExecutor(2).submit(int).result()\n"
        "threading.Thread(target=time.sleep, args=(0.5,)).start()\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "exit_without_teardown(3)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and done.stdout == "atexit ran\n", (done.returncode, done.stdout, done.stderr)



# ------------------------------------------------------------------------------------------ model families
def _ar_dit() -> JobConfig:
    from examples.ar_dit.recipe import tiny

    return tiny()


def test_unknown_family_names_the_known_ones() -> None:
    cfg = JobConfig()
    cfg.model.family = "nosuch"
    message = _refused(cfg, "model.family")
    assert "qwen_image" in message and "ar_dit" in message


def test_the_ar_dit_recipe_is_valid_and_maps_onto_the_trainer_settings() -> None:
    from megatron_omni.trainer.ar_dit import ARDiTTrainConfig

    cfg = _ar_dit()
    cfg.validate(2)
    t = ARDiTTrainConfig.from_job(cfg)
    assert t.prompts == [[5, 6, 7], [9, 10], [20, 21, 22, 23]] and t.window_clip == cfg.algorithm.clip_range
    assert (t.sampling.num_steps, t.sampling.noise_level, t.sampling.grid) == (4, 0.7, (1, 2, 4))
    cfg.algorithm.old_logprob = "bypass"
    assert ARDiTTrainConfig.from_job(cfg).old_logprob == "rollout"


@pytest.mark.parametrize(("overrides", "field_name"), [
    (["parallel.pp=2"], "parallel.pp"),
    (["optim.ema_decay=0.9"], "optim.ema_decay"),
    (["reward.url=http://127.0.0.1:9"], "reward.url"),
    (["reward.scorer=ocr"], "reward.scorer"),
    (['eval.prompts=["5 6"]'], "eval.prompts"),
    (["model.preset=20b"], "model.preset"),
    (['prompts=["5 x"]'], "prompts[0]"),
    (['prompts=["5 999"]'], "prompts[0]"),
    (["ar_dit.grid=[2,2,4]"], "ar_dit.grid"),
    (["ar_dit.reward=nocolon"], "ar_dit.reward"),
    (["ar_dit.token_weight=0", "ar_dit.window_weight=0"], "ar_dit.token_weight"),
    (["ar_dit.freeze=both"], "ar_dit.freeze"),
    (["rollout.quantization=fp8"], "rollout.quantization"),
    (["algorithm.is_cap=2"], "algorithm.is_cap"),
    (["rollout.vae_dtype=fp32"], "rollout.vae_dtype"),
    (["model.bagel_experts=both"], "model.bagel_experts"),
    (["rollout.guidance_scale_2=3"], "rollout.guidance_scale_2"),
])
def test_ar_dit_refuses_what_it_does_not_implement(overrides: list[str], field_name: str) -> None:
    """A setting the hybrid's trainer would not honour is an error naming it, never silently ignored."""
    cfg = apply_overrides(_ar_dit(), overrides)
    _refused(cfg, field_name)


def test_dry_run_of_a_family_without_a_cost_model_is_a_config_error() -> None:
    from megatron_omni.trainer.dry_run import dry_run

    with pytest.raises(ConfigError, match="model.family=ar_dit has no cost model"):
        dry_run(_ar_dit(), 1, "H200")


# ------------------------------------------------------------------------------------------ LoRA
@pytest.mark.parametrize(("overrides", "field_name"), [
    (["model.lora.rank=8", "optim.ema_decay=0.9"], "optim.ema_decay"),
    (["rollout.lora_sync=merge"], "rollout.lora_sync"),  # without adapters
    (["model.lora.rank=8", "model.lora.targets=[]"], "model.lora.targets"),
    (["model.lora.rank=8", 'model.lora.targets=[" "]'], "model.lora.targets[0]"),
    (["model.lora.rank=8", "model.backend=te"], "model.backend"),
])
def test_lora_refuses_what_it_cannot_combine_with(overrides: list[str], field_name: str) -> None:
    _refused(apply_overrides(JobConfig(), overrides), field_name)


def test_adapter_sync_is_taken_by_both_engines_and_auto_picks_it_where_it_has_run(monkeypatch) -> None:
    from megatron_omni.trainer.lora_setup import lora_sync_mode

    for engine in ("diffusers", "vllm_omni"):
        cfg = apply_overrides(JobConfig(), ["model.lora.rank=8", f"rollout.engine={engine}",
                                            "rollout.lora_sync=adapter"])
        cfg.validate(1)
        assert lora_sync_mode("merge", engine) == "merge"
    # vLLM-Omni inline (its LoRA manager in the trainer's ranks) and its engine (collective_rpc): adapters
    assert lora_sync_mode("auto", "diffusers") == lora_sync_mode("auto", "vllm_omni", False, "inline") == "adapter"
    assert lora_sync_mode("auto", "vllm_omni") == "adapter"  # the engine over collective_rpc too
    assert lora_sync_mode("adapter", "vllm_omni") == "adapter"
    # a quantized engine's FP8 linears take no adapters: auto resolves to merged weights on both engines
    assert lora_sync_mode("auto", "diffusers", quantized=True) == lora_sync_mode("auto", "vllm_omni", True) == "merge"


def test_lora_on_the_ar_dit_hybrid_is_refused() -> None:
    _refused(apply_overrides(_ar_dit(), ["model.lora.rank=4"]), "model.lora.rank")


def test_lora_targets_default_to_the_flow_grpo_recipe_and_adaln_adds_the_modulation() -> None:
    cfg = apply_overrides(JobConfig(), ["model.lora.rank=64", "model.lora.adaln=true"])
    cfg.validate(1)
    assert cfg.model.lora.target_patterns() == ["*.linear_qkv", "*.linear_proj", "*.linear_fc1", "*.linear_fc2",
                                                "*.adaln"]
