"""The job configuration: typed dataclasses under one root (`JobConfig`), recipes as Python functions that
return one, and `--set a.b=value` overrides that are type-checked (an unknown field or a value of the wrong
type is an error naming the field, raised before any work starts)."""

from __future__ import annotations

import dataclasses
import importlib
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from megatron_omni.rollout.base import SamplingParams


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the field."""


# The dtype names a config may use, and what they mean in torch (`torch_dtype`).
DTYPES = ("fp32", "bf16")
MODEL_BACKENDS = ("local", "te")
ROLLOUT_ENGINES = ("diffusers", "vllm_omni")


def vae_dtype(rollout: Any):
    """The torch dtype of `rollout.vae_dtype`, None for "auto" (the engine's own, `rollout.dtype`)."""
    return None if rollout.vae_dtype == "auto" else torch_dtype(rollout.vae_dtype)


def torch_dtype(name: str):
    """The torch dtype of a config dtype name ('fp32' | 'bf16'); raises ConfigError on any other name."""
    import torch

    table = {"fp32": torch.float32, "bf16": torch.bfloat16}
    if name not in table:
        raise ConfigError(f"dtype {name!r} is not one of {'|'.join(DTYPES)}")
    return table[name]


def module_importable(name: str) -> bool:
    """Whether `import name` would find the module (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# flow_grpo's (and VeRL-Omni's) Qwen-Image LoRA: the attention projections and MLP linears of both streams
# (diffusers to_q/k/v, to_out.0, add_q/k/v_proj, to_add_out, img_mlp/txt_mlp.net.0.proj and .net.2), as
# patterns over our Megatron module names; `adaln` adds the streams' modulation linears (img_mod.1/txt_mod.1).
LORA_TARGETS = ("*.linear_qkv", "*.linear_proj", "*.linear_fc1", "*.linear_fc2")
LORA_ADALN_TARGETS = ("*.adaln",)


@dataclass
class LoRAConfig:
    """Low-rank adapters on the DiT's tensor-parallel linears (`models/lora.py`): rank 0 is full fine-tuning.
    The defaults other than rank are flow_grpo's Qwen-Image recipe (r=64, alpha=128, no dropout)."""

    rank: int = 0
    alpha: float = 128.0
    dropout: float = 0.0
    # fnmatch patterns over the Megatron module names (e.g. "layers.*.img.linear_qkv"); None: LORA_TARGETS
    targets: list[str] | None = None
    adaln: bool = False  # also adapt the modulation linears (LORA_ADALN_TARGETS)

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    def target_patterns(self) -> list[str]:
        """The module-name patterns the adapters go on."""
        base = list(LORA_TARGETS) if self.targets is None else list(self.targets)
        return base + (list(LORA_ADALN_TARGETS) if self.adaln else [])


@dataclass
class ModelConfig:
    # The model family (a folder of model_providers/ with a family.py); its kind picks the trainer: "dit"
    # families train with FlowGRPO, "ar_dit" hybrids with the joint token + window objective (`ar_dit` section).
    family: str = "qwen_image"
    pipeline: str = "tiny"  # the family's diffusers pipeline folder, or "tiny": built offline into the run folder
    tiny_seed: int = 0
    backend: str = "local"  # layer spec: "local" | "te" (TransformerEngine linears; needs transformer_engine)
    # Parameters and activations of the Megatron model: "fp32" | "bf16". bf16 is Megatron-LM's mixed precision:
    # bf16 weights, fp32 main weights, grads reduced in fp32 and Adam state in the optimizer; SDE math stays fp32.
    params_dtype: str = "fp32"
    recompute: str | None = None  # None | "full" | "selective"
    # Architecture preset: the one a --dry-run plans with when the pipeline is not at hand ("20b"); for a family
    # built from presets alone (ar_dit) the model itself ("tiny").
    preset: str | None = None
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # BAGEL (model.family=bagel): which experts of its Mixture-of-Transformers train: "generation" (the generation
    # expert and its modules; the understanding expert frozen, its prompt pass without autograd) | "both" (the
    # understanding expert too, through the prompt's KV cache the velocity attends to; `planner.mot.is_trained`).
    bagel_experts: str = "generation"


@dataclass
class ParallelConfig:
    tp: int = 1
    ulysses: int = 1
    ring: int = 1
    pp: int = 1


@dataclass
class RolloutConfig:
    # The sampler's fields and their defaults are SamplingParams' (one record: rollout/base.py), so a default is
    # written once; `sampling_params()` takes them over by name. A recipe sets the ones it depends on.
    height: int = SamplingParams.height
    width: int = SamplingParams.width
    # Frames per sample: 1 for an image family; a video family (its traits) takes 4k + 1 for Wan's VAE.
    num_frames: int = SamplingParams.num_frames
    num_steps: int = SamplingParams.num_steps
    noise_level: float = SamplingParams.noise_level
    sde_type: str = SamplingParams.sde_type
    window_size: int = SamplingParams.window_size
    # [lo, hi) of the window's first step; None: [0, max(window_size, num_steps // 2))
    window_range: list[int] | None = SamplingParams.window_range
    guidance_scale: float = SamplingParams.guidance_scale
    # Wan2.2 A14B: the low-noise expert's steps' CFG scale (`WanPipeline`'s guidance_scale_2); None: guidance_scale
    guidance_scale_2: float | None = SamplingParams.guidance_scale_2
    # BAGEL's image CFG scale (its `cfg_img_scale`, applied where text CFG is; 1: none); other families refuse > 1
    image_guidance_scale: float = 1.0
    negative_prompt: str | None = SamplingParams.negative_prompt
    # Text tokens a prompt is cut to; Wan pads every prompt's text to it (text_length when set), so a small
    # value keeps a tiny video model's cross-attention small.
    max_sequence_length: int = SamplingParams.max_sequence_length
    # A guidance-distilled family's guidance input (FLUX.1-dev; its traits' `guidance_embeds_key`); None: its default
    distilled_guidance: float | None = SamplingParams.distilled_guidance
    prompts_per_step: int = 4
    group_size: int = 4
    max_batch_size: int = 16
    # Which transformer the embedded engine samples with: "engine" (its own diffusers copy, refreshed through
    # the bridge after every update), "trainer" (the trainer's Megatron module itself: no copy and no sync;
    # needs a one-rank model replica, tp = ulysses = ring = pp = 1, and the engine's dtype), "auto" (trainer when
    # it can, else engine).
    transformer: str = "auto"
    # The rollout engine: "diffusers" (embedded, one process per rank) | "vllm_omni" (vLLM-Omni's pipeline with
    # our SDE pipeline class and worker extension).
    engine: str = "diffusers"
    # Where vLLM-Omni runs (rollout.engine=vllm_omni): "engine" (vLLM-Omni's `Omni` engine, owned by the first rank
    # of each rollout group, with its own worker processes; on every machine, CPU through our platform plugin) |
    # "inline" (its pipeline class and tensor-parallel transformer inside the trainer's own ranks: the bridge can
    # write the live weights, zero-copy `direct` mode at rollout tp = trainer tp).
    vllm_omni_process: str = "engine"
    dtype: str = "fp32"  # what the engine samples in: "fp32" | "bf16" (the SDE math and log-probs stay fp32)
    # What the engine's VAE decodes (and encodes source images) in: "auto" (rollout.dtype, as vLLM-Omni and VeRL-Omni
    # run it) | "fp32" (flow_grpo keeps its VAE in fp32 whatever the transformer's precision) | "bf16".
    vae_dtype: str = "auto"
    tp: int = 1  # the rollout engine's tensor-parallel size (vllm_omni; the diffusers engine is tp=1)
    # Pad every prompt's embeddings to this many tokens (>= the longest prompt); None: the longest prompt of
    # each rollout call. A model replica over several ranks (tp/ulysses/ring/pp > 1) rolls out one share of the
    # step's samples per rank: set it so every share pads alike and the trainer recomputes the rollout's
    # padding (in bf16, attention over another text length rounds differently: train_rollout_dlogp grows).
    text_length: int | None = SamplingParams.text_length
    # With model.lora, how the engine receives the adapters: "adapter" (the adapters only: the diffusers engine
    # through peft, vLLM-Omni through its LoRA manager and LoRA layers), "merge" (W + scale B A through the
    # bridge, as full weights), "auto" (adapter for the diffusers engine and vLLM-Omni, inline or its engine
    # over collective_rpc; merge for a quantized engine).
    lora_sync: str = "auto"
    # What the engine's copy of the transformer samples in, beside `dtype`: "none" | "fp8" (ModelOpt FP8 weights
    # per output channel and activations per token on the family's `quantized_linears`, re-quantized at every
    # sync; docs/quantization.md). The trainer keeps its precision, so the rollout samples a slightly other
    # policy: `algorithm.is_cap` corrects it. fp8 needs the engine's own copy (rollout.transformer engine or auto).
    quantization: str = "none"

    def sampling_params(self) -> SamplingParams:
        """The rollout's sampler, its fields taken by name (raises ValueError naming the problem: a window that
        does not fit, ...)."""
        return SamplingParams.from_config(self)


@dataclass
class RewardConfig:
    scorer: str = "jpeg_compressibility"
    url: str | None = None  # a running reward server; None scores in this process
    timeout_s: float = 120.0
    # A video family's samples reach the scorer as a strip of this many frames spread evenly over the video
    # (first and last included; `reward.video.video_strip`), or of all its frames when it has fewer.
    video_frames: int = 4
    # Constructor options per scorer name when the trainer builds the scorer (reward.url None), e.g.
    # {"pickscore": {"model": "/models/PickScore_v1", "processor": "/models/CLIP-ViT-H-14"}} (JSON in --set).
    options: dict[str, dict] = field(default_factory=dict)
    # With a weighted reward: GDPO-style advantages, each term normalised in its groups before the weighted sum,
    # the sum normalised over the batch (algorithms.advantages.term_advantages; docs/rewards.md).
    term_advantages: bool = False


# The update rules `algorithm.name` selects (one trainer, `trainer/flowgrpo.py`; the math in megatron_omni/algorithms).
ALGORITHMS = ("flowgrpo", "mixgrpo", "diffusionnft", "grpo_guard")


@dataclass
class MixGRPOConfig:
    """MixGRPO's sliding SDE window (`algorithm.name=mixgrpo`, `algorithms/mixgrpo.py`): every sample of a step
    shares one window of `rollout.window_size` steps inside `rollout.window_range`; it starts at the range's low
    end and moves `shift` steps every `steps_per_move` RL steps, rolling back to the start past the end. The
    defaults are the paper's (window moved by 1 every 25 iterations, roll back)."""

    steps_per_move: int = 25
    shift: int = 1
    roll_back: bool = True
    # MixGRPO-Flash: the ODE steps after the window compressed by this ratio and sampled with DPM-Solver++ (2nd
    # order); None: plain MixGRPO (the whole grid, Euler). The paper's Flash script: 0.4.
    flash_ratio: float | None = None


@dataclass
class DiffusionNFTConfig:
    """DiffusionNFT's own settings (`algorithm.name=diffusionnft`, `algorithms/nft.py`); defaults are NVlabs'
    reference (`config/nft.py`): mix_beta 1.0 (its OCR recipe: 0.1), 99% of the grid's noise levels per sample,
    every advantage sign, the old policy's decay schedule type 1 (0, 0.001, 0.5; OCR: type 2, 75, 0.0075, 0.999).
    Its KL weight is `algorithm.beta` (on velocities, `mean((v - v_ref)^2)`), its advantage clip
    `algorithm.adv_clip`."""

    mix_beta: float = 1.0  # strength of the implicit positive/negative policies
    timestep_fraction: float = 0.99  # each sample trains int(T * fraction) of the grid's T noise levels
    adv_mode: str = "all"  # "all" | "positive_only" | "negative_only" | "binary"
    weight_min: float = 1e-5  # floor of the adaptive x0-error weights
    # The old (sampling) policy after each RL step: decay * old + (1 - decay) * current, decay 0 for the first
    # `decay_flat` optimizer updates, then rising by `decay_rate` per update up to `decay_cap`.
    decay_flat: int = 0
    decay_rate: float = 0.001
    decay_cap: float = 0.5


@dataclass
class AlgorithmConfig:
    # The update rule: "flowgrpo" (clipped surrogate over the SDE window), "mixgrpo" (the window slides over
    # training, `mixgrpo`), "diffusionnft" (forward-process objective on ODE samples, `nft`), "grpo_guard"
    # (FlowGRPO with GRPO-Guard's ratio normalisation and step reweighting). docs/recipes.md compares them.
    name: str = "flowgrpo"
    clip_range: float = 1e-4
    adv_clip: float = 5.0
    std_mode: str = "global"  # "global" | "group"
    beta: float = 0.0
    old_logprob: str = "recompute"  # "recompute" (trainer's model) | "bypass" (the rollout's)
    # Largest mean |logp_trainer - logp_rollout| a step may show before the run stops with an error naming the
    # step (a stale or wrongly synced engine shows up here first); None: logged only.
    max_logp_gap: float | None = None
    # Truncated importance weights for a rollout that samples another policy than the trainer's old one (a
    # quantized rollout): each transition's term of the clipped surrogate is weighted by
    # min(exp(logp_old - logp_rollout), is_cap) (`algorithms/importance.py`); None or 0: off. Needs the
    # recomputed old log-probs (algorithm.old_logprob=recompute) and a rule with log-probs (not diffusionnft).
    is_cap: float | None = None
    # The weight's unit: "token" (one per transition), "sample" (the product of a sample's window transitions'
    # ratios), "geometric" (their geometric mean).
    is_level: str = "token"
    mixgrpo: MixGRPOConfig = field(default_factory=MixGRPOConfig)
    nft: DiffusionNFTConfig = field(default_factory=DiffusionNFTConfig)

    @property
    def importance_weighted(self) -> bool:
        """Whether the loss applies truncated importance weights (`is_cap` set and not 0)."""
        return bool(self.is_cap)


@dataclass
class OptimConfig:
    lr: float = 1e-4
    weight_decay: float = 1e-4
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    mini_batches: int = 2
    warmup_steps: int = 0
    max_bad_steps: int = 3  # NaN/inf loss or grads in a row before the run stops
    micro_batch_size: int | None = None  # (sample, window step) transitions per forward; None: the mini-batch's samples
    distributed_optimizer: bool = False  # shard optimizer state over data parallel (Megatron's ZeRO-1)
    # Exponential moving average of the trained weights in fp32, updated after every optimizer step (flow_grpo's
    # train.ema): held-out evaluation samples with it and checkpoints keep it (keys `ema.` + name). 0: off.
    ema_decay: float = 0.0


@dataclass
class CheckpointConfig:
    every: int = 0  # steps between checkpoints; 0 = only at the end
    keep: int = 2
    resume: str | None = None  # None | "auto" | a checkpoint folder


@dataclass
class LoggingConfig:
    tensorboard: bool = True
    wandb: bool = False
    wandb_project: str = "megatron-omni"
    image_every: int = 5  # steps between sample grids; 0 = only the last step
    # A video family's sample grids are also written as videos: "gif" (Pillow) | "mp4" (H.264 through PyAV)
    video_format: str = "gif"


@dataclass
class EvalConfig:
    # Held-out prompts (empty: no evaluation): their mean is the held-out figure (`reward_mean`), the ones that are
    # also RL prompts counted as `seen`, the others `unseen`; sampled with seeds no RL step uses.
    prompts: list[str] = field(default_factory=list)
    # Reported apart as `transfer_*`, outside the held-out figure: prompts RL cannot be expected to move (the OCR
    # miniature's words made of glyphs no RL prompt has).
    transfer_prompts: list[str] = field(default_factory=list)
    seeds_per_prompt: int = 2
    num_steps: int = 20  # ODE steps (noise 0): more than the rollout's
    guidance_scale: float | None = None  # None: the rollout's
    every: int = 0  # RL steps between evaluations; 0: only before the first and after the last step
    # Also sample the same prompts and seeds with the rollout's sampler (its steps, guidance and SDE window):
    # eval.jsonl gains rollout_sampler_* keys, the reward RL trains on, next to the ODE's.
    rollout_sampler: bool = False


@dataclass
class ARDiTConfig:
    """The settings only the AR-DiT hybrid's joint objective has (model.family=ar_dit). Its prompts are
    `JobConfig.prompts`, each the whitespace-separated token ids of the decoder's vocabulary (the tiny hybrid has
    no tokenizer); the window's SDE settings, group sizes, optimizer and clip range (algorithm.clip_range, the
    window term's) are the shared sections'."""

    max_plan_tokens: int = 8  # the decoder's plan budget
    temperature: float = 1.0  # plan-token sampling temperature
    grid: list[int] = field(default_factory=lambda: [1, 2, 4])  # the DiT's latent grid (1, h, w) in patches
    token_clip: float = 0.2  # the token term's PPO clip range
    token_weight: float = 1.0
    window_weight: float = 1.0
    aggregation: str = "token_mean"  # "token_mean" | "seq_mean_token_mean"
    freeze: str | None = None  # None | "decoder" | "dit"
    decoder_lr_scale: float = 1.0  # the decoder's lr is optim.lr * this
    # MODULE:CALLABLE, called with vocab_size=V, giving the reward: a callable trajectory -> [N] rewards, with
    # an optional `parts(trajectory) -> dict[str, float]` of metrics (the reward's terms).
    reward: str = "examples.ar_dit.recipe:BrightnessAndLowTokens"


PLACEMENT_MODES = ("colocated", "disaggregated")


@dataclass
class PlacementConfig:
    """Where the rollout runs (`parallel.placement`, docs/async.md): "colocated" (every rank rolls out, then
    trains) or "disaggregated" (the last `rollout_ranks` ranks run the rollout service, the others train; the
    rollout of step k + 1 overlaps the update of step k when `async.max_staleness` >= 1)."""

    mode: str = "colocated"
    rollout_ranks: int = 0  # disaggregated: how many ranks (the last ones) roll out; colocated: 0


@dataclass
class AsyncConfig:
    """The asynchronous rollout's settings (`rollout.async_service.AsyncSettings`); the config key is `async`
    (a Python keyword, so the field is `JobConfig.async_`)."""

    max_staleness: int = 0  # updates a trajectory's weights may lag the trainer's (0: on-policy, as colocated)
    liveness_timeout_s: float = 60.0  # a rollout rank silent this long is reported lost (rank and step named)
    heartbeat_s: float = 2.0  # how often a rollout rank says it is alive (<= liveness_timeout_s / 3)
    # a rollout rank that owes samples and finishes none this long is reported lost although it still answers (a
    # stuck engine); longer than one batch of samples takes
    stall_timeout_s: float = 600.0


# Config sections whose key is a Python keyword: key -> dataclass field.
KEYWORD_FIELDS = {"async": "async_"}
FIELD_KEYS = {v: k for k, v in KEYWORD_FIELDS.items()}


@dataclass
class JobConfig:
    run_dir: str = "runs/demo"
    steps: int = 10
    seed: int = 0
    prompts: list[str] = field(default_factory=lambda: ["a photo of a cat", "a red cube", "a city at night",
                                                        "a bowl of fruit"])
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    ar_dit: ARDiTConfig = field(default_factory=ARDiTConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)  # the `async` section

    def validate(self, world_size: int, planning: bool = False) -> None:
        """Check values and the layout against the world size; raises ConfigError naming the field. `planning`
        (a dry run): what the disaggregated trainer cannot run yet is refused after the plan is printed
        (`config_checks.placement_limits`), not here."""
        from megatron_omni.trainer.config_checks import (
            check_algorithm,
            check_dit_traits,
            check_family,
            check_family_layout,
            check_fields,
            check_placement,
            check_quantization,
            check_reward,
        )

        # Types, value sets, signs and bounds of every field (one line naming the field), the model family and
        # what it supports, then the reward's scorer and URL, then what depends on several fields at once.
        check_fields(self)
        if check_family(self, planning) != "dit":  # the hybrid's and a family trainer's own checks ran in check_family
            check_placement(self, world_size)
            _validate_layout(self, world_size)
            return check_family_layout(self, world_size)
        check_reward(self)
        check_dit_traits(self)
        check_algorithm(self)
        check_quantization(self)
        try:
            # Validates the sampling settings; eval.rollout_sampler's stochastic rollout is check_algorithm's
            # (the policy-gradient rules need the SDE window, DiffusionNFT refuses the rollout sampler).
            self.rollout.sampling_params()
        except ValueError as exc:
            raise ConfigError(f"rollout: {exc}") from None
        m, r = self.model, self.rollout
        checks = [
            (m.backend != "te" or module_importable("transformer_engine"), "model.backend",
             "needs the transformer_engine package (TransformerEngine, GPU image only), which is not importable "
             "here; use model.backend=local"),
            (r.engine != "vllm_omni" or module_importable("vllm_omni"), "rollout.engine",
             "= vllm_omni needs the vllm_omni package, which is not importable here; use rollout.engine=diffusers"),
            (r.tp == 1 or r.engine == "vllm_omni", "rollout.tp", "> 1 needs rollout.engine=vllm_omni (the diffusers "
             "engine is one process per rank)"),
            (self.rollout.transformer != "trainer" or self.parallel.tp * self.parallel.ulysses * self.parallel.ring
             * self.parallel.pp == 1, "rollout.transformer",
             "= trainer needs a one-rank model replica (parallel.tp = ulysses = ring = pp = 1); use engine or auto"),
            (r.transformer != "trainer" or r.engine == "diffusers", "rollout.transformer",
             "= trainer needs rollout.engine=diffusers (vLLM-Omni samples with its own copy)"),
            (not self.logging.wandb or module_importable("wandb"), "logging.wandb",
             "= true needs the wandb package, which is not importable here"),
            (len(self.prompts) >= 1, "prompts", "needs at least one prompt"),
            (not self.eval.transfer_prompts or self.eval.prompts, "eval.transfer_prompts",
             "needs eval.prompts (the held-out figure they are reported beside)"),
            (not set(self.eval.transfer_prompts) & set(self.eval.prompts), "eval.transfer_prompts",
             "shares prompts with eval.prompts (a prompt is held out or transfer, not both)"),
            (not self.eval.prompts or _eval_seeds_unused(self), "eval.seeds_per_prompt",
             "gives evaluation seeds that RL steps sample (with this seed and this many steps); change seed"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ConfigError(f"{name}={_get(self, name)!r} {why}")
        check_placement(self, world_size, planning)
        _validate_layout(self, trainer_world_size(self, world_size))


def trainer_world_size(cfg: JobConfig, world_size: int) -> int:
    """The ranks that train: the world, less the rollout ranks of a disaggregated placement."""
    return world_size - (cfg.placement.rollout_ranks if cfg.placement.mode == "disaggregated" else 0)


def _eval_seeds_unused(cfg: JobConfig) -> bool:
    """Whether no evaluation seed is one the run's RL steps sample (`evaluation.check_eval_seeds`)."""
    from megatron_omni.trainer.evaluation import check_eval_seeds

    try:
        check_eval_seeds(cfg.seed, cfg.eval.seeds_per_prompt,
                         cfg.steps * cfg.rollout.prompts_per_step * cfg.rollout.group_size)
    except ValueError:
        return False
    return True


def _validate_layout(cfg: JobConfig, world_size: int) -> None:
    """The samples per step against the mini-batches, and the layout against the world size."""
    from megatron_omni.parallel.layout import LayoutError, ParallelLayout

    n = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    if n % cfg.optim.mini_batches:
        raise ConfigError(f"optim.mini_batches={cfg.optim.mini_batches} does not divide the {n} samples per step")
    p = cfg.parallel
    try:
        ParallelLayout(tp=p.tp, ulysses=p.ulysses, ring=p.ring, pp=p.pp).resolve(world_size)
    except LayoutError as exc:
        raise ConfigError(f"parallel: {exc}") from exc
    # disaggregated: the rollout ranks form the engines' groups (`check_placement`, `split_world`'s rollout_tp)
    if cfg.placement.mode != "disaggregated" and world_size % cfg.rollout.tp:
        raise ConfigError(f"rollout.tp={cfg.rollout.tp} does not divide the world size {world_size}")


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, KEYWORD_FIELDS.get(part, part))
    return cfg


def _convert(value: str, typ: Any, name: str) -> Any:
    """Parse the text of an override into `typ` (JSON for lists, 'none' for None)."""
    origin = typing.get_origin(typ)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value.lower() in ("none", "null"):
            return None
        return _convert(value, args[0], name)
    try:
        if typ is bool:
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        if typ is int:
            return int(value)
        if typ is float:
            return float(value)
        if typ is str:
            return value
        if origin is dict:
            parsed = json.loads(value)
            if not isinstance(parsed, dict):
                raise ValueError(value)
            return parsed
        if origin is list:
            parsed = json.loads(value)
            (item,) = typing.get_args(typ)
            if not isinstance(parsed, list) or not all(isinstance(x, item) for x in parsed):
                raise ValueError(value)
            return parsed
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"--set {name}={value!r}: not a valid {getattr(typ, '__name__', typ)}") from None
    raise ConfigError(f"--set {name}: fields of type {typ} cannot be overridden")


def apply_overrides(cfg: JobConfig, overrides: list[str]) -> JobConfig:
    """Apply `a.b=value` strings in place and return `cfg`; unknown fields and bad values raise ConfigError."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected a.b=value")
        name, value = item.split("=", 1)
        parts = [KEYWORD_FIELDS.get(p, p) for p in name.strip().split(".")]
        target: Any = cfg
        for part in parts[:-1]:
            if not dataclasses.is_dataclass(target) or part not in {f.name for f in dataclasses.fields(target)}:
                raise ConfigError(f"--set {name}: unknown field {part!r}")
            target = getattr(target, part)
        fields = {f.name: f for f in dataclasses.fields(target)} if dataclasses.is_dataclass(target) else {}
        if parts[-1] not in fields:
            raise ConfigError(f"--set {name}: unknown field {parts[-1]!r}; known: {sorted(fields)}")
        hints = typing.get_type_hints(type(target))
        setattr(target, parts[-1], _convert(value, hints[parts[-1]], name))
    return cfg


def load_recipe(spec: str) -> JobConfig:
    """`module:function` -> the JobConfig the function returns."""
    if ":" not in spec:
        raise ConfigError(f"--recipe {spec!r}: expected MODULE:FUNCTION")
    mod_name, fn_name = spec.split(":", 1)
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--recipe {spec!r}: {exc}") from exc
    cfg = fn()
    if not isinstance(cfg, JobConfig):
        raise ConfigError(f"--recipe {spec!r} returned {type(cfg).__name__}, not a JobConfig")
    return cfg


def to_dict(cfg: JobConfig) -> dict[str, Any]:
    """The resolved config as plain data (saved with each run), keyed as the config is written (`async`)."""
    return {FIELD_KEYS.get(k, k): v for k, v in dataclasses.asdict(cfg).items()}
