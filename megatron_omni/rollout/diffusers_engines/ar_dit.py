"""The embedded AR-DiT rollout: the decoder writes a plan, the DiT draws from the hidden states of
prompt + plan, both in torch (transformers' Qwen2, our connector, diffusers' Qwen-Image transformer), or
either half in a vLLM engine (`ARDiTRolloutEngine(plan_writer=..., vllm_omni_dit=... or dit_server=...)`).

Per sample, one `torch.Generator` seeded with the sample's seed draws, in this order: the plan tokens, the
initial latent noise, the window start, the SDE noise of each window step; a sample's result therefore does
not depend on what it was batched with (up to float rounding of batched matmuls).

- Plan: up to `max_plan_tokens` tokens sampled at `temperature` after the prompt, ending early at the EOS
  token (kept as the plan's last token). Each token's log-prob under the temperature-scaled distribution is
  recorded. Samples of one prompt are decoded together (same prompt length; no KV cache: the tiny models
  re-run the whole prefix, which keeps the code short and exact).
- Image: the final prompt + plan sequences (right-padded) go through the decoder once more; the connector
  maps their last hidden states to the DiT's text width; the DiT denoises with the SDE window (noise only on
  steps [k, k + W)) and the transitions of the window are recorded with their log-probs.
- The hybrid has no VAE here: latents are pixels (the packed 2x2 patches of a `in_channels / 4`-channel
  image); `images` are the first three channels mapped from [-1, 1] to [0, 1].
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import torch

from megatron_omni.algorithms.schedule import qwen_image_sigmas
from megatron_omni.algorithms.sde import windowed_sde_step
from megatron_omni.algorithms.velocity import guided_batch
from megatron_omni.algorithms.window import sample_window_start
from megatron_omni.rollout.base import SdeWindowParams, Trajectory, sample_seeds
from megatron_omni.rollout.vllm_omni.pipeline import VllmOmniVelocity, diffusers_shapes, load_transformer_weights
from megatron_omni.rollout.vllm_omni.plan_writer import VLLMPlanWriter
from model_providers.ar_dit.provider import TorchHybrid

if TYPE_CHECKING:
    from megatron_omni.rollout.vllm_omni.hybrid import VllmOmniHybridDiT


@dataclass(frozen=True)
class ARDiTSamplingParams(SdeWindowParams):
    """max_plan_tokens: plan budget; temperature > 0; grid: the latent grid (1, h, w) in patches; the DiT's
    SDE window from `SdeWindowParams` (its defaults; the tiny recipe passes num_steps=4, noise_level=0.7)."""

    max_plan_tokens: int = 8
    temperature: float = 1.0
    grid: tuple[int, int, int] = (1, 2, 4)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_plan_tokens < 1:
            raise ValueError(f"max_plan_tokens must be >= 1, got {self.max_plan_tokens}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.noise_level <= 0 or self.window_size < 1:
            raise ValueError("the AR-DiT rollout trains a window: noise_level > 0 and window_size >= 1 needed")
        if len(self.grid) != 3 or self.grid[0] != 1:
            raise ValueError(f"grid must be (1, h, w), got {self.grid}")


@dataclass
class ARDiTTrajectory:
    """N samples (L = prompt + plan length, P = plan budget).

    tokens [N, L] long, right-padded with the pad id; text_mask [N, L] bool (prompt + plan positions);
    prompt_lens, plan_lens [N] long; token_log_probs [N, P] fp32 (0 beyond the plan); plan_mask [N, P] bool;
    temperature: the sampling temperature; image: the DiT part (its `prompt_embeds` are the rollout's
    conditioning [N, L, joint_attention_dim], its mask `text_mask`).
    """

    tokens: torch.Tensor
    text_mask: torch.Tensor
    prompt_lens: torch.Tensor
    plan_lens: torch.Tensor
    token_log_probs: torch.Tensor
    plan_mask: torch.Tensor
    temperature: float
    image: Trajectory

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def plan_tokens(self, i: int) -> list[int]:
        """The plan of sample i as token ids."""
        p = int(self.prompt_lens[i])
        return self.tokens[i, p: p + int(self.plan_lens[i])].tolist()

    def select(self, index: torch.Tensor | Sequence[int]) -> ARDiTTrajectory:
        """The samples at `index` as a new trajectory."""
        idx = torch.as_tensor(index, dtype=torch.long)
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            out[f.name] = v.select(idx) if f.name == "image" else (v[idx] if isinstance(v, torch.Tensor) else v)
        return ARDiTTrajectory(**out)


def plan_positions(prompt_lens: torch.Tensor, budget: int) -> torch.Tensor:
    """Index into next-token log-probs `[N, L - 1]` (position t predicts token t + 1) of each plan token:
    [N] prompt lengths -> [N, P] long (`prompt_len - 1 + k`)."""
    return prompt_lens.unsqueeze(1) - 1 + torch.arange(budget, dtype=torch.long)


def pixels_to_images(latents: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
    """Packed pixel latents [N, h*w, 4c] -> images [N, 3, 2h, 2w] in [0, 1] (first three channels)."""
    n, s, ch = latents.shape
    _, h, w = grid
    if s != h * w or ch % 4 or ch // 4 < 3:
        raise ValueError(f"latents {tuple(latents.shape)} do not unpack to a 3-channel image on grid {grid}")
    x = latents.view(n, h, w, ch // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(n, ch // 4, 2 * h, 2 * w)
    return ((x[:, :3].clamp(-1, 1) + 1) / 2).float()


class ARDiTRolloutEngine:
    """Rollout of a `TorchHybrid` (see the module docstring). `max_batch_size` rows per forward.

    The production layout on GPUs swaps either half for a vLLM engine, each loaded with the hybrid's weights
    here and on every `load_weights`:
    - `plan_writer` (a `VLLMPlanWriter`): plans come from vLLM instead of the torch decoder (per-sample seeds
      are vLLM's; the samples' torch generators then draw only the image part). The torch decoder still
      gives the DiT its conditioning.
    - `vllm_omni_dit`: vLLM-Omni's `QwenImageTransformer2DModel` runs the DiT (called inside vLLM-Omni's
      forward context, as its worker does), loaded through vLLM-Omni's own loader
      (`vllm_omni.pipeline.load_transformer_weights`: fused q/k/v, its tp rank's slice, names and shapes
      checked).
    - `dit_server` (a `vllm_omni.hybrid.VllmOmniHybridDiT`): the DiT half served by a vLLM-Omni engine running
      our hybrid pipeline class; each sample's request carries its connector embeddings and its generator's
      state after the plan, so the served trajectory is the embedded one."""

    def __init__(self, hybrid: TorchHybrid, max_batch_size: int = 16, plan_writer: VLLMPlanWriter | None = None,
                 vllm_omni_dit: torch.nn.Module | None = None, dit_server: VllmOmniHybridDiT | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if vllm_omni_dit is not None and dit_server is not None:
            raise ValueError("give the DiT half one engine: vllm_omni_dit (in-process module) or dit_server")
        self.hybrid = hybrid
        self.plan_writer = plan_writer
        self.vllm_omni_dit = vllm_omni_dit
        self.dit_server = dit_server
        self.dit = hybrid.dit if vllm_omni_dit is None else VllmOmniVelocity(vllm_omni_dit)
        if plan_writer is not None:
            plan_writer.load_hf_weights(hybrid.state()[0])
        if vllm_omni_dit is not None:
            self._dit_shapes = diffusers_shapes(hybrid.config.dit)
            load_transformer_weights(vllm_omni_dit, hybrid.dit.state_dict().items(), self._dit_shapes)
        if dit_server is not None:
            dit_server.load_weights(hybrid.dit.state_dict().items())
        self.max_batch_size = max_batch_size
        self.eos = hybrid.config.eos_token_id
        self.pad = hybrid.config.pad_token_id
        self.stats = {"decoder_s": 0.0, "dit_s": 0.0}

    def load_weights(self, decoder: dict[str, torch.Tensor], connector: dict[str, torch.Tensor],
                     dit: dict[str, torch.Tensor] | None) -> None:
        """Fresh weights in Hugging Face layouts (all names must match; see `TorchHybrid.load`). `dit` None:
        the caller writes the embedded torch DiT itself (the trainer's bridge); not possible with vLLM halves."""
        if dit is None and (self.vllm_omni_dit is not None or self.dit_server is not None):
            raise ValueError("the vLLM-Omni DiT needs the DiT's tensors: load_weights(..., dit=None) would leave "
                             "it stale")
        self.hybrid.load(decoder, connector, dit)
        if self.plan_writer is not None:
            self.plan_writer.load_hf_weights(decoder)
        if self.vllm_omni_dit is not None:
            load_transformer_weights(self.vllm_omni_dit, dit.items(), self._dit_shapes)
        if self.dit_server is not None:
            self.dit_server.load_weights(dit.items())

    # -------------------------------------------------------------------------------------------- plan
    @torch.no_grad()
    def _sample_plans(self, prompt: list[int], gens: list[torch.Generator], p: ARDiTSamplingParams
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Plans of len(gens) samples of one prompt: (tokens [B, P] pad-filled, log-probs [B, P], lens [B])."""
        b = len(gens)
        seq = torch.tensor(prompt, dtype=torch.long).unsqueeze(0).repeat(b, 1)
        tokens = torch.full((b, p.max_plan_tokens), self.pad, dtype=torch.long)
        logps = torch.zeros(b, p.max_plan_tokens)
        lens = torch.zeros(b, dtype=torch.long)
        done = torch.zeros(b, dtype=torch.bool)
        for k in range(p.max_plan_tokens):
            logits = self.hybrid.decoder(input_ids=seq).logits[:, -1].float()
            logp = torch.log_softmax(logits / p.temperature, dim=-1)
            nxt = torch.full((b,), self.pad, dtype=torch.long)
            for i in range(b):
                if done[i]:
                    continue
                tok = int(torch.multinomial(logp[i].exp(), 1, generator=gens[i]))
                nxt[i] = tok
                tokens[i, k] = tok
                logps[i, k] = logp[i, tok]
                lens[i] += 1
                done[i] = tok == self.eos
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if bool(done.all()):
                break
        return tokens, logps, lens

    @torch.no_grad()
    def _condition(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, L] -> connector(last hidden states) [N, L, joint_attention_dim] fp32."""
        out = []
        for lo in range(0, tokens.shape[0], self.max_batch_size):
            hidden = self.hybrid.decoder(input_ids=tokens[lo: lo + self.max_batch_size],
                                         output_hidden_states=True).hidden_states[-1]
            out.append(self.hybrid.connector(hidden).float())
        return torch.cat(out)

    # ------------------------------------------------------------------------------------------- the run
    def generate(self, prompts: Sequence[Sequence[int]], params: ARDiTSamplingParams, group_size: int = 1,
                 seeds: Sequence[int] | None = None, group_ids: Sequence[int] | None = None) -> ARDiTTrajectory:
        """`group_size` samples of each prompt (token ids); sample k of prompt j is row j * group_size + k
        with seed `seeds[row]` (default: the row) and group id `group_ids[j]` (default: j)."""
        if not prompts or any(len(q) == 0 for q in prompts):
            raise ValueError("every prompt needs at least one token")
        vocab = self.hybrid.config.decoder["vocab_size"]
        if any(not 0 <= t < vocab for q in prompts for t in q):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        seeds = sample_seeds(len(prompts), group_size, seeds)
        n = len(seeds)
        gids = list(range(len(prompts))) if group_ids is None else [int(g) for g in group_ids]
        if len(gids) != len(prompts):
            raise ValueError(f"{len(gids)} group ids for {len(prompts)} prompts")
        gens = [torch.Generator().manual_seed(s) for s in seeds]

        t0 = time.perf_counter()
        budget = params.max_plan_tokens
        if self.plan_writer is not None:
            plan_tokens, token_lp, plan_len = self.plan_writer.sample_plans(
                [list(prompts[r // group_size]) for r in range(n)], seeds, budget, params.temperature, self.eos,
                self.pad)
        else:
            plans, plan_lp, plan_lens = [], [], []
            for j, prompt in enumerate(prompts):
                for lo in range(0, group_size, self.max_batch_size):
                    rows = range(j * group_size + lo, j * group_size + min(group_size, lo + self.max_batch_size))
                    t, lp, ln = self._sample_plans(list(prompt), [gens[r] for r in rows], params)
                    plans.append(t), plan_lp.append(lp), plan_lens.append(ln)
            plan_tokens, token_lp, plan_len = torch.cat(plans), torch.cat(plan_lp), torch.cat(plan_lens)
        prompt_lens = torch.tensor([len(prompts[r // group_size]) for r in range(n)], dtype=torch.long)
        length = int((prompt_lens + plan_len).max())
        tokens = torch.full((n, length), self.pad, dtype=torch.long)
        for r in range(n):
            p, k = int(prompt_lens[r]), int(plan_len[r])
            tokens[r, :p] = torch.tensor(list(prompts[r // group_size]))
            tokens[r, p: p + k] = plan_tokens[r, :k]
        text_mask = torch.arange(length)[None] < (prompt_lens + plan_len)[:, None]
        plan_mask = torch.arange(budget)[None] < plan_len[:, None]
        cond = self._condition(tokens)
        self.stats["decoder_s"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        image = self._denoise(cond, text_mask, gens, params)
        self.stats["dit_s"] += time.perf_counter() - t0
        image.prompts = [" ".join(map(str, prompts[r // group_size])) for r in range(n)]
        image.group_ids = torch.tensor([gids[r // group_size] for r in range(n)], dtype=torch.long)
        image.seeds = torch.tensor(seeds, dtype=torch.long)
        return ARDiTTrajectory(tokens=tokens, text_mask=text_mask, prompt_lens=prompt_lens, plan_lens=plan_len,
                               token_log_probs=token_lp, plan_mask=plan_mask, temperature=float(params.temperature),
                               image=image)

    @torch.no_grad()
    def _denoise(self, cond: torch.Tensor, text_mask: torch.Tensor, gens: list[torch.Generator],
                 p: ARDiTSamplingParams) -> Trajectory:
        if self.dit_server is not None:
            return self.dit_server.denoise(cond, text_mask, [g.get_state() for g in gens], p)
        return denoise_window(self.dit, cond, text_mask, gens, p, self.hybrid.config.dit["in_channels"],
                              self.max_batch_size)


@torch.no_grad()
def denoise_window(dit: Callable[..., Any], cond: torch.Tensor, text_mask: torch.Tensor, gens: list[torch.Generator],
                   p: ARDiTSamplingParams, channels: int, max_batch_size: int,
                   dtype: torch.dtype = torch.float32) -> Trajectory:
    """The DiT half of a hybrid rollout: pixel latents denoised with the SDE window, the window's transitions
    recorded with their log-probs. Shared by the embedded engine and vLLM-Omni's hybrid pipeline
    (`vllm_omni.hybrid`), so both produce the same trajectory for the same generator states.

    Args:
        dit: a velocity model with diffusers' Qwen-Image forward keywords (see `algorithms.velocity`).
        cond: [N, L, D] connector output (on the DiT's device); text_mask: [N, L] bool or long.
        gens: N CPU generators, one per sample, each drawing its initial noise, window start and window noise.
        channels: the DiT's `in_channels` (packed 2x2 pixel patches).
        dtype: the DiT's compute dtype (latents and the SDE math stay fp32).

    Returns:
        A `Trajectory` on the CPU (prompts, group ids and seeds left for the caller to fill in).
    """
    device = cond.device
    n = cond.shape[0]
    grid = tuple(p.grid)
    s_img = grid[1] * grid[2]
    latents = torch.stack([torch.randn(s_img, channels, generator=g) for g in gens]).to(device)
    starts = torch.tensor([sample_window_start(p.num_steps, p.window_size, p.resolved_window_range, g)
                           for g in gens], dtype=torch.long)
    sigmas = qwen_image_sigmas(p.num_steps, s_img)
    on_device = sigmas.to(device)
    w = p.window_size
    rec_x = torch.zeros(n, w, s_img, channels)
    rec_next = torch.zeros_like(rec_x)
    rec_lp = torch.zeros(n, w)
    mask = text_mask.long().to(device)
    for i in range(p.num_steps):
        in_window = (starts <= i) & (i < starts + w)
        sigma = on_device[i].expand(n)
        bs = max_batch_size
        v = torch.cat([guided_batch(latents[lo: lo + bs], sigma[lo: lo + bs], cond[lo: lo + bs], mask[lo: lo + bs],
                                    grid).velocity(dit, dtype) for lo in range(0, n, bs)])
        levels = (in_window.float() * p.noise_level).to(device)
        latents_next, on, lp = windowed_sde_step(latents, v, sigma, on_device[i + 1].expand(n), on_device[1].expand(n),
                                                 levels, p.sde_type, gens)
        if on.numel():
            rows = on.cpu()
            j = i - starts[rows]
            rec_x[rows, j] = latents[on].float().cpu()
            rec_next[rows, j] = latents_next[on].float().cpu()
            rec_lp[rows, j] = lp.float().cpu()
        latents = latents_next
    return Trajectory(
        prompts=[""] * n, group_ids=torch.zeros(n, dtype=torch.long), seeds=torch.zeros(n, dtype=torch.long),
        prompt_embeds=cond.float().cpu(), prompt_embeds_mask=mask.cpu(), negative_prompt_embeds=None,
        negative_prompt_embeds_mask=None, guidance_scale=torch.ones(n), latents=rec_x, next_latents=rec_next,
        log_probs=rec_lp, sigmas=sigmas.expand(n, -1).clone(), window_start=starts,
        images=pixels_to_images(latents.float().cpu(), grid), img_shape=grid, noise_level=float(p.noise_level),
        sde_type=p.sde_type,
    )
