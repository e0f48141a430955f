"""The field-by-field checks of a JobConfig: types, fixed value sets, signs and bounds, reward URL syntax and
scorer names, and the files a run reads (prompt files as UTF-8, the pipeline folder). Every check raises
ConfigError with one line naming the field; `JobConfig.validate` runs them before any work starts.

The bounds are one table (`BOUNDS`): a field without an entry there is a string or a list checked by name
below. `test_config_validation.py` walks the table, so a new numeric field needs a row here.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import types
import typing
import urllib.parse
from pathlib import Path
from typing import Any

from megatron_omni.algorithms.importance import IS_LEVELS
from megatron_omni.rollout.quantization import QUANTIZATION_MODES

# (dotted field, lower bound, lower inclusive, upper bound, upper inclusive); None: unbounded on that side.
# Optional fields (None allowed) are checked only when set.
BOUNDS: list[tuple[str, float | None, bool, float | None, bool]] = [
    ("steps", 1, True, None, False),
    ("seed", 0, True, None, False),
    ("model.tiny_seed", 0, True, None, False),
    ("model.lora.rank", 0, True, None, False),  # 0: full fine-tuning
    ("model.lora.alpha", 0, False, None, False),
    ("model.lora.dropout", 0, True, 1, False),
    ("parallel.tp", 1, True, None, False),
    ("parallel.ulysses", 1, True, None, False),
    ("parallel.ring", 1, True, None, False),
    ("parallel.pp", 1, True, None, False),
    ("rollout.height", 1, True, None, False),
    ("rollout.width", 1, True, None, False),
    ("rollout.num_steps", 1, True, None, False),
    ("rollout.noise_level", 0, True, None, False),
    ("rollout.window_size", 0, True, None, False),
    ("rollout.guidance_scale", 1, True, None, False),
    ("rollout.image_guidance_scale", 1, True, None, False),
    ("rollout.guidance_scale_2", 1, True, None, False),
    ("rollout.distilled_guidance", 0, False, None, False),
    ("rollout.prompts_per_step", 1, True, None, False),
    ("rollout.group_size", 2, True, None, False),  # group-relative advantages need two samples per prompt
    ("rollout.max_batch_size", 1, True, None, False),
    ("rollout.tp", 1, True, None, False),
    ("rollout.text_length", 1, True, 1024, True),
    ("rollout.num_frames", 1, True, None, False),
    ("rollout.max_sequence_length", 1, True, 1024, True),
    ("reward.video_frames", 1, True, None, False),
    ("reward.timeout_s", 0, False, None, False),
    ("algorithm.clip_range", 0, False, None, False),
    ("algorithm.adv_clip", 0, False, None, False),
    ("algorithm.beta", 0, True, None, False),
    ("algorithm.max_logp_gap", 0, False, None, False),
    ("algorithm.is_cap", 0, True, None, False),  # 0: off; (0, 1) refused by check_quantization
    ("optim.lr", 0, False, None, False),
    ("optim.weight_decay", 0, True, None, False),
    ("optim.adam_beta1", 0, True, 1, False),
    ("optim.adam_beta2", 0, True, 1, False),
    ("optim.adam_eps", 0, False, None, False),
    ("optim.clip_grad", 0, True, None, False),  # 0: no clipping (Megatron's convention)
    ("optim.mini_batches", 1, True, None, False),
    ("optim.warmup_steps", 0, True, None, False),
    ("optim.max_bad_steps", 1, True, None, False),
    ("optim.micro_batch_size", 1, True, None, False),
    ("optim.ema_decay", 0, True, 1, False),
    ("checkpoint.every", 0, True, None, False),
    ("checkpoint.keep", 1, True, None, False),
    ("logging.image_every", 0, True, None, False),
    ("eval.seeds_per_prompt", 1, True, None, False),
    ("eval.num_steps", 1, True, None, False),
    ("eval.guidance_scale", 1, True, None, False),
    ("eval.every", 0, True, None, False),
    ("algorithm.mixgrpo.steps_per_move", 1, True, None, False),
    ("algorithm.mixgrpo.shift", 1, True, None, False),
    ("algorithm.mixgrpo.flash_ratio", 0, False, 1, True),
    ("algorithm.nft.mix_beta", 0, False, None, False),
    ("algorithm.nft.timestep_fraction", 0, False, 1, True),
    ("algorithm.nft.weight_min", 0, False, None, False),
    ("algorithm.nft.decay_flat", 0, True, None, False),
    ("algorithm.nft.decay_rate", 0, True, None, False),
    ("algorithm.nft.decay_cap", 0, True, 1, False),
    ("ar_dit.max_plan_tokens", 1, True, None, False),
    ("ar_dit.temperature", 0, False, None, False),
    ("ar_dit.token_clip", 0, False, None, False),
    ("ar_dit.token_weight", 0, True, None, False),
    ("ar_dit.window_weight", 0, True, None, False),
    ("ar_dit.decoder_lr_scale", 0, False, None, False),
    ("placement.rollout_ranks", 0, True, None, False),  # 0 when colocated; check_placement bounds it by the world
    ("async.max_staleness", 0, True, None, False),  # 0: on-policy
    ("async.liveness_timeout_s", 0, False, None, False),
    ("async.heartbeat_s", 0, False, None, False),  # <= liveness_timeout_s / 3: check_placement
    ("async.stall_timeout_s", 0, False, None, False),
]

# Fields with a fixed set of values (None listed where the field may be unset).
CHOICES: dict[str, tuple[Any, ...]] = {
    "model.backend": ("local", "te"),
    "model.params_dtype": ("fp32", "bf16"),
    "model.recompute": (None, "full", "selective"),
    "model.bagel_experts": ("generation", "both"),
    "rollout.sde_type": ("sde", "cps", "dance_sde"),
    "rollout.transformer": ("auto", "engine", "trainer"),
    "rollout.engine": ("diffusers", "vllm_omni"),
    "rollout.vllm_omni_process": ("engine", "inline"),
    "rollout.dtype": ("fp32", "bf16"),
    "rollout.vae_dtype": ("auto", "fp32", "bf16"),
    "rollout.lora_sync": ("auto", "adapter", "merge"),
    "rollout.quantization": QUANTIZATION_MODES,
    "algorithm.is_level": IS_LEVELS,
    "algorithm.std_mode": ("global", "group"),
    "algorithm.old_logprob": ("recompute", "bypass"),
    "algorithm.name": ("flowgrpo", "mixgrpo", "diffusionnft", "grpo_guard"),
    "algorithm.nft.adv_mode": ("all", "positive_only", "negative_only", "binary"),
    "logging.video_format": ("gif", "mp4"),
    "ar_dit.aggregation": ("token_mean", "seq_mean_token_mean"),
    "ar_dit.freeze": (None, "decoder", "dit"),
    "placement.mode": ("colocated", "disaggregated"),
}

# What the AR-DiT trainer does not implement: each field must keep the JobConfig default (or the value given)
# under model.family=ar_dit, so a setting is never silently ignored.
AR_DIT_UNSUPPORTED: list[tuple[str, Any, str]] = [
    ("parallel.pp", 1, "the hybrid trains without pipeline parallelism"),
    ("parallel.ring", 1, "the hybrid's context parallelism is Ulysses (parallel.ulysses)"),
    ("model.params_dtype", "fp32", "the hybrid trains in fp32"),
    ("model.backend", "local", "the hybrid has the local layer spec only"),
    ("model.recompute", None, "the hybrid has no activation recompute"),
    ("model.bagel_experts", "generation", "the experts are BAGEL's (model.family=bagel)"),
    ("rollout.engine", "diffusers", "the hybrid rolls out with its embedded engine (vLLM halves: Python API)"),
    ("rollout.transformer", "auto", "the hybrid's rollout always samples with its own copy"),
    ("rollout.dtype", "fp32", "the hybrid's rollout samples in fp32"),
    ("rollout.vae_dtype", "auto", "the hybrid's rollout samples in fp32"),
    ("rollout.tp", 1, "the hybrid's rollout is one process per rank"),
    ("rollout.text_length", None, "the hybrid pads plans itself"),
    ("rollout.num_frames", 1, "the hybrid generates images"),
    ("rollout.max_sequence_length", 512, "the hybrid pads plans itself"),
    ("rollout.guidance_scale", 1.0, "the hybrid samples without classifier-free guidance"),
    ("rollout.negative_prompt", None, "the hybrid samples without classifier-free guidance"),
    ("rollout.image_guidance_scale", 1.0, "the hybrid samples without classifier-free guidance"),
    ("rollout.guidance_scale_2", None, "the hybrid samples without classifier-free guidance"),
    ("reward.url", None, "the hybrid's reward scores trajectories in process (ar_dit.reward)"),
    ("reward.scorer", "jpeg_compressibility", "the hybrid's reward is ar_dit.reward (it reads plan tokens too)"),
    ("rollout.height", 64, "the hybrid's image size is ar_dit.grid"),
    ("rollout.width", 64, "the hybrid's image size is ar_dit.grid"),
    ("rollout.max_batch_size", 16, "the hybrid's rollout samples a step in one batch"),
    ("algorithm.beta", 0.0, "the hybrid has no KL term"),
    ("algorithm.max_logp_gap", None, "the hybrid logs its train/rollout gaps only"),
    ("rollout.quantization", "none", "the hybrid's rollout samples in fp32 (no quantized rollout)"),
    ("algorithm.is_cap", None, "the hybrid's loss has no importance weights"),
    ("algorithm.is_level", "token", "the hybrid's loss has no importance weights"),
    ("optim.warmup_steps", 0, "the hybrid's learning rate is constant"),
    ("optim.micro_batch_size", None, "the hybrid runs each mini-batch in one forward"),
    ("optim.distributed_optimizer", False, "the hybrid's optimizer is not sharded"),
    ("optim.ema_decay", 0.0, "the hybrid keeps no EMA of its weights"),
    ("model.lora.rank", 0, "the hybrid trains all its weights (LoRA is built for the DiT families)"),
    ("eval", None, "the hybrid has no held-out evaluation (eval.prompts must stay empty)"),
    ("algorithm.name", "flowgrpo", "the hybrid's window term is FlowGRPO's (its token term GRPO)"),
]

# Scorers whose reward is the text the prompt quotes: every prompt must quote one.
OCR_SCORERS = ("ocr", "vlm_ocr", "video_ocr")
# Scorers that ask a VLM judge server: its base_url and model reach them only as the reward server's --scorer-kwargs.
VLM_JUDGE_SCORERS = ("vlm_ocr", "vlm_judge", "unifiedreward", "geneval")


def get_field(cfg: Any, dotted: str) -> Any:
    """The value of `a.b.c` in a nested dataclass (`async.x` is the field `async_.x`)."""
    from megatron_omni.trainer.config import KEYWORD_FIELDS

    for part in dotted.split("."):
        cfg = getattr(cfg, KEYWORD_FIELDS.get(part, part))
    return cfg


def _fields(cfg: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, type hint, value) of every leaf field of a nested dataclass."""
    from megatron_omni.trainer.config import FIELD_KEYS

    out = []
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        key = FIELD_KEYS.get(f.name, f.name)
        if dataclasses.is_dataclass(value):
            out += _fields(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", hints[f.name], value))
    return out


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is list:
        (item,) = typing.get_args(hint)
        return isinstance(value, list) and all(_type_ok(x, item) for x in value)
    if origin is dict:
        key, item = typing.get_args(hint)
        return isinstance(value, dict) and all(_type_ok(k, key) and _type_ok(v, item) for k, v in value.items())
    return isinstance(value, hint)


def _bound_text(lo: float | None, lo_in: bool, hi: float | None, hi_in: bool) -> str:
    if hi is None:
        return f"must be {'>=' if lo_in else '>'} {lo:g}"
    return f"must be in {'[' if lo_in else '('}{lo:g}, {hi:g}{']' if hi_in else ')'}"


def check_family(cfg: Any, planning: bool = False) -> str:
    """model.family names a registered family, and a family's own settings fit it; returns the family's kind.
    `planning` (a dry run) is passed to a family trainer's `check_config` (what a plan does not need, such as the
    weights' folder, is not required). Raises ConfigError naming the field."""
    from megatron_omni.trainer.config import ConfigError
    from model_providers import family_names, get_family

    if cfg.model.family not in family_names():
        raise ConfigError(f"model.family={cfg.model.family!r} must be {'|'.join(family_names())}")
    family = get_family(cfg.model.family)
    if family.kind == "ar_dit":
        _check_ar_dit(cfg, family)
    if family.trainer is not None:  # a family with its own trainer checks the settings that trainer reads
        import importlib

        try:
            importlib.import_module(family.trainer).check_config(cfg, planning=planning)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    return family.kind


def check_family_layout(cfg: Any, world_size: int) -> None:
    """A family trainer's checks against the world size (its module's `check_layout`, where it has one), after the
    layout resolved. Raises ConfigError naming the setting."""
    from megatron_omni.trainer.config import ConfigError
    from model_providers import get_family

    family = get_family(cfg.model.family)
    if family.trainer is None:
        return
    check = getattr(importlib.import_module(family.trainer), "check_layout", None)
    if check is not None:
        try:
            check(cfg, world_size)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def _check_ar_dit(cfg: Any, family: Any) -> None:
    from megatron_omni.trainer.config import ConfigError

    if cfg.model.preset not in family.presets:
        raise ConfigError(f"model.preset={cfg.model.preset!r} must be {'|'.join(family.presets)} for "
                          f"model.family={family.name} (the hybrid is built from its preset)")
    for name, default, why in AR_DIT_UNSUPPORTED:
        if name == "eval":
            value, default = cfg.eval.prompts, []
            name = "eval.prompts"
        else:
            value = get_field(cfg, name)
        if value != default:
            raise ConfigError(f"{name}={value!r} is not supported with model.family={family.name}: {why}")
    vocab = int(family.config(cfg.model.preset).decoder["vocab_size"])
    for i, prompt in enumerate(cfg.prompts):
        ids = prompt.split()
        if not ids or not all(t.isdigit() and int(t) < vocab for t in ids):
            raise ConfigError(f"prompts[{i}]={prompt!r}: an AR-DiT prompt is whitespace-separated token ids in "
                              f"[0, {vocab}) (the tiny hybrid has no tokenizer)")
    a = cfg.ar_dit
    if len(a.grid) != 3 or a.grid[0] != 1 or min(a.grid) < 1:
        raise ConfigError(f"ar_dit.grid={a.grid!r} must be [1, h, w] with h, w >= 1")
    if a.freeze == "decoder" and a.window_weight == 0:
        raise ConfigError("ar_dit.freeze='decoder' with ar_dit.window_weight=0 leaves nothing to train")
    if a.token_weight == 0 and a.window_weight == 0:
        raise ConfigError("ar_dit.token_weight and ar_dit.window_weight are both 0: nothing to train")
    module, _, attr = a.reward.partition(":")
    if not module or not attr or not _module_importable(module):
        raise ConfigError(f"ar_dit.reward={a.reward!r} must be MODULE:CALLABLE with an importable module")


def _module_importable(name: str) -> bool:
    from megatron_omni.trainer.config import module_importable

    return module_importable(name)


def check_fields(cfg: Any) -> None:
    """Types of every field, then the value sets and the bounds; raises ConfigError naming the field."""
    from megatron_omni.trainer.config import ConfigError

    for name, hint, value in _fields(cfg):
        if not _type_ok(value, hint):
            raise ConfigError(f"{name}={value!r} is not a {getattr(hint, '__name__', hint)}")
    for name, allowed in CHOICES.items():
        value = get_field(cfg, name)
        if value not in allowed:
            shown = "|".join("none" if a is None else str(a) for a in allowed)
            raise ConfigError(f"{name}={value!r} must be {shown}")
    for name, lo, lo_in, hi, hi_in in BOUNDS:
        value = get_field(cfg, name)
        if value is None:
            continue
        low_ok = lo is None or (value >= lo if lo_in else value > lo)
        high_ok = hi is None or (value <= hi if hi_in else value < hi)
        if not (low_ok and high_ok):
            raise ConfigError(f"{name}={value!r} {_bound_text(lo, lo_in, hi, hi_in)}")
    r = cfg.rollout
    if r.window_size > r.num_steps:
        raise ConfigError(f"rollout.window_size={r.window_size} must be <= rollout.num_steps={r.num_steps}")
    if r.window_range is not None:
        wr = r.window_range
        if len(wr) != 2 or not 0 <= wr[0] < wr[1] <= r.num_steps:
            raise ConfigError(f"rollout.window_range={wr!r} must be [lo, hi) with 0 <= lo < hi <= "
                              f"rollout.num_steps={r.num_steps}")
        if wr[1] - wr[0] < r.window_size:
            raise ConfigError(f"rollout.window_range={wr!r} is shorter than rollout.window_size={r.window_size}")
    if not cfg.run_dir.strip():
        raise ConfigError("run_dir='' must name a folder")
    if not cfg.model.pipeline.strip():
        raise ConfigError("model.pipeline='' must be 'tiny' or a diffusers pipeline folder")
    if not cfg.logging.wandb_project.strip():
        raise ConfigError("logging.wandb_project='' must name a project")
    if cfg.checkpoint.resume is not None and not cfg.checkpoint.resume.strip():
        raise ConfigError("checkpoint.resume='' must be auto or a checkpoint folder (or none)")
    for field_name in ("prompts", "eval.prompts", "eval.transfer_prompts"):
        for i, prompt in enumerate(get_field(cfg, field_name)):
            if not prompt.strip():
                raise ConfigError(f"{field_name}[{i}]={prompt!r} is blank")
    check_lora(cfg)


def check_lora(cfg: Any) -> None:
    """model.lora against what it combines with: target patterns non-blank, the local layer spec, no EMA (its
    copy would be the whole base again), and rollout.lora_sync only with adapters."""
    from megatron_omni.trainer.config import ConfigError

    lora = cfg.model.lora
    if lora.targets is not None:
        if not lora.targets:
            raise ConfigError("model.lora.targets=[] adapts nothing; give module-name patterns or none for the "
                              "defaults")
        for i, t in enumerate(lora.targets):
            if not t.strip():
                raise ConfigError(f"model.lora.targets[{i}]={t!r} is blank")
    if not lora.enabled:
        if cfg.rollout.lora_sync != "auto":
            raise ConfigError(f"rollout.lora_sync={cfg.rollout.lora_sync!r} needs model.lora.rank > 0")
        return
    if cfg.model.backend != "local":
        raise ConfigError(f"model.backend={cfg.model.backend!r} with model.lora.rank > 0 needs model.backend=local "
                          "(the adapters wrap Megatron-Core's local Column/RowParallelLinear; the TE spec's linears "
                          "are not adapted yet)")
    if cfg.optim.ema_decay > 0:
        raise ConfigError(f"optim.ema_decay={cfg.optim.ema_decay!r} with model.lora.rank={lora.rank}: the EMA "
                          "keeps a second full copy of the model, which LoRA exists to avoid; set optim.ema_decay=0")


def check_algorithm(cfg: Any) -> None:
    """`algorithm.name` against what it combines with: each algorithm's own section is left at its defaults
    under another algorithm (never silently ignored); the policy-gradient rules need an SDE window (GRPO-Guard's
    normalised ratio the `sde` step); DiffusionNFT samples with the ODE and has no log-probs to compare."""
    from megatron_omni.trainer.config import ConfigError, DiffusionNFTConfig, MixGRPOConfig

    a, r = cfg.algorithm, cfg.rollout
    for section, default, owner in (("mixgrpo", MixGRPOConfig(), "mixgrpo"), ("nft", DiffusionNFTConfig(),
                                                                             "diffusionnft")):
        if a.name != owner and getattr(a, section) != default:
            raise ConfigError(f"algorithm.{section}={getattr(a, section)!r} applies to algorithm.name={owner} only "
                              f"(algorithm.name={a.name}); leave it at its defaults")
    if a.name == "diffusionnft":
        if a.max_logp_gap is not None:
            raise ConfigError(f"algorithm.max_logp_gap={a.max_logp_gap!r} with algorithm.name=diffusionnft: its ODE "
                              "rollout records no log-probs to compare")
        if cfg.eval.rollout_sampler:
            raise ConfigError("eval.rollout_sampler=True with algorithm.name=diffusionnft: its rollout samples with "
                              "the ODE, which the evaluation already measures")
        from megatron_omni.algorithms.nft import old_policy_decay

        n = a.nft
        lagging = old_policy_decay(cfg.steps * cfg.optim.mini_batches, n.decay_flat, n.decay_rate, n.decay_cap) > 0
        if lagging and cfg.model.lora.enabled:
            raise ConfigError(f"algorithm.nft.decay_cap={n.decay_cap!r} with model.lora.rank={cfg.model.lora.rank}: a "
                              "lagging old policy keeps a full copy of the model, which LoRA exists to avoid; set "
                              "algorithm.nft.decay_cap=0 (or decay_flat past the run's updates)")
        return
    if not (r.noise_level > 0 and r.window_size > 0):
        raise ConfigError(f"rollout.noise_level={r.noise_level!r} with algorithm.name={a.name}: its update trains the "
                          "SDE window's transitions; set rollout.noise_level > 0 and rollout.window_size > 0")
    if a.name == "grpo_guard" and r.sde_type != "sde":
        raise ConfigError(f"rollout.sde_type={r.sde_type!r} with algorithm.name=grpo_guard: its ratio normalisation "
                          "inverts the `sde` step's Gaussian log-prob; use rollout.sde_type=sde")


def check_quantization(cfg: Any) -> None:
    """rollout.quantization and the importance-weight correction against what they combine with: a quantized
    rollout needs the engine's own copy of the transformer, a model family naming its quantized linears, merged
    LoRA weights (ModelOpt's FP8 linears take no peft adapters) and, for the evaluation's unquantized
    comparison, an engine that can sample unquantized (the embedded one); `algorithm.is_cap` needs the trainer's
    recomputed old log-probs of an SDE rollout, and `algorithm.is_level` a cap."""
    from megatron_omni.trainer.config import ConfigError
    from model_providers import get_family

    a, r = cfg.algorithm, cfg.rollout
    if r.quantization != "none":
        q = f"rollout.quantization={r.quantization!r}"
        if r.transformer == "trainer":
            raise ConfigError(f"{q} with rollout.transformer='trainer': the rollout would sample with the trainer's "
                              "own module, which is not quantized; use rollout.transformer=engine or auto")
        if not get_family(cfg.model.family).quantized_linears:
            raise ConfigError(f"{q} with model.family={cfg.model.family}: the family names no quantized linears "
                              "(ModelFamily.quantized_linears); use rollout.quantization=none")
        if cfg.model.lora.enabled and r.lora_sync == "adapter":
            raise ConfigError(f"{q} with rollout.lora_sync='adapter': the engine's FP8 linears are ModelOpt's (or "
                              "vLLM's), which take no LoRA adapters; use rollout.lora_sync=merge (or auto)")
        if r.engine == "vllm_omni" and cfg.eval.prompts:
            raise ConfigError(f"{q} with rollout.engine=vllm_omni and eval.prompts: each evaluation also samples the "
                              "prompts unquantized, which vLLM-Omni's FP8 engine (FP8 weights only) cannot; use "
                              "rollout.engine=diffusers or no eval.prompts")
    if a.is_cap is None or a.is_cap == 0:
        if a.is_level != "token":
            raise ConfigError(f"algorithm.is_level={a.is_level!r} needs algorithm.is_cap (the importance weights "
                              "are off)")
        return
    if a.is_cap < 1:
        raise ConfigError(f"algorithm.is_cap={a.is_cap!r} must be >= 1 (a cap below 1 down-weights every on-policy "
                          "transition), or 0 / none (off)")
    if a.name == "diffusionnft":
        raise ConfigError(f"algorithm.is_cap={a.is_cap!r} with algorithm.name=diffusionnft: its ODE rollout records "
                          "no log-probs to weigh")
    if a.old_logprob == "bypass":
        raise ConfigError(f"algorithm.is_cap={a.is_cap!r} with algorithm.old_logprob='bypass': the old log-probs "
                          "are then the rollout's own and every weight would be 1; use algorithm.old_logprob=recompute")


def check_reward(cfg: Any) -> None:
    """reward.scorer against the registry and reward.url's syntax (scheme http|https, a host, a valid port);
    reward.options only for scorers the spec uses; with an OCR scorer every prompt must quote the text to render."""
    from megatron_omni.reward.errors import RewardInputError
    from megatron_omni.reward.registry import scorer_names
    from megatron_omni.reward.text import target_from_prompt
    from megatron_omni.trainer.config import ConfigError

    try:
        names = scorer_names(cfg.reward.scorer)
    except RewardInputError as exc:
        raise ConfigError(f"reward.scorer={cfg.reward.scorer!r}: {exc}") from None
    if cfg.reward.url is not None:
        check_url(cfg.reward.url, "reward.url")
    elif judges := [n for n in names if n in VLM_JUDGE_SCORERS]:
        raise ConfigError(f"reward.scorer={cfg.reward.scorer!r}: {judges[0]} asks a VLM judge server (vLLM), whose "
                          "base_url and model only the reward server takes (--scorer-kwargs): set reward.url to that "
                          "reward server (REWARD_KIND=vlm in the launch scripts starts the judge and the server)")
    unknown = sorted(set(cfg.reward.options) - set(names))
    if unknown:  # options for a scorer the spec does not use: a typo would otherwise be ignored silently
        raise ConfigError(f"reward.options names {unknown}, which reward.scorer={cfg.reward.scorer!r} does not use")
    if any(n in OCR_SCORERS for n in names):
        for field_name in ("prompts", "eval.prompts", "eval.transfer_prompts"):
            for i, prompt in enumerate(get_field(cfg, field_name)):
                try:
                    target_from_prompt(prompt)
                except RewardInputError as exc:
                    raise ConfigError(f"{field_name}[{i}] (reward.scorer={cfg.reward.scorer!r} rewards the quoted "
                                      f"text): {exc}") from None


def check_dit_traits(cfg: Any) -> None:
    """A DiT family's settings against its traits (`model_providers.DiTTraits`): frames, scorers that read frame
    strips, the rollout engine, true CFG, MixGRPO-Flash's tail. Raises ConfigError naming the field, the value and
    the family."""
    from megatron_omni.reward.registry import scorer_names
    from megatron_omni.reward.video import VIDEO_SCORERS
    from megatron_omni.trainer.config import ConfigError
    from model_providers import get_family

    family = get_family(cfg.model.family)
    traits, r, name = family.traits, cfg.rollout, family.name
    if traits.video:
        if (r.num_frames - 1) % traits.frame_multiple:
            raise ConfigError(f"rollout.num_frames={r.num_frames!r} with model.family={name}: num_frames - 1 must be "
                              f"a multiple of {traits.frame_multiple} (the VAE's temporal compression), e.g. "
                              f"{traits.frame_multiple + 1} or {2 * traits.frame_multiple + 1}")
    else:
        if r.num_frames != 1:
            raise ConfigError(f"rollout.num_frames={r.num_frames!r} with model.family={name}: the family generates "
                              "images (num_frames 1)")
        video = [n for n in scorer_names(cfg.reward.scorer) if n in VIDEO_SCORERS]
        if video:
            raise ConfigError(f"reward.scorer={cfg.reward.scorer!r} with model.family={name}: {video[0]} scores "
                              "video frame strips and the family generates images")
    if r.engine not in traits.rollout_engines:
        raise ConfigError(f"rollout.engine={r.engine!r} is not supported with model.family={name} yet (engines: "
                          f"{'|'.join(traits.rollout_engines)})")
    if r.guidance_scale > 1 and not traits.true_cfg:
        raise ConfigError(f"rollout.guidance_scale={r.guidance_scale!r} is not supported with model.family={name} "
                          "yet: its rollout samples without true CFG (guidance 1)")
    if r.image_guidance_scale != 1.0:
        raise ConfigError(f"rollout.image_guidance_scale={r.image_guidance_scale!r} is not supported with model.family="
                          f"{name}: image CFG is BAGEL's (model.family=bagel)")
    if r.guidance_scale_2 is not None and not traits.video:
        raise ConfigError(f"rollout.guidance_scale_2={r.guidance_scale_2!r} is not supported with model.family={name}: "
                          "it guides Wan2.2 A14B's low-noise expert (model.family=wan)")
    if r.guidance_scale_2 is not None and r.guidance_scale <= 1:
        raise ConfigError(f"rollout.guidance_scale_2={r.guidance_scale_2!r} needs true CFG on (rollout.guidance_scale "
                          f"> 1, got {r.guidance_scale!r}): WanPipeline guides only then")
    if cfg.model.bagel_experts != "generation":
        raise ConfigError(f"model.bagel_experts={cfg.model.bagel_experts!r} is not supported with model.family={name}: "
                          "the experts are BAGEL's (model.family=bagel)")
    if r.distilled_guidance is not None and traits.guidance_embeds_key is None:
        raise ConfigError(f"rollout.distilled_guidance={r.distilled_guidance!r} is not supported with model.family="
                          f"{name}: its models take no distilled guidance input")
    if cfg.eval.guidance_scale is not None and cfg.eval.guidance_scale > 1 and not traits.true_cfg:
        raise ConfigError(f"eval.guidance_scale={cfg.eval.guidance_scale!r} is not supported with model.family="
                          f"{name} yet: its rollout samples without true CFG (guidance 1)")
    flash = cfg.algorithm.mixgrpo.flash_ratio
    if flash is not None and not traits.flash_tail:
        raise ConfigError(f"algorithm.mixgrpo.flash_ratio={flash!r} is not supported with model.family={name} yet: "
                          "its engine samples a static-shift grid and has no compressed ODE tail (MixGRPO-Flash)")


def check_placement(cfg: Any, world_size: int, planning: bool = False) -> None:
    """placement.* and async.* against the world and what the asynchronous rollout supports (docs/async.md):
    the split itself (`parallel.placement.split_world`: at least one rank on each side), the heartbeat inside
    the liveness bound, staleness only with rollout ranks of its own, and, disaggregated, the settings the
    rollout service cannot serve yet (`placement_limits`; `planning`: a dry run plans such a job and refuses
    it after its printout). Raises ConfigError naming the field and the value."""
    from megatron_omni.parallel.placement import PlacementError, split_world
    from megatron_omni.trainer.config import ConfigError
    from model_providers import get_family

    pl, a = cfg.placement, cfg.async_
    if a.heartbeat_s > a.liveness_timeout_s / 3:
        raise ConfigError(f"async.heartbeat_s={a.heartbeat_s!r} must be <= async.liveness_timeout_s / 3 = "
                          f"{a.liveness_timeout_s / 3:g} (three heartbeats fit in the liveness bound)")
    if pl.mode == "colocated":
        if pl.rollout_ranks:
            raise ConfigError(f"placement.rollout_ranks={pl.rollout_ranks!r} with placement.mode='colocated': every "
                              "rank rolls out; set placement.mode=disaggregated")
        if a.max_staleness:
            raise ConfigError(f"async.max_staleness={a.max_staleness!r} with placement.mode='colocated': a colocated "
                              "rollout waits for the update (on-policy); set placement.mode=disaggregated")
        return
    try:
        split_world(pl.mode, world_size, pl.rollout_ranks or None, rollout_tp=cfg.rollout.tp)
    except PlacementError as exc:
        raise ConfigError(str(exc)) from None
    family = get_family(cfg.model.family)
    for bad, why in ((family.kind != "dit", "the rollout service serves the DiT families"),
                     (family.kind == "dit" and family.traits.video, "the rollout service's probe and reward stream "
                      "are built for image families; use placement.mode=colocated")):
        if bad:
            raise ConfigError(f"model.family={cfg.model.family!r} is not supported with placement.mode="
                              f"disaggregated: {why}")
    limits = placement_limits(cfg)
    if limits and not planning:
        raise ConfigError(limits[0])


def placement_limits(cfg: Any) -> list[str]:
    """What the disaggregated trainer cannot run yet with this image-family config (one message per setting,
    naming the field and the value; empty when it runs). A dry run plans such a job, then refuses it."""
    d = "with placement.mode=disaggregated"
    unsupported = [
        (cfg.algorithm.name == "diffusionnft", "algorithm.name", cfg.algorithm.name,
         "its ODE rollout samples with a lagging old policy the rollout ranks do not hold"),
        (cfg.rollout.engine == "vllm_omni" and cfg.rollout.vllm_omni_process != "engine", "rollout.vllm_omni_process",
         cfg.rollout.vllm_omni_process, "the rollout ranks own vLLM-Omni Omni engines (their workers hold the back "
         "buffer); use engine"),
        (cfg.rollout.transformer == "trainer", "rollout.transformer", cfg.rollout.transformer,
         "the rollout ranks sample with their own copy; use engine or auto"),
        (cfg.model.lora.enabled and cfg.rollout.lora_sync == "adapter", "rollout.lora_sync", cfg.rollout.lora_sync,
         "the rollout ranks' back buffer takes the adapters merged into full weights; use auto or merge"),
    ]
    return [f"{name}={value!r} is not supported {d}: {why}" for bad, name, value, why in unsupported if bad]


def check_url(url: str, name: str) -> None:
    """An http(s) URL with a host and, when given, a port in 1..65535; ConfigError naming `name` otherwise."""
    from megatron_omni.trainer.config import ConfigError

    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ConfigError(f"{name}={url!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8000)")
    if not parts.hostname:
        raise ConfigError(f"{name}={url!r} names no host (e.g. http://127.0.0.1:8000)")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{name}={url!r} has an invalid port (expected 1..65535)") from None
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(f"{name}={url!r} has port {port} outside 1..65535")


def check_files(cfg: Any) -> None:
    """What a real run reads and writes, before any work: the pipeline folder (unless 'tiny') and the run
    folder (created and written once, so a read-only or full disk is one line here, not a late traceback)."""
    from megatron_omni.trainer.config import ConfigError
    from model_providers import get_family

    # Only a DiT family reads a pipeline folder (the AR-DiT hybrid is built from its preset).
    family = get_family(cfg.model.family)
    if cfg.model.pipeline != "tiny" and family.kind == "dit":
        path = Path(cfg.model.pipeline)
        expected = family.traits.pipeline_class
        if not path.is_dir():
            raise ConfigError(f"model.pipeline={cfg.model.pipeline!r} is not a folder (a diffusers {expected} "
                              "folder, or 'tiny')")
        index = path / "model_index.json"
        if not index.is_file() or not os.access(index, os.R_OK):
            raise ConfigError(f"model.pipeline={cfg.model.pipeline!r} has no readable model_index.json (not a "
                              "diffusers pipeline folder)")
        try:
            held = json.loads(index.read_text()).get("_class_name")
        except (OSError, ValueError, AttributeError):
            raise ConfigError(f"model.pipeline={cfg.model.pipeline!r}: its model_index.json is not a JSON "
                              "object") from None
        if held != expected:
            raise ConfigError(f"model.pipeline={cfg.model.pipeline!r} holds a {held} and model.family="
                              f"{family.name} trains a {expected}; set model.family to the folder's family")
    check_writable(Path(cfg.run_dir), "run_dir")


def check_writable(folder: Path, name: str) -> None:
    """Create `folder` and write, flush and remove a small probe file in it; ConfigError on any OSError
    (read-only, permission, ENOSPC)."""
    from megatron_omni.trainer.config import ConfigError

    probe = folder / f".write-probe-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as fh:
            fh.write(b"\0" * 4096)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as exc:
        raise ConfigError(f"{name}={str(folder)!r} is not writable: {exc.strerror or exc}") from None
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass  # the folder could not be made: there is no probe to remove


def read_prompts_file(path: str | os.PathLike, name: str) -> list[str]:
    """Prompts from a UTF-8 file (one per line, blank lines skipped); ConfigError naming `name`, the file and,
    for text that is not UTF-8, the byte offset."""
    from megatron_omni.trainer.config import ConfigError

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{name}={str(path)!r} is not a file")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{name}={str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{name}={str(path)!r} is not UTF-8: byte 0x{data[exc.start]:02x} at offset "
                          f"{exc.start} (line {line})") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise ConfigError(f"{name}={str(path)!r} has no prompts")
    return prompts
