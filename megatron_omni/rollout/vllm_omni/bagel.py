"""Our FlowGRPO SDE pipeline over vLLM-Omni 0.30's BAGEL pipeline: text-to-image rollouts with recorded trajectories.

`FlowGRPOBagelPipeline` subclasses vLLM-Omni's `BagelPipeline` and keeps its components and their code paths:
its MoT language model (`Qwen2MoTForCausalLM`, loaded by its own `load_weights`: the `_moe_gen` renames, fused
q/k/v and gate/up), its `Bagel` module (`prepare_prompts`-style text KV through `forward_cache_update_text`,
`prepare_vae_latent(_cfg)`, `generate_image` with its sequential text CFG and `_combine_cfg` renorm), its FLUX
autoencoder and `_decode_image_from_latent`. What is ours is the step: `generate_image`'s `scheduler` hook gets
`_SdeWindow`, which runs the FlowGRPO SDE step (`algorithms.sde`) on the window's steps of BAGEL's shifted flow
schedule (t from 1 to 0, `x <- x - v dt`: BAGEL's t is our sigma, its velocity our `eps - x0`) and the plain
Euler step elsewhere, drawing noise from the sample's own generator and recording the window's latents and
log-probs.

Differences from the stock pipeline, each deliberate:
- construction from an offline BAGEL folder and its config dict (`from_folder`): the stock `__init__` loads a
  tokenizer and SigLIP image processor from the folder (the tiny folder has none: its prompts are token ids) and
  the default FLUX autoencoder size (the tiny preset's is smaller); the ViT is not built (text-to-image does not
  use it);
- prompts are token ids `[bos, text..., eos]` (BAGEL's `prepare_prompts` wraps the tokenizer's ids so);
- initial noise from the sample's seed (the stock path draws from the global RNG);
- text and image CFG as BAGEL's pipeline applies them (the text-unconditional branch an empty KV cache at RoPE
  position 0, the `global` renorm, `cfg_interval`; a text-to-image request's image-free branch is the
  text-conditioned context, as vLLM-Omni's pipeline builds its `cfg_img` context, see docs/families-bagel.md);
- dtype: vLLM-Omni's BAGEL hard-casts attention inputs and MLP outputs to bfloat16 (it runs under bf16 autocast
  on GPUs). `dtype=float32` runs the same code with those casts read as float32 (`fp32_bagel`), so an fp32
  rollout is an fp32 computation the trainer's fp32 recompute reproduces; bf16 runs it as shipped under a CPU
  bf16 autocast.

Call inside `inline.vllm_omni_parallel(1)` (vLLM-Omni's parallel state and forward context), or use
`open_bagel_pipeline`, which holds that context for the pipeline's lifetime.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from megatron_omni.algorithms.sde import sde_step
from megatron_omni.algorithms.window import sample_window_start, window_noise_levels

# The generation-side tensors `Bagel` holds beside the language model (ema.safetensors names).
BAGEL_GEN_TENSORS = ("time_embedder.mlp.0.weight", "time_embedder.mlp.0.bias", "time_embedder.mlp.2.weight",
                     "time_embedder.mlp.2.bias", "vae2llm.weight", "vae2llm.bias", "llm2vae.weight", "llm2vae.bias",
                     "latent_pos_embed.pos_embed")
LLM_PREFIX = "language_model."


@dataclasses.dataclass(frozen=True)
class BagelSampling:
    """One rollout call's sampler settings.

    num_timesteps: BAGEL's schedule points (num_timesteps - 1 denoising steps, as BAGEL drops t = 0);
    timestep_shift: BAGEL's shift of the linear schedule (3.0 for t2i); noise_level, window_size, window_range
    ([lo, hi) of the window's first step; None: [0, max(window, steps // 2))), sde_type: the FlowGRPO window;
    window_start: every sample's window begins at this step (MixGRPO's window of the RL step); None: each sample
    draws its own from `window_range` with its generator;
    cfg_text_scale, cfg_interval (t in (lo, hi] gets CFG), cfg_renorm_min: BAGEL's text CFG (scale 1: none);
    cfg_img_scale: BAGEL's image CFG (applied only where text CFG is: `Bagel.generate_image`; the image-free
    branch of a text-to-image request is the text-conditioned context, as vLLM-Omni's pipeline builds it);
    height, width: pixels (multiples of the latent stride, 16)."""

    num_timesteps: int = 6
    timestep_shift: float = 3.0
    noise_level: float = 0.7
    window_size: int = 2
    window_range: tuple[int, int] | None = None
    window_start: int | None = None
    sde_type: str = "sde"
    cfg_text_scale: float = 1.0
    cfg_img_scale: float = 1.0
    cfg_interval: tuple[float, float] = (0.4, 1.0)
    cfg_renorm_min: float = 0.0
    height: int = 64
    width: int = 64

    @property
    def num_steps(self) -> int:
        return self.num_timesteps - 1

    def window_bounds(self) -> tuple[int, int]:
        if self.window_range is not None:
            return tuple(self.window_range)
        return 0, max(self.window_size, self.num_steps // 2)


def flow_schedule(num_timesteps: int, shift: float) -> torch.Tensor:
    """BAGEL's schedule [num_timesteps]: linspace(1, 0) shifted `shift t / (1 + (shift - 1) t)` (its
    `prepare_denoise_schedule`); step i goes from entry i to entry i + 1."""
    s = torch.linspace(1, 0, num_timesteps)
    return shift * s / (1 + (shift - 1) * s)


@dataclasses.dataclass
class BagelTrajectory:
    """A rollout's record, everything the trainer's recompute needs. N samples, W window steps, n latent tokens
    of width p; every sample of a call has the same image size.

    prompt_ids: N token-id tensors [L_i] (`[bos, text..., eos]`: the text conditioning, the recompute rebuilds
    its KV cache); latents / next_latents [N, W, n, p] fp32 (x before and after each window step);
    sigmas / sigmas_next [N, W] (BAGEL's t before and after); cfg_scales [N, W] (the text CFG scale each step
    used, 1: none); log_probs [N, W] fp32; noise_level, sde_type, cfg_renorm_min, cfg_img_scale (applied where the
    text scale is > 1): the call's; sigma_after_one
    [N] (the schedule's second entry: the `sde` step at t = 1 needs it); grid (h, w) latent tokens; images
    [N, 3, H, W] in [0, 1]; group_ids [N]; seeds [N]; final_latents [N, n, p] fp32 (the clean latents the images
    decode from: DiffusionNFT's training points noise them)."""

    prompt_ids: list[torch.Tensor]
    latents: torch.Tensor
    next_latents: torch.Tensor
    sigmas: torch.Tensor
    sigmas_next: torch.Tensor
    cfg_scales: torch.Tensor
    log_probs: torch.Tensor
    sigma_after_one: torch.Tensor
    noise_level: float
    sde_type: str
    cfg_renorm_min: float
    cfg_img_scale: float
    grid: tuple[int, int]
    images: torch.Tensor
    group_ids: torch.Tensor
    seeds: list[int]
    final_latents: torch.Tensor

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def window_size(self) -> int:
        return self.log_probs.shape[1]

    def select(self, rows: torch.Tensor) -> BagelTrajectory:
        """The samples `rows` (a 1-D long tensor)."""
        idx = rows.tolist()
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor) and v.ndim >= 1:
                out[f.name] = v[rows]
            elif isinstance(v, list):
                out[f.name] = [v[i] for i in idx]
            else:
                out[f.name] = v
        return BagelTrajectory(**out)


class _SdeWindow:
    """`Bagel.generate_image`'s `scheduler`: step i of the call (vLLM-Omni passes v, t, x, dt per step) is the
    SDE step inside the window, the Euler step outside, both by `algorithms.sde.sde_step`; records the window."""

    def __init__(self, levels: torch.Tensor, sigma_after_one: float, sde_type: str, generator: torch.Generator,
                 cfg_scale: Any) -> None:
        self.levels, self.s1, self.sde_type, self.gen = levels, sigma_after_one, sde_type, generator
        self.cfg_scale = cfg_scale
        self.i = 0
        self.record: list[tuple[torch.Tensor, torch.Tensor, float, float, float, torch.Tensor]] = []

    def step(self, v: torch.Tensor, t: torch.Tensor, x: torch.Tensor, dt: torch.Tensor) -> SimpleNamespace:
        s, ds = float(t), float(dt)
        level = float(self.levels[self.i])
        x32, v32 = x.float()[None], v.float()[None]  # [1, n, p]: one sample
        if level > 0:
            noise = torch.randn(x32.shape[1:], generator=self.gen)[None]
            out = sde_step(x32, v32, s, s - ds, level, self.sde_type, sigma_after_one=self.s1, noise=noise)
            self.record.append((x32[0], out.next_latents[0], s, s - ds, self.cfg_scale(s), out.log_prob[0]))
            log_prob = out.log_prob
        else:
            out = sde_step(x32, v32, s, s - ds, 0.0, self.sde_type, sigma_after_one=self.s1, compute_log_prob=False)
            log_prob = None
        self.i += 1
        return SimpleNamespace(prev_sample=out.next_latents[0].to(x.dtype), log_prob=log_prob)


class _TorchBf16AsFp32:
    """vLLM-Omni's bagel module's `torch`, with `bfloat16` reading as float32 (the fp32 rollout)."""

    bfloat16 = torch.float32

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@contextlib.contextmanager
def fp32_bagel() -> Iterator[None]:
    """vLLM-Omni's BAGEL transformer code with its hard bf16 casts read as float32 (module-level swap, restored)."""
    from vllm_omni.diffusion.models.bagel import bagel_transformer as bt

    saved = bt.torch
    bt.torch = _TorchBf16AsFp32()
    try:
        yield
    finally:
        bt.torch = saved


@functools.cache
def _pipeline_class() -> type:
    from vllm_omni.diffusion.models.bagel import bagel_transformer as bt
    from vllm_omni.diffusion.models.bagel.autoencoder import AutoEncoder, AutoEncoderParams
    from vllm_omni.diffusion.models.bagel.pipeline_bagel import BagelPipeline

    class FlowGRPOBagelPipeline(BagelPipeline):
        """vLLM-Omni's BAGEL pipeline with our SDE window (see the module docstring)."""

        def __init__(self, cfg: dict[str, Any], dtype: torch.dtype = torch.float32) -> None:
            """`cfg`: a BAGEL config dict (`model_providers.bagel.provider.bagel_config`, with `ae`). Weights are
            uninitialised until `load_folder` / `load_weights`."""
            torch.nn.Module.__init__(self)
            from vllm.transformers_utils.configs.bagel import BagelConfig

            if dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"BAGEL rollout dtype must be float32 or bfloat16, got {dtype}")
            self.cfg, self.dtype = cfg, dtype
            llm, b = dict(cfg["llm_config"]), cfg["bagel"]
            llm.update(qk_norm=True, tie_word_embeddings=False, layer_module="Qwen2MoTDecoderLayer")
            old = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                lm_cfg = bt.Qwen2MoTConfig(**{k: v for k, v in llm.items() if k not in ("architectures", "model_type")})
                self.language_model = bt.Qwen2MoTForCausalLM(lm_cfg).eval()
                self.transformer = self.language_model.model
                self.bagel = bt.Bagel(self.language_model, None, BagelConfig(
                    llm_config=lm_cfg, visual_und=False, vae_config=SimpleNamespace(**b["vae_config"]),
                    latent_patch_size=b["latent_patch_size"], max_latent_size=b["max_latent_size"],
                    timestep_shift=b["timestep_shift"])).eval()
            finally:
                torch.set_default_dtype(old)
            self.vae = AutoEncoder(AutoEncoderParams(**cfg["ae"])).eval()
            # this rank's place in vLLM-Omni's tensor-parallel group (built by `open_bagel_pipeline`)
            from vllm.distributed import get_tp_group

            self.tp_rank, self.tp_size = get_tp_group().rank_in_group, get_tp_group().world_size
            self.new_token_ids = dict(cfg["tokens"])
            self.scheduler = None
            self.scheduler_kwargs = {}
            self.device = torch.device("cpu")

        # ------------------------------------------------------------------------------------ weights
        def expected_names(self) -> set[str]:
            """The ema.safetensors names this pipeline holds (language model and generation side)."""
            from model_providers.bagel.provider import bagel_shapes

            return set(bagel_shapes(self.cfg))

        @torch.no_grad()
        def load_weights(self, state: dict[str, torch.Tensor]) -> set[str]:
            """Load BAGEL-named full tensors (ema.safetensors names; the ViT side, if present, is ignored): the
            language model through vLLM-Omni's `load_weights`, the generation side copied. Coverage checked: a
            tensor of another name or shape, or a parameter left unwritten, raises ValueError naming it. Returns
            the names loaded."""
            from megatron_omni.rollout.vllm_omni.inline import finish_loading

            expected = self.expected_names()
            frozen = ("vit_model.", "connector.", "vit_pos_embed.")
            unknown = sorted(k for k in state if k not in expected and not k.startswith(frozen))
            missing = sorted(expected - set(state))
            if unknown or missing:
                raise ValueError(f"BAGEL weight update: unknown tensors {unknown[:8]}, missing {missing[:8]}")
            from model_providers.bagel.provider import bagel_shapes

            shapes = bagel_shapes(self.cfg)
            wrong = sorted(k for k in expected if tuple(state[k].shape) != tuple(shapes[k]))
            if wrong:
                raise ValueError(f"BAGEL weight update: wrong shapes {[(k, tuple(state[k].shape)) for k in wrong[:8]]}")
            params = dict(self.bagel.named_parameters())
            lm_items = [(k[len(LLM_PREFIX):], v.to(self.dtype)) for k, v in state.items() if k.startswith(LLM_PREFIX)]
            loaded = self.language_model.load_weights(iter(lm_items))
            unloaded = sorted({n for n, _ in self.language_model.named_parameters()} - set(loaded))
            if unloaded:
                raise ValueError(f"BAGEL weight update left rollout parameters unwritten: {unloaded[:8]}")
            for k in BAGEL_GEN_TENSORS:
                params[k].copy_(state[k])
            finish_loading(self.bagel)
            return set(expected)

        @torch.no_grad()
        def load_partial(self, items: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
            """Load some BAGEL-named full tensors (one bridge bucket): each language-model tensor through vLLM-Omni's
            `load_weights` (alone, so what it loaded is known per name), each generation-side tensor copied. A name
            this pipeline does not hold or a wrong shape raises ValueError naming it. Returns the names loaded (the
            bridge's coverage ledger names any it did not)."""
            from megatron_omni.rollout.vllm_omni.inline import finish_loading
            from model_providers.bagel.provider import bagel_shapes

            shapes = bagel_shapes(self.cfg)
            params = dict(self.bagel.named_parameters())
            loaded = set()
            for name, t in items:
                if name not in shapes:
                    raise ValueError(f"BAGEL weight update: unknown tensor {name!r}")
                if tuple(t.shape) != tuple(shapes[name]):
                    raise ValueError(f"BAGEL weight update: {name} has shape {tuple(t.shape)}, expected "
                                     f"{tuple(shapes[name])}")
                if name.startswith(LLM_PREFIX):
                    if self.language_model.load_weights([(name[len(LLM_PREFIX):], t.to(self.dtype))]):
                        loaded.add(name)
                elif name in BAGEL_GEN_TENSORS:
                    params[name].copy_(t)
                    loaded.add(name)
            finish_loading(self.bagel)
            return loaded

        def weight_target(self) -> BagelWeightTarget:
            """The bridge's rollout target for this pipeline (full tensors at any rollout tp)."""
            return BagelWeightTarget(self)

        def weight_update(self) -> contextlib.AbstractContextManager:
            """Around a sync: nothing to open or close in process (the served client's brackets the workers')."""
            return contextlib.nullcontext()

        def sleep(self) -> None:
            """Nothing: in process, the rollout's weights are the trainer rank's own memory."""

        def wake_up(self) -> None:
            """Nothing (see `sleep`)."""

        def load_folder(self, folder: str | Path) -> None:
            """Load a BAGEL folder's `ema.safetensors` and `ae.safetensors`."""
            from safetensors.torch import load_file

            folder = Path(folder)
            self.load_weights(load_file(str(folder / "ema.safetensors")))
            self.vae.load_state_dict(load_file(str(folder / "ae.safetensors")))

        # ------------------------------------------------------------------------------------ rollout
        def _text_cache(self, ids: torch.Tensor) -> tuple[Any, int]:
            cache = bt.NaiveCache(self.cfg["llm_config"]["num_hidden_layers"])
            n = ids.shape[0]
            cache = self.bagel.forward_cache_update_text(cache, ids, torch.arange(n), torch.tensor([n]))
            return cache, n

        @torch.no_grad()
        def generate(self, prompt_ids: Sequence[torch.Tensor], sampling: BagelSampling, seeds: Sequence[int],
                     group_ids: Sequence[int] | None = None) -> BagelTrajectory:
            """One sample per (prompt ids [L], seed): BAGEL's generation with our SDE window. Returns the
            trajectory (window latents, log-probs, the images decoded by BAGEL's own decode)."""
            if len(prompt_ids) != len(seeds):
                raise ValueError(f"{len(prompt_ids)} prompts for {len(seeds)} seeds")
            sched = flow_schedule(sampling.num_timesteps, sampling.timestep_shift)
            s1 = float(sched[1])
            shape = (sampling.height, sampling.width)
            per = []
            ctx = fp32_bagel() if self.dtype == torch.float32 else torch.autocast("cpu", dtype=torch.bfloat16)
            lo, hi = sampling.cfg_interval
            with ctx:
                for ids, seed in zip(prompt_ids, seeds):
                    gen = torch.Generator().manual_seed(int(seed))
                    start = (sampling.window_start if sampling.window_start is not None else
                             sample_window_start(sampling.num_steps, sampling.window_size, sampling.window_bounds(),
                                                 gen))
                    levels = (window_noise_levels(sampling.num_steps, start, sampling.window_size,
                                                  sampling.noise_level) if sampling.noise_level > 0
                              else torch.zeros(sampling.num_steps))  # the ODE: Euler everywhere, nothing recorded
                    cache, n = self._text_cache(ids.long())
                    inp = self.bagel.prepare_vae_latent([n], [n], [shape], self.new_token_ids)
                    inp["packed_init_noises"] = torch.randn(inp["packed_init_noises"].shape, generator=gen)
                    empty = bt.NaiveCache(self.cfg["llm_config"]["num_hidden_layers"])
                    cfg_pids = self.bagel.prepare_vae_latent_cfg([0], [0], [shape])["cfg_packed_position_ids"]

                    def scale(t: float) -> float:
                        return sampling.cfg_text_scale if lo < t <= hi else 1.0

                    window = _SdeWindow(levels, s1, sampling.sde_type, gen, scale)
                    latents, *_ = self.bagel.generate_image(
                        past_key_values=cache, cfg_text_past_key_values=empty, cfg_img_past_key_values=cache,
                        num_timesteps=sampling.num_timesteps, timestep_shift=sampling.timestep_shift,
                        cfg_text_scale=sampling.cfg_text_scale, cfg_img_scale=sampling.cfg_img_scale,
                        cfg_interval=sampling.cfg_interval, cfg_renorm_min=sampling.cfg_renorm_min,
                        cfg_renorm_type="global", **inp, cfg_text_packed_position_ids=cfg_pids,
                        cfg_img_packed_position_ids=inp["packed_position_ids"], scheduler=window)
                    image = self._decode_image_from_latent(self.bagel, self.vae, latents[0], shape)
                    per.append((window.record, image, latents[0].float()))
            rec = [[r for r in record] for record, *_ in per]
            n_tok, width = latents[0].shape  # the last sample's final latents [n, p]: every sample's shape

            def stack(k: int) -> torch.Tensor:  # [N, W, n, p]; W = 0 for the ODE (noise 0: nothing recorded)
                if not rec[0]:
                    return torch.zeros(len(rec), 0, *((n_tok, width) if k < 2 else ()))
                return torch.stack([torch.stack([r[k] for r in rs]) for rs in rec])

            scalars = lambda k: torch.tensor([[r[k] for r in rs] for rs in rec],  # noqa: E731
                                             dtype=torch.float32).reshape(len(rec), -1)
            images = torch.stack([torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255 for _, im, _ in per])
            d = self.bagel.latent_downsample
            return BagelTrajectory(
                prompt_ids=[ids.long().clone() for ids in prompt_ids], latents=stack(0), next_latents=stack(1),
                sigmas=scalars(2), sigmas_next=scalars(3), cfg_scales=scalars(4), log_probs=stack(5).float(),
                sigma_after_one=torch.full((len(per),), s1), noise_level=sampling.noise_level,
                sde_type=sampling.sde_type, cfg_renorm_min=sampling.cfg_renorm_min,
                cfg_img_scale=sampling.cfg_img_scale,
                grid=(sampling.height // d, sampling.width // d), images=images,
                group_ids=torch.tensor(list(group_ids) if group_ids is not None else [0] * len(per)),
                seeds=[int(s) for s in seeds], final_latents=torch.stack([x for *_, x in per]))

    return FlowGRPOBagelPipeline


class BagelWeightTarget:
    """The bridge's view of a `FlowGRPOBagelPipeline` (`bridge.targets.RolloutTarget`, at its rollout tp): its
    parameters by their BAGEL (`ema.safetensors`) names, as shape-only meta tensors (the vLLM-Omni modules fuse
    q/k/v and gate/up under other names; the family's layout keeps BAGEL's names, `SameNameLayout`), so the
    bridge's coverage ledger checks every BAGEL tensor written exactly once; `load_full` is the pipeline's
    `load_partial`. Full mode only (nothing is written in place)."""

    kind = "vllm_omni"

    def __init__(self, pipeline: Any) -> None:
        from model_providers.bagel.provider import bagel_shapes

        self.pipeline = pipeline
        # at rollout tp > 1 every rank of the group receives the full tensors too: vLLM's weight loaders keep the
        # rank's shard (`load_partial`)
        self.tp_rank, self.tp_size = pipeline.tp_rank, pipeline.tp_size
        self._params = {n: torch.empty(s, device="meta") for n, s in bagel_shapes(pipeline.cfg).items()}

    def parameters(self) -> dict[str, torch.Tensor]:
        return self._params

    def load_full(self, items: Sequence[tuple[str, torch.Tensor]]) -> set[str]:
        return self.pipeline.load_partial(items)


def __getattr__(name: str) -> Any:
    if name == "FlowGRPOBagelPipeline":
        return _pipeline_class()
    raise AttributeError(name)


@contextlib.contextmanager
def open_bagel_pipeline(cfg: dict[str, Any], folder: str | Path, dtype: torch.dtype = torch.float32,
                        tp: int = 1) -> Iterator[Any]:
    """`FlowGRPOBagelPipeline` of a BAGEL folder inside vLLM-Omni's parallel state at rollout tp `tp` (collective
    over the job: every rank builds its own; at tp > 1 each group of `tp` consecutive ranks holds one pipeline's
    shards, vLLM's parallel linears and vocab-parallel embedding and head, and every rank of a group must make
    the same `generate` calls)."""
    from megatron_omni.rollout.vllm_omni.inline import vllm_omni_parallel

    with vllm_omni_parallel(tp):
        pipe = _pipeline_class()(cfg, dtype)
        pipe.load_folder(folder)
        yield pipe
