"""The Megatron FLUX.1 model equals diffusers' `FluxTransformer2DModel` at tp=1: fp32 forward and every gradient
to float precision, a bit-exact load -> export of the diffusers weights, and the bf16 forward bit for bit. The tiny
preset has two double-stream and two single-stream blocks and the guidance embedding of FLUX.1-dev. The weight shapes
from the config equal the built model's and diffusers' parameter count, also for the published FLUX.1-dev."""

from __future__ import annotations

import math

import pytest
import torch

from model_providers.flux import provider
from tests.unit import flux_reference, sd3_reference


def test_fp32_parity_with_diffusers_at_tp1(groups) -> None:
    result = flux_reference.parity(groups)
    print(f"flux fp32 tp1: max abs {result['fwd_abs']:.3g}, rel {result['fwd_rel']:.3g}, "
          f"worst grad rel {max(result['grad'].values()):.3g}")
    sd3_reference.check(result)


def test_bf16_forward_is_bit_exact_at_tp1(groups) -> None:
    # The same roundings as diffusers in bf16 (t and the guidance scale times 1000 in bf16, torch's RMSNorm for the
    # QK norms, contiguous inputs to the embedders): the forward equals bit for bit. Backward is Megatron's and
    # autograd's own order: measured worst gradient relative error 7.7e-3 on this model.
    result = flux_reference.parity(groups, torch.bfloat16)
    print(f"flux bf16 tp1: max abs {result['fwd_abs']:.3g}, rel {result['fwd_rel']:.3g}, "
          f"worst grad rel {max(result['grad'].values()):.3g}")
    assert result["fwd_abs"] == 0.0, result["fwd_abs"]
    sd3_reference.check(result, fwd_rel=1e-30, grad_rel=2e-2)


def test_shapes_match_the_built_model_and_diffusers(groups) -> None:
    model = provider.build_model(provider.transformer_config("tiny"), groups)
    built = {model.global_name(n): tuple(t.shape) for n, t in model.state_dict().items()
             if not n.endswith("_extra_state")}
    assert built == provider.megatron_shapes("tiny")
    ref = flux_reference.reference_model()
    assert provider.parameter_count("tiny") == ref.num_parameters()
    assert sum(math.prod(s) for s in built.values()) == sum(t.numel() for t in ref.state_dict().values())
    # FLUX.1-dev, from its published config: 11.9 B parameters (diffusers' count from a meta-device model).
    from accelerate import init_empty_weights
    from diffusers import FluxTransformer2DModel

    with init_empty_weights():
        dev = FluxTransformer2DModel(**provider.hf_config("flux1-dev"))
    assert provider.parameter_count("flux1-dev") == dev.num_parameters() == 11_901_408_320


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match="axes_dims_rope"):
        provider.hf_config(dict(provider.hf_config("tiny"), axes_dims_rope=(4, 4, 4)))
    with pytest.raises(ValueError, match="lacks"):
        provider.hf_config({k: v for k, v in provider.hf_config("tiny").items() if k != "num_single_layers"})
    with pytest.raises(KeyError, match="unknown FLUX preset"):
        provider.hf_config("nope")
