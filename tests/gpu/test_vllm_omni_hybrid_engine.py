"""The AR-DiT rollout with its DiT half served by vLLM-Omni's `Omni` engine (`VllmOmniHybridDiT`: our
`FlowGRPOHybridDiTPipeline` and worker extension), served from the converter's AR-DiT folder, against the
embedded torch rollout, on a CUDA device.

Needs a GPU and vLLM + vLLM-Omni built for it; skips with the reason otherwise. On CPU the same pipeline class,
request path and weight receiver are tested in-process (tests/distributed/test_ar_dit_vllm_plans.py).
"""

from __future__ import annotations

import pytest
import torch

from megatron_omni.rollout.diffusers_engines.ar_dit import ARDiTRolloutEngine, ARDiTSamplingParams
from tests.gpu.vllm_omni_gpu import require_vllm_omni_gpu

pytestmark = pytest.mark.gpu

PARAMS = ARDiTSamplingParams(max_plan_tokens=6, temperature=0.8, num_steps=6, window_size=2,
                             noise_level=0.7)
SEEDS = [11, 12, 13, 14]
TOL = 2e-4  # fp32 in both, but vLLM-Omni's kernels are not diffusers' (TF32 off)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    require_vllm_omni_gpu("tests/distributed/test_ar_dit_vllm_plans.py")
    from megatron_omni.rollout.vllm_omni.hybrid import VllmOmniHybridDiT
    from model_providers.ar_dit import provider
    from tools.checkpoint.convert_ar_dit import save_hf_folder

    folder = tmp_path_factory.mktemp("hybrid") / "hf"
    save_hf_folder(provider.torch_hybrid("tiny", seed=3), folder)
    hybrid = provider.torch_hybrid("tiny", seed=5)
    server = VllmOmniHybridDiT(folder, hybrid.config.dit, tensor_parallel_size=1, dtype="float32")
    yield ARDiTRolloutEngine(provider.torch_hybrid("tiny", seed=5), dit_server=server), ARDiTRolloutEngine(hybrid)
    server.close()


def _assert_same(a, b) -> None:
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.image.window_start, b.image.window_start)
    for f in ("images", "latents", "next_latents", "log_probs"):
        d = float((getattr(a.image, f).float() - getattr(b.image, f).float()).abs().max())
        assert d < TOL, (f, d)


def test_served_dit_equals_embedded_rollout(engines) -> None:
    served, embedded = engines
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    _assert_same(served.generate(prompts, PARAMS, group_size=2, seeds=SEEDS),
                 embedded.generate(prompts, PARAMS, group_size=2, seeds=SEEDS))


def test_weight_update_reaches_the_served_dit(engines) -> None:
    served, embedded = engines
    prompts = [[5, 6, 7, 8, 9]]
    before = served.generate(prompts, PARAMS, group_size=2, seeds=SEEDS[:2])
    g = torch.Generator().manual_seed(1)
    decoder, connector, dit = embedded.hybrid.state()
    dit = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in dit.items()}
    for engine in (served, embedded):
        engine.load_weights(decoder, connector, dit)
    after = served.generate(prompts, PARAMS, group_size=2, seeds=SEEDS[:2])
    assert float((after.image.images - before.image.images).abs().max()) > 1e-3
    _assert_same(after, embedded.generate(prompts, PARAMS, group_size=2, seeds=SEEDS[:2]))
    with pytest.raises(Exception, match="partial weight update"):
        served.dit_server.load_weights([("proj_out.bias", dit["proj_out.bias"])])
