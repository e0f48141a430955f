"""The AR decoder's half of the hybrid rollout in vLLM: plans sampled by a `vllm.LLM` engine that the bridge
feeds with the trained decoder's weights.

The engine runs in this process (vLLM's in-process engine core, `VLLM_ENABLE_V1_MULTIPROCESSING=0`), as in
verl's hybrid engine: the trainer's rank drives it, and a weight sync is an in-place copy into the live
parameters (`LLM.apply_model`), by vLLM name, in vLLM's fused layout
(`model_providers.ar_dit.vllm_mapping.vllm_state_dict`). After a sync the prefix cache is reset, since cached
KV blocks were computed with the old weights.

Sampling matches the embedded engine's contract (`ARDiTRolloutEngine`): per sample a seed (vLLM's per-request
generator, so a sample does not depend on its batch), up to `max_tokens` tokens at `temperature`, ending early
at EOS (kept as the plan's last token), and each token's log-prob under the temperature-scaled distribution
(vLLM's `processed_logprobs`), which the trainer recomputes with its Megatron decoder.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_omni.rollout.vllm_omni import cpu_weights


class VLLMPlanWriter:
    """A vLLM engine over the Qwen2 folder `folder` (config + weights in Hugging Face layout) that samples
    plans. `engine_kwargs` go to `vllm.LLM` (e.g. `tensor_parallel_size`, `gpu_memory_utilization`)."""

    def __init__(self, folder: str | os.PathLike, *, max_model_len: int = 512, dtype: str = "float32",
                 seed: int = 0, **engine_kwargs: Any) -> None:
        if not (Path(folder) / "config.json").is_file():
            raise FileNotFoundError(f"{folder} is not a Hugging Face model folder (no config.json)")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine lives in this rank's process
        cpu_weights.keep_vllm_linear_weights_in_place()
        from vllm import LLM

        self.llm = LLM(model=str(folder), skip_tokenizer_init=True, dtype=dtype, max_model_len=max_model_len,
                       seed=seed, enforce_eager=True, logprobs_mode="processed_logprobs", **engine_kwargs)
        self.max_model_len = max_model_len

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """vLLM name -> shape of every live parameter (this engine's tp rank)."""
        return self.llm.apply_model(lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()})[0]

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Copy `tensors` (vLLM name -> tensor in vLLM's layout) into the live parameters; every parameter must
        be given, with its exact shape. Returns the number copied; the prefix cache is reset."""

        @torch.no_grad()
        def copy(model: torch.nn.Module) -> int:
            params = dict(model.named_parameters())
            missing, unknown = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
            if missing or unknown:
                raise KeyError(f"weight sync into vLLM: missing {missing[:5]}, unknown {unknown[:5]}")
            for name, p in params.items():
                t = tensors[name]
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"weight sync into vLLM: {name} has shape {tuple(t.shape)}, the engine "
                                     f"holds {tuple(p.shape)}")
                p.copy_(t.to(dtype=p.dtype, device=p.device))
            return len(params)

        return self._update(copy)

    def load_hf_weights(self, tensors: Mapping[str, torch.Tensor]) -> int:
        """Full Qwen2 tensors in Hugging Face names (`model.layers.N...`, `lm_head.weight`) through vLLM's own
        `load_weights`, which fuses and shards them for this engine's tp rank (any trainer layout gathered to
        full tensors). Every live parameter must be covered. Returns the number loaded; the prefix cache is
        reset."""

        @torch.no_grad()
        def load(model: torch.nn.Module) -> int:
            loaded = model.load_weights((k, v) for k, v in tensors.items())
            missing = sorted(set(dict(model.named_parameters())) - set(loaded))
            if missing:
                raise KeyError(f"weight sync into vLLM left parameters unloaded: {missing[:5]}")
            return len(loaded)

        return self._update(load)

    def _update(self, write: Callable[[torch.nn.Module], int]) -> int:
        """Run `write` on the live model (this engine's worker) and drop the KV blocks of the old weights."""
        counts = self.llm.apply_model(write)
        self.llm.reset_prefix_cache()
        return counts[0]

    def sample_plans(self, prompts: Sequence[Sequence[int]], seeds: Sequence[int], max_tokens: int,
                     temperature: float, eos_token_id: int, pad_token_id: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One plan per (prompt, seed) pair, N = len(prompts) = len(seeds) ->
        (tokens [N, max_tokens] long, pad-filled; log-probs [N, max_tokens] fp32, 0 beyond the plan;
        lengths [N] long)."""
        if len(prompts) != len(seeds):
            raise ValueError(f"{len(prompts)} prompts for {len(seeds)} seeds")
        if max_tokens < 1 or not temperature > 0:
            raise ValueError(f"need max_tokens >= 1 and temperature > 0, got {max_tokens}, {temperature}")
        if any(len(p) + max_tokens > self.max_model_len for p in prompts):
            raise ValueError(f"a prompt plus {max_tokens} plan tokens exceeds max_model_len {self.max_model_len}")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=int(s), logprobs=0,
                                 stop_token_ids=[eos_token_id], detokenize=False) for s in seeds]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompts], params,
                                 use_tqdm=False)
        n = len(prompts)
        tokens = torch.full((n, max_tokens), pad_token_id, dtype=torch.long)
        log_probs = torch.zeros(n, max_tokens)
        lens = torch.zeros(n, dtype=torch.long)
        for i, out in enumerate(outs):
            c = out.outputs[0]
            k = len(c.token_ids)
            tokens[i, :k] = torch.tensor(c.token_ids, dtype=torch.long)
            log_probs[i, :k] = torch.tensor([lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
            lens[i] = k
        return tokens, log_probs, lens

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """[L] token ids -> [L - 1] fp32: log-prob of token t + 1 given tokens 0..t (temperature 1)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = list(map(int, token_ids))
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)],
                                SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False)[0]
        return torch.tensor([d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])])
