"""RL on BAGEL's text-to-image generation (`model.family=bagel`, the family's own trainer: its
`ModelFamily.trainer` names this module): FlowGRPO, and MixGRPO, GRPO-Guard and DiffusionNFT
(`trainer.bagel_objectives`).

rollout (vLLM-Omni's BAGEL pipeline with our SDE window, `rollout.vllm_omni.bagel`, in this process) -> rewards
(the reward function of `reward.*`, in process or a server) -> group advantages -> old log-probs (recomputed by
our Megatron BAGEL, or the rollout's with `algorithm.old_logprob=bypass`) -> mini-batch updates of the clipped
surrogate over the window's transitions through Megatron-Core DDP and optimizer -> weight sync into the rollout's
modules through the bridge (the family's weight part at rollout tp 1, coverage-checked: a tensor refused or left
unwritten raises naming it).

The recompute rebuilds what the rollout conditioned on: the prompt's text KV cache (the understanding expert,
causal, positions 0..L-1), then per window step the generation expert's velocity of the recorded latents at the
recorded t (image-query tokens at RoPE position L), and under text CFG the unconditional branch (no text KV, RoPE
position 0) combined with BAGEL's global renorm (`models.bagel.model.text_cfg`); then `algorithms.sde`'s
log-prob of the recorded next latents.

What trains (`model.bagel_experts`, `planner.mot.is_trained`): by default the generation expert and the
generation-side modules (`planner.mot.is_generation_tensor`: the `_gen` MoT weights, time embedder, vae2llm, llm2vae,
the generation final norm); the understanding expert, the embeddings and the LM head are frozen (text-to-image never
reads the LM head; the frozen text pass then runs without autograd). With `both` (pp 1, no LoRA) the understanding
expert's layers and the token embeddings train too: the prompt's pass runs under autograd, and the window's
velocities reach it through the KV cache they attend to (the last layer's understanding output projection and MLP
feed no cached K/V: they get zero gradients, and AdamW's weight decay alone moves them). With `model.lora.rank > 0`
only adapters on the generation expert's linears train, merged into the rollout's modules at each sync.
`algorithm.beta > 0` adds the KL of the window transitions against the initial model (a frozen copy; with LoRA the
adapters off); `optim.ema_decay > 0` keeps a checkpointed EMA of the weights.
Prompts are token ids or text through the folder's tokenizer (`model_providers.bagel.tokenizer`). Layout: tp, pp,
dp and at pp 1 cp (`parallel.ulysses` x `ring`: each cp rank computes its shard of every velocity, gathered before
the CFG and the loss; pp > 1 recomputes and updates through `trainer.bagel_pipeline`, with LoRA, the KL term and the
EMA as at pp 1); rollout tp 1 in this process, every rank's pipeline receiving every stage's tensors.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_omni.algorithms.advantages import group_advantages
from megatron_omni.algorithms.loss import kl_penalty
from megatron_omni.algorithms.sde import sde_step
from megatron_omni.bridge import DistributedTransport, WeightSync
from megatron_omni.bridge.family_sync import family_plans
from megatron_omni.checkpoint.bagel import bagel_sharded_state_dict
from megatron_omni.models.bagel.model import latent_position_ids, text_cfg
from megatron_omni.parallel.platform import seed_everything
from megatron_omni.planner.mot import GEN_LORA_TARGETS, is_generation_tensor, is_trained
from megatron_omni.rollout.base import FinishedSample, SamplingParams
from megatron_omni.rollout.quantization import QuantizationSpec
from megatron_omni.rollout.vllm_omni.bagel import BagelSampling, BagelTrajectory, open_bagel_pipeline
from megatron_omni.trainer import bagel_pipeline
from megatron_omni.trainer.bagel_objectives import (
    BagelNftStep,
    nft_point_inputs,
    nft_points,
    nft_velocities,
    noised_points,
    step_sampling,
    window_policy_loss,
)
from megatron_omni.trainer.config import JobConfig, torch_dtype
from megatron_omni.trainer.grad_guard import GradGuard
from megatron_omni.trainer.objectives import blend_old_policy, lagging_old_policy, nft_reward_weight, old_policy_lags
from megatron_omni.trainer.rewards import RewardFunction, gather_rewards
from megatron_omni.trainer.skeleton import StepResult, UpdateTally, mini_batch_rows, step_metrics, step_prompts, update
from megatron_omni.trainer.training_state import OptimizerSettings, build_ddp_and_optimizer, build_scheduler
from model_providers import get_family

CONTENT_KEY = "bagel_rl"
# LoRA's default targets: every parallel linear of the generation expert (q/k/v, o, the SwiGLU's fc1 and fc2; the
# planner's, which counts their adapters).
BAGEL_LORA_TARGETS = GEN_LORA_TARGETS
_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer")


def lora_patterns(cfg: JobConfig) -> list[str]:
    """The patterns `model.lora` adapts: its `targets`, default `BAGEL_LORA_TARGETS`."""
    return list(BAGEL_LORA_TARGETS) if cfg.model.lora.targets is None else list(cfg.model.lora.targets)


def lora_targets(cfg: JobConfig, bcfg: dict[str, Any]) -> list[str]:
    """The parallel linears (global names) `model.lora` adapts: its patterns (default `BAGEL_LORA_TARGETS`) over
    the model's linears. Raises ValueError naming a pattern that matches none, or a linear outside the
    generation expert (the understanding expert's pass runs without autograd: an adapter there would not train)."""
    from megatron_omni.models.patterns import matches_any, unmatched_targets
    from model_providers.bagel.provider import megatron_shapes

    patterns = lora_patterns(cfg)
    linears = [n.removesuffix(".weight") for n in megatron_shapes(bcfg)
               if n.endswith(".weight") and n.removesuffix(".weight").rsplit(".", 1)[-1].removesuffix("_gen")
               in _LINEARS]
    unmatched = unmatched_targets(patterns, linears)
    if unmatched:
        raise ValueError(f"model.lora.targets: {unmatched} match no parallel linear of BAGEL")
    chosen = [n for n in linears if matches_any(n, patterns)]
    outside = [n for n in chosen if not is_generation_tensor(n + ".weight")]
    if outside:
        raise ValueError(f"model.lora.targets: {outside[:4]} are not generation-expert linears (BAGEL's LoRA adapts "
                         "the generation expert only)")
    return chosen


def check_layout(cfg: JobConfig, world_size: int) -> None:
    """The settings against the trainer's world size: every data-parallel rank rolls out prompts of its own
    (`rollout.prompts_per_step` >= dp). Raises ValueError naming the setting."""
    p = cfg.parallel
    dp = world_size // (p.tp * p.ulysses * p.ring * p.pp)
    if cfg.rollout.prompts_per_step < dp:
        raise ValueError(f"rollout.prompts_per_step={cfg.rollout.prompts_per_step} must be >= the data-parallel "
                         f"size {dp} with model.family=bagel (every dp rank rolls out prompts of its own)")


def prompt_tokenizer(cfg: JobConfig, folder: Path | None, tokens: dict[str, int]) -> Any | None:
    """The tokenizer text prompts go through: the folder's (published layout: Qwen2's files), or for
    `model.pipeline=tiny` the tiny tokenizer its folder carries; None when every prompt is token ids (nothing is
    loaded) or, in a dry run, when the folder is not at hand. Raises ValueError naming a folder without one."""
    from model_providers.bagel.tokenizer import build_tiny_tokenizer, has_tokenizer, is_token_ids, load_tokenizer

    if all(is_token_ids(p) for p in [*cfg.prompts, *cfg.eval.prompts, *cfg.eval.transfer_prompts]):
        return None
    if folder is None:
        return build_tiny_tokenizer()
    if not folder.exists():
        return None
    if not has_tokenizer(folder):
        raise ValueError(f"prompts: text prompts need the BAGEL folder's tokenizer files (tokenizer.json, "
                         f"tokenizer_config.json); {folder} has none (or write token ids)")
    return load_tokenizer(folder, tokens)


def check_config(cfg: JobConfig, planning: bool = False) -> None:
    """The settings this trainer reads, against what it supports; raises ValueError naming the setting.
    `planning` (a dry run): a BAGEL folder that is not at hand is planned from `model.preset` (its prompts are
    then checked as far as they can be without its tokenizer)."""
    from megatron_omni.trainer.config_checks import check_algorithm, check_reward

    family = get_family(cfg.model.family)
    if cfg.model.preset not in family.presets:
        raise ValueError(f"model.preset={cfg.model.preset!r} must be {'|'.join(family.presets)} for "
                         f"model.family={family.name} (the model's sizes and its autoencoder come from it)")
    folder = None if cfg.model.pipeline == "tiny" else Path(cfg.model.pipeline)
    if folder is not None and (folder / "llm_config.json").exists():  # what the trainer will read
        from model_providers.bagel.provider import read_bagel_config

        bcfg = read_bagel_config(folder)
    else:
        bcfg = family.config(cfg.model.preset)
    p, r, a = cfg.parallel, cfg.rollout, cfg.algorithm
    stride = bcfg["bagel"]["vae_config"]["downsample"] * bcfg["bagel"]["latent_patch_size"]
    side = stride * bcfg["bagel"]["max_latent_size"]
    refused = [
        (p.ulysses * p.ring > 1 and p.pp > 1, "parallel.ulysses/ring", "context parallelism runs at pp 1 only "
         "(the pipeline schedule's hidden states are whole image queries, not cp shards)"),
        (p.pp > 1 and bcfg["llm_config"]["num_hidden_layers"] % p.pp, "parallel.pp",
         f"must divide BAGEL's {bcfg['llm_config']['num_hidden_layers']} layers"),
        (r.engine != "vllm_omni", "rollout.engine", "must be vllm_omni (vLLM-Omni's BAGEL pipeline)"),
        (r.tp not in (1, p.tp) or (r.tp > 1 and p.pp > 1), "rollout.tp", "must be 1 or parallel.tp at pp 1 (each "
         "tensor-parallel group of the trainer holds one rollout pipeline's shards: its ranks roll out the same "
         "samples)"),
        (r.vae_dtype != "auto", "rollout.vae_dtype", "must be auto (BAGEL's autoencoder runs in rollout.dtype)"),
        (r.guidance_scale_2 is not None, "rollout.guidance_scale_2", "must be unset (it guides Wan2.2 A14B's "
         "low-noise expert)"),
        (a.mixgrpo.flash_ratio is not None, "algorithm.mixgrpo.flash_ratio", "must be unset (vLLM-Omni's BAGEL "
         "steps its own schedule: no compressed ODE tail, MixGRPO-Flash)"),
        (a.is_cap not in (None, 0), "algorithm.is_cap", "must be unset"),
        (cfg.model.lora.enabled and cfg.optim.ema_decay > 0, "optim.ema_decay", "must be 0 with LoRA (the EMA "
         "is a copy of the whole model's weights)"),
        (cfg.model.lora.adaln, "model.lora.adaln", "must be false (BAGEL has no modulation linears)"),
        (cfg.model.bagel_experts == "both" and cfg.model.lora.enabled, "model.bagel_experts",
         "must be generation with LoRA (the adapters are on the generation expert's linears)"),
        (cfg.model.bagel_experts == "both" and p.pp > 1, "model.bagel_experts",
         "must be generation at pp > 1 (the pipelined schedule runs the prompt's pass without autograd)"),
        (cfg.model.lora.enabled and r.lora_sync not in ("auto", "merge"), "rollout.lora_sync",
         "must be auto or merge (vLLM-Omni's BAGEL modules take merged weights)"),
        (r.height % stride or r.width % stride or max(r.height, r.width) > side, "rollout.height/width",
         f"must be multiples of {stride} up to {side}"),
        (r.num_steps < 2, "rollout.num_steps", "must be >= 2"),
        (r.negative_prompt not in (None, ""), "rollout.negative_prompt", "must be unset (BAGEL's unconditional "
         "branch is the empty text cache)"),
        (cfg.model.pipeline != "tiny" and not planning
         and not (Path(cfg.model.pipeline) / "ema.safetensors").exists(), "model.pipeline",
         "must be tiny or a BAGEL folder (ema.safetensors, llm_config.json, ...)"),
    ]
    for bad, name, why in refused:
        if bad:
            raise ValueError(f"{name}: {why} with model.family={family.name}")
    from model_providers.bagel.tokenizer import encode_prompt, is_token_ids

    vocab = int(bcfg["llm_config"]["vocab_size"])
    tokenizer = prompt_tokenizer(cfg, folder, bcfg["tokens"])
    for prompt in [*cfg.prompts, *cfg.eval.prompts, *cfg.eval.transfer_prompts]:
        if tokenizer is not None or is_token_ids(prompt):
            encode_prompt(prompt, vocab, tokenizer)
    sampling(cfg, bcfg)  # the window against the steps
    check_algorithm(cfg)  # what each update rule combines with (the DiT families' checks)
    if cfg.model.lora.enabled:
        lora_targets(cfg, bcfg)
    check_reward(cfg)


def plan_inputs(cfg: JobConfig) -> tuple[dict[str, Any] | str, str, int]:
    """What a dry run plans with: the BAGEL config (the folder's configs when it is at hand, else `model.preset`),
    where it came from, and the longest prompt in tokens with bos / eos (64 for text prompts whose tokenizer is not
    at hand)."""
    from model_providers.bagel.provider import read_bagel_config
    from model_providers.bagel.tokenizer import encode_prompt, is_token_ids

    folder = None if cfg.model.pipeline == "tiny" else Path(cfg.model.pipeline)
    if folder is not None and (folder / "llm_config.json").exists():
        model, source = read_bagel_config(folder), str(folder)
    else:
        model = cfg.model.preset
        source = f"preset {model!r}" + (f" ({folder} not found here)" if folder is not None else "")
    bcfg = get_family(cfg.model.family).config(model)
    tokenizer = prompt_tokenizer(cfg, folder, bcfg["tokens"])
    vocab = int(bcfg["llm_config"]["vocab_size"])
    lengths = [len(encode_prompt(p, vocab, tokenizer)) + 2 if tokenizer is not None or is_token_ids(p)
               else 64 for p in cfg.prompts]
    return model, source, max(lengths)


def sampling(cfg: JobConfig, bcfg: dict[str, Any]) -> BagelSampling:
    """The rollout's sampler settings from `rollout.*` (BAGEL's schedule has num_steps + 1 points; its shift is
    the folder's `timestep_shift`; `guidance_scale` is BAGEL's text CFG scale, `image_guidance_scale` its image CFG
    scale)."""
    from megatron_omni.algorithms.window import check_window

    r = cfg.rollout
    s = BagelSampling(num_timesteps=r.num_steps + 1, timestep_shift=float(bcfg["bagel"]["timestep_shift"]),
                      noise_level=r.noise_level, window_size=r.window_size,
                      window_range=tuple(r.window_range) if r.window_range is not None else None,
                      sde_type=r.sde_type, cfg_text_scale=max(1.0, r.guidance_scale),
                      cfg_img_scale=max(1.0, r.image_guidance_scale), height=r.height, width=r.width)
    check_window(s.num_steps, s.window_size, s.window_bounds())
    return s


def velocity(model: Any, text_kv: Any, prompt_len: int, markers: torch.Tensor, latents: torch.Tensor,
             grid: tuple[int, int], t: float, cfg_scale: float, renorm_min: float,
             img_scale: float = 1.0) -> torch.Tensor:
    """The guided velocity [n, p] (fp32) of our `BagelMoT` (pp 1) for latents [n, p] at BAGEL's t on an h x w
    latent-token `grid`, conditioned on a prompt's text KV (`prompt_len` tokens; `markers` the start / end of
    image ids); text CFG when `cfg_scale` > 1 (the unconditional branch: no text KV, RoPE position 0), and there
    image CFG at `img_scale` (text-to-image: the image-free branch is the text-conditioned one, as vLLM-Omni's
    pipeline builds it, so no third forward)."""
    h, w = grid
    n = latents.shape[0]
    dtype = model.config.params_dtype
    pos = latent_position_ids(h, w, model.arch.max_latent_size)
    ts = torch.full((n,), float(t), dtype=dtype)
    x = latents.to(dtype)
    # Under context parallelism each rank computes its shard of the image's velocity and the all-gather joins them
    # (differentiable): every cp rank then holds the whole velocity and computes the same whole loss, whose
    # gradients Megatron's DDP averages over dp x cp, which gives cp 1's (docs/families-bagel.md).
    v = model.gather_velocity(model.stage_velocity(text_kv, prompt_len, markers, x, ts, pos), n).float()
    if cfg_scale > 1:
        v_u = model.gather_velocity(model.stage_velocity(None, 0, markers, x, ts, pos), n).float()
        v = text_cfg(v, v_u, cfg_scale, renorm_min, img_scale, v)
    return v


def window_transitions(model: Any, traj: BagelTrajectory, markers: torch.Tensor,
                       branches: Callable[[int, int, bool], torch.Tensor] | None = None, text_grad: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Window log-probs [N, W], transition means [N, W, p, c] and noise coefficients [N, W] of a rollout's
    trajectory under our `BagelMoT` (pp 1): per sample the prompt's text KV (without autograd unless `text_grad`:
    the understanding expert trains too, `model.bagel_experts=both`), then per window step the guided velocity of
    the recorded latents and `algorithms.sde`'s step (log-prob of the recorded next latents, the mean the KL term
    compares); differentiable where grad is on.
    `branches(i, j, text)`: the raw velocities [n, p] fp32 of sample i's window step j (text-conditioned, or the
    unconditional branch when `text` is False) computed elsewhere (pp > 1: `trainer.bagel_pipeline`); then
    `model` is not run and only the CFG combination and the SDE step happen here."""
    rows, means, stds = [], [], []
    for i in range(len(traj)):
        ids = traj.prompt_ids[i]
        if branches is None:
            with contextlib.nullcontext() if text_grad else torch.no_grad():
                _, kv, _ = model.stage_text(ids)
        steps, mean, std = [], [], []
        for j in range(traj.window_size):
            x, s, scale = traj.latents[i, j], float(traj.sigmas[i, j]), float(traj.cfg_scales[i, j])
            if branches is None:
                v = velocity(model, kv, ids.shape[0], markers, x, traj.grid, s, scale, traj.cfg_renorm_min,
                             traj.cfg_img_scale)
            else:
                v = branches(i, j, True)
                if scale > 1:  # as `velocity` combines them
                    v = text_cfg(v, branches(i, j, False), scale, traj.cfg_renorm_min, traj.cfg_img_scale, v)
            out = sde_step(x[None], v[None], s, float(traj.sigmas_next[i, j]), traj.noise_level, traj.sde_type,
                           sigma_after_one=float(traj.sigma_after_one[i]), next_latents=traj.next_latents[i, j][None])
            steps.append(out.log_prob[0])
            mean.append(out.coeffs.mean[0])
            std.append(out.coeffs.std[0])
        rows.append(torch.stack(steps))
        means.append(torch.stack(mean))
        stds.append(torch.stack(std))
    return torch.stack(rows), torch.stack(means), torch.stack(stds)


def window_log_probs(model: Any, traj: BagelTrajectory, markers: torch.Tensor) -> torch.Tensor:
    """Window log-probs [N, W] of a rollout's trajectory under our `BagelMoT` (`window_transitions`)."""
    return window_transitions(model, traj, markers)[0]


