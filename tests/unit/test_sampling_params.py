"""One sampling record: both engines' parameters share the SDE window's fields and defaults, and the
trainer's rollout section derives SamplingParams by field name."""

from dataclasses import dataclass

import pytest

from megatron_omni.rollout.base import SamplingParams, SdeWindowParams
from megatron_omni.rollout.diffusers_engines.ar_dit import ARDiTSamplingParams


def test_both_records_share_the_window_defaults():
    base, q, a = SdeWindowParams(), SamplingParams(), ARDiTSamplingParams()
    for name in ("num_steps", "noise_level", "sde_type", "window_size", "window_range"):
        assert getattr(q, name) == getattr(a, name) == getattr(base, name)
    assert q.resolved_window_range == a.resolved_window_range == (0, 5)


def test_from_config_takes_the_fields_by_name():
    @dataclass
    class Section:
        height: int = 32
        num_steps: int = 6
        window_range: list[int] | None = None
        prompts_per_step: int = 4  # not a sampling field: ignored

    got = SamplingParams.from_config(Section(window_range=[1, 3]), text_length=7)
    assert (got.height, got.num_steps, got.window_range, got.text_length) == (32, 6, (1, 3), 7)
    assert got.width == SamplingParams().width


def test_window_errors_name_the_problem_for_both_records():
    with pytest.raises(ValueError, match="sde_type"):
        ARDiTSamplingParams(sde_type="bogus")
    with pytest.raises(ValueError, match="noise_level > 0"):
        ARDiTSamplingParams(noise_level=0.0)


def test_the_rollout_section_takes_its_sampling_defaults_and_values_from_the_record():
    from dataclasses import fields

    from megatron_omni.trainer.config import RolloutConfig

    shared = {f.name for f in fields(RolloutConfig)} & {f.name for f in fields(SamplingParams)}
    assert shared == {"height", "width", "num_steps", "noise_level", "sde_type", "window_size", "window_range",
                      "guidance_scale", "negative_prompt", "text_length", "num_frames", "max_sequence_length",
                      "distilled_guidance", "guidance_scale_2"}
    assert RolloutConfig().sampling_params() == SamplingParams()
    section = RolloutConfig(height=32, width=48, num_steps=6, noise_level=0.7, sde_type="cps", window_size=1,
                            window_range=[1, 3], guidance_scale=4.0, negative_prompt=" ", text_length=9, num_frames=5,
                            max_sequence_length=64, distilled_guidance=3.5, guidance_scale_2=2.0)
    got = section.sampling_params()
    assert got == SamplingParams(height=32, width=48, num_steps=6, noise_level=0.7, sde_type="cps", window_size=1,
                                 window_range=(1, 3), guidance_scale=4.0, negative_prompt=" ", text_length=9,
                                 num_frames=5, max_sequence_length=64, distilled_guidance=3.5, guidance_scale_2=2.0)
