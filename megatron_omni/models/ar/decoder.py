"""A Megatron-Core `GPTModel` (local spec) that also returns its last hidden states, for AR-DiT hybrids.

The hybrid's DiT reads the decoder's final (post-norm) hidden states of prompt + plan, the way Qwen-Image
reads the last hidden state of its Qwen2.5-VL text encoder; the RL loss reads the token log-probs. One
forward gives both. Causal attention only: sequences are right-padded, so padding never reaches a valid
position and no padding mask is needed (the loss and the DiT ignore padded positions).

Shapes are Megatron's: inputs `[b, s]`, hidden `[s, b, h]`, logits `[s, b, vocab / tp]` (vocab-parallel;
`token_log_probs` computes log-probs without gathering the vocabulary).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_omni.models.ar.context_parallel import UlyssesCausalAttention, zigzag_rotary


def decoder_layer_spec(backend: str = "local", context_parallel: bool = False) -> ModuleSpec:
    """The decoder layer spec: `local` (Megatron-Core linears, torch RMSNorm; CPU and tests) or `te`.
    `context_parallel` on the local spec swaps the core attention for `UlyssesCausalAttention` (TE's has its own)."""
    if backend == "local":
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        if context_parallel:
            spec.submodules.self_attention.submodules.core_attention = UlyssesCausalAttention
        return spec
    if backend == "te":
        try:
            import transformer_engine  # noqa: F401
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        except ImportError as exc:
            raise ImportError(f"the 'te' decoder spec needs TransformerEngine ({exc}); use backend='local'") from exc
        return get_gpt_layer_with_transformer_engine_spec()
    raise ValueError(f"unknown layer-spec backend {backend!r}; choose 'local' or 'te'")


class ARDecoder(GPTModel):
    """GPTModel with rotary embeddings whose `forward_hidden` returns hidden states and logits.

    Parameter names are GPTModel's (the name mapping relies on it).
    """

    def __init__(self, config: TransformerConfig, spec: ModuleSpec, vocab_size: int, max_sequence_length: int,
                 rotary_base: float, groups, share_embeddings_and_output_weights: bool = False) -> None:
        pg = groups.mcore
        pp_size, pp_rank = pg.pp.size(), pg.pp.rank()
        if config.num_layers % pp_size:
            raise ValueError(f"{config.num_layers} decoder layers are not divisible by pp={pp_size}")
        if share_embeddings_and_output_weights and pp_size > 1:
            raise ValueError("tied embeddings across pipeline stages need an embedding group; use pp=1")
        super().__init__(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pp_rank == 0,
            post_process=pp_rank == pp_size - 1,
            parallel_output=True,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type="rope",
            rotary_base=rotary_base,
            pg_collection=pg,
        )
        self.layer_offset = pp_rank * (config.num_layers // pp_size)
        self.cp_group = pg.cp if pg.cp.size() > 1 else None
        if self.cp_group is not None:
            # Megatron's per-rank RoPE slicing indexes on CUDA; the full table is sliced by `zigzag_rotary`.
            self.rotary_pos_emb.cp_group = None

    def forward_hidden(
        self, input_ids: torch.Tensor | None, with_logits: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run this stage.

        Args:
            input_ids: [b, s] token ids (first stage; later stages take `set_input_tensor`); under context
                parallelism this cp rank's shard [b, s / cp] (`context_parallel.split_sequence`), and the
                outputs are its shard too.
            with_logits: also apply the output layer (last stage).

        Returns:
            (hidden [s, b, h] (post final norm on the last stage), logits [s, b, vocab / tp] or None).
        """
        position_ids = None
        if input_ids is not None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)
        decoder_input, rotary_pos_emb = self._preprocess(input_ids, position_ids)[:2]
        if self.cp_group is not None:
            rotary_pos_emb = zigzag_rotary(rotary_pos_emb, self.cp_group)
        hidden = self.decoder(hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary_pos_emb)
        if not (self.post_process and with_logits):
            return hidden, None
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden, weight=weight)
        return hidden, logits

    def forward(self, input_ids: torch.Tensor | None, position_ids=None, attention_mask=None, **unused) -> torch.Tensor:
        """Pipeline-schedule entry: logits [s, b, vocab / tp] on the last stage, hidden [s, b, h] elsewhere."""
        hidden, logits = self.forward_hidden(input_ids)
        return logits if logits is not None else hidden


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, tp_group) -> torch.Tensor:
    """Log-probs of `targets` under vocab-parallel logits, without gathering the vocabulary.

    Megatron-Core's `vocab_parallel_cross_entropy` reads the global tensor-parallel group; this takes it as
    an argument. The sums go through `reduce_from_tensor_model_parallel_region` (all-reduce forward,
    identity backward), the right adjoint when every tp rank computes the same loss from the result.

    Args:
        logits: [s, b, vocab / tp] this rank's vocabulary slice (math in fp32).
        targets: [s, b] token ids (global vocabulary).
        tp_group: the tensor-parallel group the vocabulary is split over.

    Returns:
        [s, b] float32 log p(target), differentiable.
    """
    x = logits.float()
    if tp_group.size() == 1:
        return torch.log_softmax(x, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    part = x.shape[-1]
    lo = tp_group.rank() * part
    with torch.no_grad():
        x_max = x.max(dim=-1).values
        torch.distributed.all_reduce(x_max, op=torch.distributed.ReduceOp.MAX, group=tp_group)
    shifted = x - x_max.unsqueeze(-1)
    sum_exp = tensor_parallel.reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1), group=tp_group)
    local = targets - lo
    inside = (local >= 0) & (local < part)
    picked = shifted.gather(-1, local.clamp(0, part - 1).unsqueeze(-1)).squeeze(-1) * inside
    picked = tensor_parallel.reduce_from_tensor_model_parallel_region(picked, group=tp_group)
    return picked - sum_exp.log()


def gather_logits(logits: torch.Tensor, tp_group) -> torch.Tensor:
    """All-gather vocab-parallel logits [s, b, vocab / tp] -> [s, b, vocab]."""
    if tp_group.size() == 1:
        return logits
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits, group=tp_group)