def window_kl(means: torch.Tensor, ref_means: torch.Tensor, stds: torch.Tensor) -> torch.Tensor:
    """[N, W] KL of each window transition against the reference's (`algorithms.loss.kl_penalty` per step)."""
    n, w = stds.shape
    return kl_penalty(means.flatten(0, 1), ref_means.flatten(0, 1), stds.flatten()).reshape(n, w)


def prepare_folder(cfg: JobConfig, run_dir: Path) -> Path:
    """The BAGEL folder to train: `model.pipeline`, or for "tiny" the preset's seeded tiny folder written into
    the run folder (rank 0, once)."""
    if cfg.model.pipeline != "tiny":
        return Path(cfg.model.pipeline)
    from model_providers.bagel.provider import write_bagel_folder

    path = run_dir / "bagel"
    if dist.get_rank() == 0 and not path.exists():
        write_bagel_folder(path, cfg.model.preset, seed=cfg.model.tiny_seed)
    dist.barrier()
    return path


def build_trainer(cfg: JobConfig, groups: Any, run_dir: Path) -> tuple[BagelTrainer, None]:
    """The family trainer entry point (`ModelFamily.trainer`): the trainer, which scores in process (None)."""
    return BagelTrainer(cfg, groups, run_dir), None


class BagelTrainer:
    """Model, optimizer, rollout pipeline and reward function of one rank."""

    sharded_state = staticmethod(bagel_sharded_state_dict)
    checkpoint_identity: dict = {}  # beyond the model config: `bagel_experts` when both train, LoRA's settings and base
    extra_copies: dict = {}

    def __init__(self, cfg: JobConfig, groups: Any, run_dir: str | Path) -> None:
        from model_providers.bagel.provider import read_bagel_folder

        self.cfg, self.groups = cfg, groups
        seed_everything(cfg.seed, tp_rank=groups.tp.rank())
        self.family = get_family(cfg.model.family)
        folder = prepare_folder(cfg, Path(run_dir))
        bcfg, state = read_bagel_folder(folder)
        bcfg["ae"] = self.family.config(cfg.model.preset)["ae"]  # the folder stores the autoencoder's weights only
        self.bcfg = bcfg
        self.sampling = sampling(cfg, bcfg)
        from model_providers.bagel.tokenizer import encode_prompt

        vocab = int(bcfg["llm_config"]["vocab_size"])
        tok = bcfg["tokens"]
        # Text prompts through the folder's tokenizer (the tiny folder carries a tiny one), BAGEL's
        # `[bos] + encode(text) + [eos]`; each kept with its text (what a text reward such as OCR compares with).
        self.tokenizer = prompt_tokenizer(cfg, folder, tok)
        self.prompt_ids = lambda p: [tok["bos_token_id"], *encode_prompt(p, vocab, self.tokenizer),
                                     tok["eos_token_id"]]
        self.prompts = [(p, self.prompt_ids(p)) for p in cfg.prompts]
        self.model = self.family.build_model(bcfg, groups, params_dtype=torch_dtype(cfg.model.params_dtype))
        self.family.load_state(self.model, state)
        self.experts = cfg.model.bagel_experts
        for name, p in self.model.named_parameters():
            p.requires_grad_(is_trained(name, self.experts))
        if self.experts == "both":  # a resume must train the same tensors (their optimizer state)
            self.checkpoint_identity = {"bagel_experts": self.experts}
        # The KL term's reference (the initial model, frozen) and the EMA of the weights (fp32, checkpointed under
        # `ema.`): each a whole copy of this rank's shards, built as the DiT trainer builds its copies (the RNG
        # streams left where they were, so a run with them samples what a run without them samples).
        # With LoRA (`model.lora.rank > 0`) the adapters on the generation expert's linears are all that trains
        # (`models.lora.add_lora`, seeded per linear), the reference is the base (the adapters off: no copy), the
        # checkpoints hold the adapters (`checkpoint.lora.lora_sharded_state_dict`) and the rollout receives the
        # merged weights `W + scale B A` through the same bridge plan (`bridge.lora_sync.MergedSources`).
        self.lora = cfg.model.lora
        if self.lora.enabled:
            from megatron_omni.checkpoint.bagel import bagel_base_identity
            from megatron_omni.checkpoint.lora import lora_sharded_state_dict
            from megatron_omni.models.lora import add_lora
            from megatron_omni.trainer.lora_setup import lora_identity

            # At pp > 1 a stage holds some of the layers: `lora_targets` checked the patterns on the whole model
            linears = lora_targets(cfg, bcfg)
            add_lora(self.model, linears, self.lora.rank, self.lora.alpha, self.lora.dropout,
                     seed=cfg.seed, global_name=self.model.global_name, require_match=groups.layout.pp == 1)
            self.sharded_state = lora_sharded_state_dict
            # a resume must find the same adapters on the same base weights (`ema.safetensors`' checksum)
            self.checkpoint_identity = {"lora": lora_identity(self.lora, linears, folder, identify=bagel_base_identity,
                                                              targets=lora_patterns(cfg))}
        dtype = torch_dtype(cfg.model.params_dtype)
        self.reference = (self._frozen_copy(bcfg, state, dtype) if cfg.algorithm.beta > 0 and not self.lora.enabled
                          else None)
        self.ema = self._frozen_copy(bcfg, state, torch.float32) if cfg.optim.ema_decay > 0 else None
        # DiffusionNFT's old (sampling) policy, when its decay schedule lets it lag the model within this run: a
        # frozen fp32 copy, checkpointed under `nft_old.`, that the rollout samples with (the DiT trainer's). Without
        # one (or while the schedule is 0) the old policy is the model as the step starts.
        self.nft_old = (self._frozen_copy(bcfg, state, torch.float32)
                        if old_policy_lags(cfg.algorithm, cfg.steps * cfg.optim.mini_batches) else None)
        self.extra_copies = {} if self.nft_old is None else {"nft_old": self.nft_old}
        self.markers = torch.tensor([tok["start_of_image"], tok["end_of_image"]])
        self._stack = contextlib.ExitStack()
        try:
            r = cfg.rollout
            if r.vllm_omni_process == "engine":
                # vLLM-Omni's own engine with worker processes; at rollout tp > 1 the trainer's tensor-parallel group
                # shares one (its ranks roll out the same samples), owned by the group's first rank
                from megatron_omni.rollout.vllm_omni.bagel_served import ServedBagelPipeline

                self.pipeline = ServedBagelPipeline(folder, bcfg, torch_dtype(r.dtype), tp=r.tp,
                                                    group=groups.tp if r.tp > 1 else None)
                self._stack.callback(self.pipeline.close)
            else:
                self.pipeline = self._stack.enter_context(open_bagel_pipeline(bcfg, folder, torch_dtype(r.dtype),
                                                                              tp=r.tp))
            # The held-out evaluation's view of the pipeline (`trainer.run.run_evaluation`, the DiT families' path)
            self.engine = BagelEvalEngine(self)
            self.quantization = QuantizationSpec()
            # The bridge into the rollout pipeline: the family's plan at the rollout's tp (full tensors gathered over
            # the trainer's tp, bucketed; at rollout tp > 1 vLLM's loaders keep each rank's shard), every BAGEL
            # tensor checked written once by the coverage ledger.
            # pp > 1: every rank's pipeline gets every stage's tensors from the stage's first rank (as the DiT trainer).
            pp = groups.layout.pp
            (part, plan), = family_plans(self.family, bcfg, trainer_tp=groups.tp.size(), trainer_pp=pp,
                                         rollout_kind="vllm_omni", rollout_tp=cfg.rollout.tp, mode="full").items()
            transport = None
            if pp > 1:
                first = groups.first_rank
                transport = DistributedTransport(sources=groups.layout.stage_roots(first),
                                                 rollout_ranks=range(first, first + groups.layout.world_size),
                                                 dtype=self.model.config.params_dtype)
            sources = self.family.megatron_sources(self.model)[part]
            if self.lora.enabled:
                from megatron_omni.bridge.lora_sync import MergedSources, merged_linears

                sources = MergedSources(sources, merged_linears(self.model, self.model.global_name))
            self.sources = sources
            self.weight_sync = WeightSync(plan, sources=sources,
                                          target=self.pipeline.weight_target(), tp_group=groups.tp,
                                          tp_rank=groups.tp.rank(), stage=groups.coords["pp"], transport=transport)
            o = cfg.optim
            self.ddp, self.optimizer = build_ddp_and_optimizer(
                self.model, self.model.config, groups.mcore,
                OptimizerSettings(lr=o.lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                                  adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad))
            self.scheduler = build_scheduler(self.optimizer, o.lr, o.weight_decay, o.warmup_steps,
                                             cfg.steps * o.mini_batches)
            self.guard = GradGuard(o.max_bad_steps)
            self.reward_fn = RewardFunction(cfg.reward.scorer, cfg.reward.url, cfg.reward.timeout_s, None,
                                            cfg.reward.options)
        except BaseException:
            self._stack.close()  # a served engine started above goes with the failure, not at the process's exit
            raise

    # ----------------------------------------------------------------------------------- checkpoints
    def content_metadata(self, step: int) -> dict[str, Any]:
        """What a checkpoint records about the model: the BAGEL config (the same after every step)."""
        return {CONTENT_KEY: {"format_version": 1, "config": {k: self.bcfg[k] for k in
                                                              ("llm_config", "bagel", "tokens")}}}

    def sync_weights(self) -> float:
        """Load the trained weights into the rollout's vLLM-Omni modules through the bridge (buckets of full
        tensors gathered over tp; a tensor the rollout refuses or leaves unloaded raises naming it); returns the
        seconds. Collective over tp."""
        with self.pipeline.weight_update():
            seconds = self.weight_sync.sync().seconds
        if self.lora.enabled:
            self.sources.forget()  # the next sync merges the updated adapters
        return seconds

    def sampling_params(self) -> SamplingParams:
        """The rollout's sampler as the evaluation path reads it (`rollout.*`; `BagelEvalEngine` maps it back). Its
        negative prompt is " " (the shared record asks for one under CFG; BAGEL's engine does not read it)."""
        return SamplingParams.from_config(self.cfg.rollout, negative_prompt=" ")

    def evaluation_weights(self) -> contextlib.AbstractContextManager:
        """Collective over tp: inside, the model and the rollout pipeline hold the EMA weights; on exit the
        trained weights again, bit for bit. Without an EMA nothing changes."""
        from megatron_omni.trainer.flowgrpo import holding_weights

        return holding_weights(self.model, self.ema, self.sync_weights, sync_in=True, sync_out=True)

    def _frozen_copy(self, bcfg: dict[str, Any], state: dict[str, torch.Tensor], dtype: torch.dtype) -> Any:
        """A frozen `BagelMoT` of this rank's layout holding `state` in `dtype`; building it leaves the torch and
        Megatron RNG streams where they were."""
        from megatron.core import tensor_parallel

        tracker = tensor_parallel.get_cuda_rng_tracker()
        states = tracker.get_states()
        with torch.random.fork_rng():
            copy = self.family.build_model(bcfg, self.groups, params_dtype=dtype)
        tracker.set_states(states)
        self.family.load_state(copy, state)
        return copy.requires_grad_(False).eval()

    @contextlib.contextmanager
    def _reference(self):
        """The KL term's reference model: the frozen initial copy, or with LoRA the model with its adapters off."""
        if self.reference is not None:
            yield self.reference
            return
        from megatron_omni.models.lora import adapters_disabled

        with adapters_disabled(self.model):
            yield self.model

    def update_ema(self) -> None:
        """ema <- decay * ema + (1 - decay) * weights, for this rank's shards (after an optimizer step; nothing
        without `optim.ema_decay`)."""
        if self.ema is None:
            return
        weight = 1.0 - self.cfg.optim.ema_decay
        for e, p in zip(self.ema.parameters(), self.model.parameters(), strict=True):
            e.lerp_(p.detach().to(e.dtype), weight)

    def lagging_old_policy(self) -> torch.nn.Module | None:
        """DiffusionNFT's old-policy copy when it differs from the model now (the schedule's decay at the optimizer
        updates done is > 0); None: the old policy is the model itself."""
        return lagging_old_policy(self.nft_old, self.cfg.algorithm, self.scheduler.num_steps)

    def update_old_policy(self) -> float:
        """After a step's updates: old <- decay old + (1 - decay) model, decay from the schedule at the optimizer
        updates done (`trainer.objectives.blend_old_policy`). Returns the decay."""
        return blend_old_policy(self.nft_old, self.model, self.cfg.algorithm, self.scheduler.num_steps)

    def close(self) -> None:
        """Leave vLLM-Omni's parallel state (the rollout pipeline's)."""
        self._stack.close()

    # ------------------------------------------------------------------------------------------ a step
    def train_step(self, step: int) -> StepResult:
        """One RL step: rollout, rewards, advantages, old log-probs (DiffusionNFT: the old policy's velocities at
        the step's noised points), mini-batch updates, weight sync."""
        from megatron_omni.trainer.flowgrpo import holding_weights, logp_gap

        c, r, g = self.cfg, self.cfg.rollout, self.groups
        t: dict[str, float] = {}
        prompts, gids, seeds = step_prompts(self.prompts, c.seed, step, r.prompts_per_step, r.group_size,
                                            g.dp.rank(), g.dp.size())
        ids = [torch.tensor(prompts[k // r.group_size][1]) for k in range(len(seeds))]
        texts = [prompts[k // r.group_size][0] for k in range(len(seeds))]
        group_ids = [gids[k // r.group_size] for k in range(len(seeds))]
        sampling = step_sampling(c.algorithm, self.sampling, step)
        # DiffusionNFT with a lagging old policy samples with it (the update's sync brings the trained weights back)
        old_policy = self.lagging_old_policy()
        t0 = time.perf_counter()
        with holding_weights(self.model, old_policy, self.sync_weights, sync_in=True, sync_out=False):
            traj = self.pipeline.generate(ids, sampling, seeds, group_ids)
        t["rollout"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.reward_fn.begin(len(traj))
        for k in range(len(traj)):
            self.reward_fn.on_sample(FinishedSample(k, texts[k], group_ids[k], seeds[k], traj.images[k]))
        rewards = self.reward_fn.collect().float()
        t["reward"] = time.perf_counter() - t0
        self.pipeline.sleep()  # a served engine's memory is the update's until the sync
        all_r, all_g, offset = gather_rewards(g.dp, rewards, traj.group_ids)
        adv = group_advantages(all_r, all_g, std_mode=c.algorithm.std_mode, clip=c.algorithm.adv_clip)
        advantages = adv.advantages[offset: offset + len(traj)]
        t0 = time.perf_counter()
        forwards: list[bagel_pipeline.Forward] = []  # pp > 1: the recompute's forward, reused by the first update
        # the rollout's log-probs (bypass) or the recompute's; GRPO-Guard also takes the recompute's transition means
        # (its ratio normalisation's drift term), under bypass too
        old, old_means, nft = traj.log_probs, None, None
        if c.algorithm.name == "diffusionnft":
            nft = self._nft_step(traj, sampling, advantages, old_policy)
        elif c.algorithm.old_logprob == "recompute" or c.algorithm.name == "grpo_guard":
            if g.layout.pp > 1:  # the means on the last stage (the loss is computed there), None before it
                recomputed, old_means = bagel_pipeline.window_log_probs(self.model, g, traj, self.markers, forwards,
                                                                        with_means=True)
            else:
                with torch.no_grad():
                    recomputed, old_means, _ = window_transitions(self.model, traj, self.markers)
            if c.algorithm.old_logprob == "recompute":
                old = recomputed
        t["old_logprob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        metrics = self._update(traj, old, advantages, step, forwards[0] if forwards else None,
                               old_means if c.algorithm.name == "grpo_guard" else None, nft)
        t["train"] = time.perf_counter() - t0
        if self.nft_old is not None:
            metrics["old_policy_decay"] = self.update_old_policy()
        self.pipeline.wake_up()
        t["sync"] = self.sync_weights()
        gap_mean = float("nan")  # an ODE rollout (DiffusionNFT) records no log-probs
        if nft is None:
            gap_mean, metrics["train_rollout_dlogp_max"] = logp_gap(old, traj.log_probs, step, g.dp,
                                                                   c.algorithm.max_logp_gap)
        if sampling.window_start is not None:
            metrics["window_start"] = float(sampling.window_start)
        metrics.update(step_metrics(all_r, adv.zero_std_ratio, gap_mean, t, g.layout.world_size))
        return StepResult(metrics, traj, rewards, traj.images, texts)

    def _nft_step(self, traj: BagelTrajectory, sampling: BagelSampling, advantages: torch.Tensor,
                  old_policy: torch.nn.Module | None) -> BagelNftStep:
        """DiffusionNFT's data of the step: each sample's `int(T timestep_fraction)` noised points, the old policy's
        velocities there (the model as the step starts, or the lagging copy's weights) and, with `algorithm.beta >
        0`, the reference's (at pp > 1 through the pipeline, on the last stage)."""
        from megatron_omni.trainer.flowgrpo import holding_weights

        a, g = self.cfg.algorithm, self.groups
        points = nft_points(traj, sampling, max(1, int(sampling.num_steps * a.nft.timestep_fraction)))
        rows = list(range(len(traj)))
        _, xt = noised_points(traj, points, rows)
        if g.layout.pp > 1:
            inputs = nft_point_inputs(points, xt, sampling, rows)

            def velocities(model: Any) -> torch.Tensor | None:
                return bagel_pipeline.nft_velocities(model, g, traj, self.markers, inputs)
        else:
            def velocities(model: Any) -> torch.Tensor | None:
                return nft_velocities(model, traj, points, xt, self.markers, sampling, rows)
        with torch.no_grad():
            with holding_weights(self.model, old_policy, self.sync_weights, sync_in=False, sync_out=False):
                old_v = velocities(self.model)
            ref_v = None
            if a.beta > 0:
                with self._reference() as ref:
                    ref_v = velocities(ref)
        return BagelNftStep(points, sampling, old_v, nft_reward_weight(a, advantages), a, ref_v)

    def _update(self, traj: BagelTrajectory, old: torch.Tensor, adv: torch.Tensor, step: int,
                forward: bagel_pipeline.Forward | None = None, old_means: torch.Tensor | None = None,
                nft: BagelNftStep | None = None) -> dict[str, float]:
        """The step's mini-batch updates; `forward` (pp > 1): the old log-probs' forward at the weights the first
        mini-batch starts from; `old_means` [N, W, p, c]: GRPO-Guard's (None: FlowGRPO's clipped surrogate);
        `nft`: DiffusionNFT's loss over the noised points instead."""
        c = self.cfg
        sums: dict[str, float] = {}
        tally = UpdateTally()
        chunks = mini_batch_rows(len(traj), c.seed, step, c.optim.mini_batches)
        beta = c.algorithm.beta
        for n, rows in enumerate(chunks):
            # only the first mini-batch runs at the weights of the old log-probs' forward
            reuse = forward.rows(rows.tolist()) if forward is not None and n == 0 else None

            def backward(rows: torch.Tensor = rows, reuse: bagel_pipeline.Forward | None = reuse) -> dict[str, Any]:
                if nft is not None and self.groups.layout.pp > 1:
                    return bagel_pipeline.nft_backward(self.model, self.groups, traj.select(rows), self.markers,
                                                       nft.point_inputs(traj, rows),
                                                       lambda vel, rows=rows: nft.loss_of(vel, traj, rows))
                if nft is not None:
                    out = nft.loss(self.model, traj, self.markers, rows, text_grad=self.experts == "both")
                    out.loss.backward()
                    return out.metrics
                part = traj.select(rows)
                if self.groups.layout.pp > 1:
                    return bagel_pipeline.policy_backward(self.model, self.groups, part, self.markers, old[rows],
                                                          adv[rows], c.algorithm.clip_range, beta, self._reference,
                                                          reuse, None if old_means is None else old_means[rows])
                new, means, stds = window_transitions(self.model, part, self.markers,
                                                      text_grad=self.experts == "both")
                kl = None
                if beta > 0:
                    with torch.no_grad(), self._reference() as ref:
                        ref_means = window_transitions(ref, part, self.markers)[1]
                    kl = window_kl(means, ref_means, stds)
                loss = window_policy_loss(new, means, stds, part, old[rows], adv[rows], c.algorithm.clip_range, beta,
                                          kl, None if old_means is None else old_means[rows])
                loss.loss.backward()
                return loss.metrics

            res, metrics = update(self.ddp, self.optimizer, self.scheduler, self.guard, self.groups.mcore, backward)
            tally.add(res)
            if res.stepped and res.ok:
                self.update_ema()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) / len(chunks)
        return {**sums, **tally.metrics(self.optimizer)}


class BagelEvalEngine:
    """The rollout pipeline as the held-out evaluation calls an engine (`trainer.evaluation.evaluate`: text
    prompts, `SamplingParams`, seeds, a per-sample callback). The params become BAGEL's sampler: `num_steps + 1`
    schedule points with the folder's shift, `guidance_scale` as the text CFG scale, the run's image CFG scale and
    CFG interval, noise 0 for the ODE (Euler over the whole schedule, nothing recorded). `negative_prompt` is not
    read: BAGEL's text-unconditional branch is the empty text cache (what vLLM-Omni's pipeline keeps for an empty
    negative prompt), so the " " the evaluation passes under CFG changes nothing.
    At rollout tp 1 every rank holds a whole pipeline and rank 0 samples alone (`collective` False); at rollout
    tp > 1 the ranks of a tensor-parallel group hold one pipeline's shards, so each call is collective over the
    job: every rank passes its own share (rank 0 the prompts, the others none), each group samples the union of its
    ranks' shares with the params they passed and each rank gets its own rows back."""

    def __init__(self, trainer: BagelTrainer) -> None:
        self.trainer = trainer
        self.collective = trainer.cfg.rollout.tp > 1

    def generate(self, prompts: list[str], params: SamplingParams, group_size: int = 1,
                 seeds: list[int] | None = None, on_sample: Any = None) -> BagelTrajectory | None:
        """One image per (prompt, seed) (`group_size` 1); images [N, 3, H, W] in the returned trajectory, each
        also passed to `on_sample` as a `FinishedSample`. None when this rank's group has nothing to sample."""
        import dataclasses

        seeds = [] if seeds is None and not prompts else seeds
        if group_size != 1 or seeds is None or len(seeds) != len(prompts):
            raise ValueError(f"BAGEL evaluation samples one image per (prompt, seed): group_size {group_size}, "
                             f"{len(prompts)} prompts, seeds {seeds}")
        t = self.trainer
        mine = len(prompts)
        if self.collective:  # the group's union in rank order, sampled with the params of the ranks that have some
            shares: list[Any] = [None] * t.groups.tp.size()
            dist.all_gather_object(shares, (list(prompts), [int(s) for s in seeds], params), group=t.groups.tp)
            offset = sum(len(p) for p, _, _ in shares[: t.groups.tp.rank()])
            prompts, seeds = [p for ps, _, _ in shares for p in ps], [s for _, ss, _ in shares for s in ss]
            given = [q for ps, _, q in shares if ps]
            if any(q != given[0] for q in given):
                raise ValueError("BAGEL evaluation at rollout tp > 1: the ranks of a group asked for different "
                                 "sampling params")
            params = given[0] if given else params
        else:
            offset = 0
        if not prompts:
            return None
        ode = params.noise_level == 0  # then no window: any placement is all Euler steps
        s = dataclasses.replace(t.sampling, num_timesteps=params.num_steps + 1, noise_level=params.noise_level,
                                window_size=1 if ode else params.window_size,
                                window_range=None if ode else params.window_range,
                                sde_type=params.sde_type, cfg_text_scale=max(1.0, params.guidance_scale),
                                height=params.height, width=params.width)
        ids = [torch.tensor(t.prompt_ids(p)) for p in prompts]
        traj = t.pipeline.generate(ids, s, seeds, list(range(len(prompts))))
        if mine == 0:
            return None
        traj = traj.select(torch.arange(offset, offset + mine))
        for k in range(len(traj)):
            if on_sample is not None:
                on_sample(FinishedSample(k, prompts[offset + k], k, int(seeds[offset + k]), traj.images[k]))
        return traj
