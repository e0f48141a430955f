"""BAGEL (ByteDance-Seed's unified understanding + generation model) on Megatron-Core: the MoT decoder
(`mot.MoTLayer`), the token embedding and LM head (vocab-parallel), and the generation side's time embedder,
latent position embedding and vae2llm / llm2vae projections.

A generation step as BAGEL runs it (vLLM-Omni's `Bagel.forward_cache_update_text` then `forward_single_branch`):

1. the prompt `[bos, text..., eos]` at positions 0..L-1 goes causally through the understanding expert, and
   every layer keeps its keys (after QK-norm and RoPE) and values: the text KV cache (`text_kv`);
2. the image query `[<start_of_image>, latent tokens..., <end_of_image>]`, every token at RoPE position L (BAGEL's
   position ids: one position per image), goes non-causally through the layers, the two markers through the
   understanding expert and the latent tokens (`vae2llm(x_t) + time_embedder(t) + latent_pos_embed(pos)`)
   through the generation expert, each query over [cached prompt keys, all image-query keys];
3. the final norm (per expert) and `llm2vae` on the latent tokens give the velocity (`velocity`).

Pipeline parallelism splits the layers: a stage runs its own layers and keeps their KV (`stage_*` methods take
the previous stage's hidden states). The small generation-side modules (time embedder, vae2llm, llm2vae,
latent position table) are replicated over tensor-parallel ranks; the ViT/connector (understanding of input
images) is not part of this module (t2i does not use it; it stays a frozen replicated module at the rollout).

Context parallelism splits a generation step's image query (`stage_velocity`) into contiguous token shards over
the cp group the model was built with; the prompt's understanding pass stays whole on every cp rank (it is causal
and short), so every rank holds the whole text KV. See `mot.TokenShard` and docs/families-bagel.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from diffusers.models.embeddings import get_timestep_embedding
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.enums import ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omni.models.bagel.mot import KV, MoTLayer, RMSNorm, TokenShard, gather_uneven, route, shard_bounds


@dataclass(frozen=True)
class BagelArch:
    """What BAGEL adds to a Qwen2 decoder config.

    vocab_size, rope_theta: the LLM's; qk_norm: per-head RMSNorm on q and k (BAGEL-7B-MoT: True);
    patch_latent_dim: latent_patch_size**2 * VAE z_channels (one latent token's width);
    max_latent_size: side of the latent position table (position id = row * max_latent_size + col);
    timestep_freq_dim: sinusoidal width of the time embedder (256, as DiT)."""

    vocab_size: int
    rope_theta: float
    patch_latent_dim: int
    max_latent_size: int
    qk_norm: bool = True
    timestep_freq_dim: int = 256


def sincos_2d(dim: int, side: int) -> torch.Tensor:
    """BAGEL's fixed latent position table [side * side, dim] (MAE-style 2D sin-cos: half the channels encode
    the row, half the column; each half is [sin | cos] of log-spaced frequencies)."""
    def one_d(d: int, pos: np.ndarray) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(d // 2, dtype=np.float64) / (d / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    grid = np.meshgrid(np.arange(side, dtype=np.float32), np.arange(side, dtype=np.float32))
    return torch.from_numpy(np.concatenate([one_d(dim // 2, grid[0]), one_d(dim // 2, grid[1])], axis=1)).float()


def latent_position_ids(h: int, w: int, max_latent_size: int) -> torch.Tensor:
    """Latent position ids [h * w] of an h x w latent-token grid (row-major, row stride `max_latent_size`)."""
    if h > max_latent_size or w > max_latent_size:
        raise ValueError(f"latent grid {h}x{w} exceeds BAGEL's max_latent_size {max_latent_size}")
    return (torch.arange(h)[:, None] * max_latent_size + torch.arange(w)).flatten()


class TimeEmbedder(torch.nn.Module):
    """DiT's timestep embedder: sinusoidal [cos | sin] features of t (BAGEL passes t in [0, 1]) -> Linear, SiLU,
    Linear. `linear_1` / `linear_2` are BAGEL's `mlp.0` / `mlp.2`."""

    def __init__(self, hidden: int, freq_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.linear_1 = torch.nn.Linear(freq_dim, hidden, dtype=dtype)
        self.linear_2 = torch.nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        """t [n] -> [n, hidden]."""
        f = get_timestep_embedding(t.float(), self.freq_dim, flip_sin_to_cos=True, downscale_freq_shift=0)
        return self.linear_2(torch.nn.functional.silu(self.linear_1(f.to(self.linear_1.weight.dtype))))


class BagelMoT(MegatronModule):
    """This rank's pipeline stage of BAGEL's MoT language model with the generation-side modules.

    Parameter names (the name mapping in `model_providers.bagel.mapping` relies on them): `embedding.*`,
    `time_embedder.*`, `vae2llm.*`, `latent_pos_embed` (first stage); `decoder.layers.<local i>.*`;
    `decoder.final_layernorm(_gen).weight`, `llm2vae.*`, `output_layer.weight` (last stage).
    """

    def __init__(self, config: TransformerConfig, arch: BagelArch, groups) -> None:
        super().__init__(config)
        pg = groups.mcore
        tp, pp = pg.tp, pg.pp
        if config.num_layers % pp.size():
            raise ValueError(f"{config.num_layers} BAGEL layers are not divisible by pp={pp.size()}")
        self.arch = arch
        self.pg_collection = pg
        self.pre_process, self.post_process = pp.rank() == 0, pp.rank() == pp.size() - 1
        self.model_type = ModelType.encoder_or_decoder  # what Megatron-Core's pipeline schedules read
        n_local = config.num_layers // pp.size()
        self.layer_offset = pp.rank() * n_local
        h, dtype = config.hidden_size, config.params_dtype
        self.rotary = RotaryEmbedding(config.kv_channels, rotary_percent=1.0, rotary_base=arch.rope_theta,
                                      cp_group=pg.cp)
        if self.pre_process:
            self.embedding = torch.nn.Module()
            self.embedding.word_embeddings = tensor_parallel.VocabParallelEmbedding(
                arch.vocab_size, h, init_method=config.init_method, config=config, tp_group=tp)
            self.time_embedder = TimeEmbedder(h, arch.timestep_freq_dim, dtype)
            self.vae2llm = torch.nn.Linear(arch.patch_latent_dim, h, dtype=dtype)
            # A fixed table in BAGEL (a frozen parameter stored in its checkpoint).
            self.latent_pos_embed = torch.nn.Parameter(sincos_2d(h, arch.max_latent_size).to(dtype),
                                                       requires_grad=False)
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(MoTLayer(config, tp, pg.cp, arch.qk_norm) for _ in range(n_local))
        if self.post_process:
            self.decoder.final_layernorm = RMSNorm(h, config.layernorm_epsilon, dtype)
            self.decoder.final_layernorm_gen = RMSNorm(h, config.layernorm_epsilon, dtype)
            self.llm2vae = torch.nn.Linear(h, arch.patch_latent_dim, dtype=dtype)
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                h, arch.vocab_size, config=config, init_method=config.init_method, bias=False, gather_output=False,
                tp_group=tp)

    def global_name(self, name: str) -> str:
        """A local parameter or module name of this stage -> the whole model's (layers numbered from the stage's
        offset)."""
        if not name.startswith("decoder.layers."):
            return name
        idx, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{int(idx) + self.layer_offset}.{rest}"

    # ------------------------------------------------------------------------------------------ pieces
    def rope(self, position_ids: torch.Tensor) -> torch.Tensor:
        """RoPE frequencies [n, 1, 1, d] of position ids [n] (Qwen2's, non-interleaved halves).

        The whole table (`get_emb`): `RotaryEmbedding.forward` slices it per cp rank for causal load balancing,
        while BAGEL's position ids are explicit (every image-query token sits at the prompt's length)."""
        return self.rotary.get_emb(int(position_ids.max()) + 1)[position_ids]

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[n] token ids -> [n, 1, h] (first stage)."""
        return self.embedding.word_embeddings(ids[:, None])

    def embed_image_query(self, marker_ids: torch.Tensor, latents: torch.Tensor, timesteps: torch.Tensor,
                          latent_pos_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """BAGEL's image query (first stage): markers [2] (start, end of image), latents [n, p], timesteps [n],
        latent position ids [n] -> (packed [n + 2, 1, h] in order [start, latents..., end], gen_mask [n + 2])."""
        markers = self.embed_tokens(marker_ids)
        x = self.vae2llm(latents) + self.time_embedder(timesteps) + self.latent_pos_embed[latent_pos_ids]
        packed = torch.cat([markers[:1], x.to(markers.dtype)[:, None], markers[1:]])
        gen_mask = torch.zeros(packed.shape[0], dtype=torch.bool, device=packed.device)
        gen_mask[1:-1] = True
        return packed, gen_mask

    def run_layers(self, x: torch.Tensor, rope: torch.Tensor, gen_mask: torch.Tensor | None = None,
                   prefix: list[KV] | None = None, causal: bool = False,
                   shard: TokenShard | None = None) -> tuple[torch.Tensor, list[KV]]:
        """This stage's layers: x [n, 1, h] -> (x [n, 1, h], per local layer (k, v) of the n tokens); `shard`: x
        is this rank's context-parallel shard (see `mot.MoTAttention.forward`)."""
        kvs = []
        for i, layer in enumerate(self.decoder.layers):
            x, kv = layer(x, rope, gen_mask, None if prefix is None else prefix[i], causal, shard)
            kvs.append(kv)
        return x, kvs

    # ------------------------------------------------------------------------------------------ stages
    def stage_text(self, ids: torch.Tensor, hidden: torch.Tensor | None = None,
                   with_logits: bool = False) -> tuple[torch.Tensor, list[KV], torch.Tensor | None]:
        """The understanding pass of a prompt on this stage: ids [L] at positions 0..L-1 (the first stage embeds
        them; later stages take the previous stage's `hidden` [L, 1, h]).

        Returns (hidden [L, 1, h] (final-normed on the last stage), the local layers' KV cache,
        vocab-parallel logits [L, 1, vocab / tp] when `with_logits` on the last stage)."""
        x = self.embed_tokens(ids) if self.pre_process else hidden
        x, kvs = self.run_layers(x, self.rope(torch.arange(ids.shape[0], device=ids.device)), causal=True)
        logits = None
        if self.post_process:
            x = self.decoder.final_layernorm(x)
            if with_logits:
                logits = self.output_layer(x)[0]
        return x, kvs, logits

    def query_shard(self, n: int) -> TokenShard | None:
        """The context-parallel split of a generation step's image query (n latent tokens + 2 markers) over this
        model's cp group; None without context parallelism. `bounds` is this rank's [start, stop) in the packed
        order [start marker, latents..., end marker]: the hidden states a pipeline stage passes are
        [stop - start, 1, h]."""
        cp = self.pg_collection.cp
        return TokenShard(cp, n + 2) if cp is not None and cp.size() > 1 else None

    def stage_velocity(self, text_kv: list[KV], rope_position: int, marker_ids: torch.Tensor,
                       latents: torch.Tensor, timesteps: torch.Tensor, latent_pos_ids: torch.Tensor,
                       hidden: torch.Tensor | None = None) -> torch.Tensor:
        """One generation step on this stage (see the module docstring): `text_kv` this stage's cached prompt
        KV, `rope_position` the prompt length (every image-query token's RoPE position). Every cp rank passes
        the whole step (latents [n, p], timesteps [n], latent position ids [n]).

        Returns the hidden states [n + 2, 1, h] for the next stage, or on the last stage the velocity [n, p];
        under context parallelism this rank's shard of either (`query_shard`; the velocity of the latent tokens
        inside it, `gather_velocity` joins them)."""
        n = latents.shape[0]
        shard = self.query_shard(n)
        start, stop = shard.bounds if shard is not None else (0, n + 2)
        gen_mask = torch.zeros(n + 2, dtype=torch.bool, device=latents.device)
        gen_mask[1:-1] = True
        if self.pre_process:
            # The whole query is embedded and then sliced: a per-token linear map, far cheaper than one layer.
            hidden, gen_mask = self.embed_image_query(marker_ids, latents, timesteps, latent_pos_ids)
            hidden = hidden[start:stop]
        gen_mask = gen_mask[start:stop]
        rope = self.rope(torch.full((stop - start,), rope_position, dtype=torch.long, device=latents.device))
        x, _ = self.run_layers(hidden, rope, gen_mask, prefix=text_kv, shard=shard)
        if not self.post_process:
            return x
        x = route(x, gen_mask, self.decoder.final_layernorm, self.decoder.final_layernorm_gen)
        return self.llm2vae(x[gen_mask][:, 0])

    def gather_velocity(self, v: torch.Tensor, n: int) -> torch.Tensor:
        """This cp rank's velocity [k, p] (`stage_velocity` on the last stage) -> the image's [n, p] (identity without
        context parallelism). Differentiable with the all-gather's adjoint: a loss every cp rank computes whole
        from the gathered velocity reaches the shards cp times once the dp x cp reduction sums it (divide it by
        cp, or compute the loss on the rank's own shard as the parity test does)."""
        shard = self.query_shard(n)
        if shard is None:
            return v
        size = shard.group.size()
        bounds = [shard_bounds(n + 2, size, r) for r in range(size)]
        lengths = [max(0, min(b, n + 1) - max(a, 1)) for a, b in bounds]  # latents are packed positions 1..n
        return gather_uneven(v, shard.group, lengths)

    def set_input_tensor(self, input_tensor) -> None:
        """Megatron's pipeline hook (inputs are passed to the stage methods explicitly instead)."""
        self.input_tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor


def text_cfg(v_cond: torch.Tensor, v_uncond: torch.Tensor, scale: float, renorm_min: float = 0.0,
             img_scale: float = 1.0, v_no_image: torch.Tensor | None = None) -> torch.Tensor:
    """BAGEL's classifier-free guidance with its `global` renorm (vLLM-Omni's `Bagel._combine_cfg`): text
    `v' = v_u + scale (v_c - v_u)`; with `img_scale` > 1 and the image-free branch `v_no_image` (text-to-image:
    the text-conditioned branch itself, as vLLM-Omni's pipeline builds its `cfg_img` context) then
    `v' = v_i + img_scale (v' - v_i)`; scaled by `clamp(|v_c| / (|v'| + 1e-8), renorm_min, 1)` (norms over the
    whole [n, p] velocity: one image). Returns [n, p]."""
    guided = v_uncond + scale * (v_cond - v_uncond)
    if img_scale > 1.0 and v_no_image is not None:
        guided = v_no_image + img_scale * (guided - v_no_image)
    factor = (torch.norm(v_cond) / (torch.norm(guided) + 1e-8)).clamp(min=renorm_min, max=1.0)
    return guided * factor


def pipeline_run(stage_fn, pp_group, shape: tuple[int, ...], dtype: torch.dtype):
    """Run `stage_fn(hidden_or_None)` stage after stage over `pp_group` (forward only, one micro-batch): stage r
    receives [shape] hidden states from stage r - 1 and sends its result to r + 1. Returns the last stage's result
    on the last stage, this stage's output elsewhere."""
    rank, size = pp_group.rank(), pp_group.size()
    ranks = torch.distributed.get_process_group_ranks(pp_group)
    hidden = None
    if rank > 0:
        hidden = torch.empty(shape, dtype=dtype)
        torch.distributed.recv(hidden, src=ranks[rank - 1], group=pp_group)
    out = stage_fn(hidden)
    if rank < size - 1:
        torch.distributed.send(out.contiguous(), dst=ranks[rank + 1], group=pp_group)
    return out
