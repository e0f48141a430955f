"""An AR-DiT hybrid as one Megatron module: GPT decoder -> connector -> MMDiT text stream.

The decoder reads prompt + plan tokens `[b, L]` (right-padded, `text_mask` [b, L] marks valid tokens) and
returns vocab-parallel logits (token log-probs for the RL loss) and its final hidden states; the connector
maps those to the DiT's `joint_attention_dim`; the DiT takes them as its prompt embeddings (with the same
mask) and predicts the velocity of the image latents. Both halves keep their own tensor parallelism over the
same tp group, and their own context parallelism over the same cp group (the decoder's Ulysses over token
shards, the DiT's over image shards). The hybrid runs with the whole model on one pipeline stage (pp = 1):
the decoder and the DiT each support pp on their own, a pipeline across both halves is not built.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_omni.models.ar.connector import Connector
from megatron_omni.models.ar.context_parallel import gather_sequence, split_sequence
from megatron_omni.models.ar.decoder import ARDecoder
from megatron_omni.models.dit.diffusers_interface import DiffusersForward
from megatron_omni.models.dit.model import DiTBatch, MMDiTModel


class ARDiTModel(MegatronModule):
    """decoder (`ARDecoder`), connector (`Connector`), dit (`MMDiTModel`); see the module docstring."""

    def __init__(self, decoder: ARDecoder, connector: Connector, dit: MMDiTModel) -> None:
        # Megatron-Core's finalize_model_grads reads the wrapped model's config: the DiT's (qk_layernorm=True)
        # makes it sum the per-head QK-norm grads over tp; the decoder has no tensors with those names.
        super().__init__(dit.config)
        for part, name in ((decoder, "decoder"), (dit, "DiT")):
            if not (part.pre_process and part.post_process):
                raise ValueError(f"the AR-DiT hybrid needs the whole {name} on one pipeline stage (pp=1)")
        self.decoder = decoder
        self.connector = connector
        self.dit = dit
        self.model_type = decoder.model_type
        self.pg_collection = decoder.pg_collection
        # Not a registered submodule: the DiT's tensors would appear twice in state_dict() (and checkpoints).
        object.__setattr__(self, "_velocity_model", DiffusersForward(dit))

    @property
    def velocity_model(self) -> DiffusersForward:
        """The DiT behind diffusers' forward keywords (what the rollout's log-prob code calls)."""
        return self._velocity_model

    def encode(self, input_ids: torch.Tensor, with_logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Decoder pass. input_ids [b, L] -> (conditioning [b, L, joint_attention_dim], logits [L, b, V/tp] or None).

        Under context parallelism (L divisible by 2 * cp) the decoder runs on this rank's shard of the tokens,
        its hidden states are gathered back to the whole sequence for the DiT (which keeps the text stream on
        every cp rank), and the logits are this rank's shard [L / cp, b, V/tp] (`context_parallel.split_sequence`
        of the labels matches them)."""
        cp = self.decoder.cp_group
        hidden, logits = self.decoder.forward_hidden(split_sequence(input_ids, 1, cp), with_logits=with_logits)
        # The DiT's context-parallel backward leaves each cp rank a share of the text stream's gradient.
        return self.connector(gather_sequence(hidden, 0, cp, grad="sum").transpose(0, 1)), logits

    def velocity(self, latents: torch.Tensor, cond: torch.Tensor, text_mask: torch.Tensor | None,
                 sigma: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """DiT pass: latents [b, s_img, c_in], cond [b, L, j], sigma [b] -> velocity [b, s_img_local, c_out]."""
        return self.dit(DiTBatch(latents, cond, text_mask, sigma, grid))

    def forward(self, input_ids: torch.Tensor, text_mask: torch.Tensor | None, latents: torch.Tensor,
                sigma: torch.Tensor, grid: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Whole hybrid: -> (logits [L, b, V/tp], velocity [b, s_img_local, c_out])."""
        cond, logits = self.encode(input_ids)
        return logits, self.velocity(latents, cond, text_mask, sigma, grid)
