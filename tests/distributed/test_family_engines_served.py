"""The image and video families' pipeline classes served by vLLM-Omni 0.30's own `Omni` engine in worker processes
(`rollout.vllm_omni_process=engine`, the trainer's default: our CPU platform plugin and `mp` executor, the workers
forked from this process's one fork server), as an engine's owning rank starts it (`engine.start_omni` behind
`VllmOmniRolloutEngine`).

SD3.5 (true CFG 4.5, pooled CLIP embeddings), FLUX.1 (distilled guidance 2.0), Wan2.2 (text-to-video, CFG 5.0),
Wan2.2-TI2V's layout (image-to-video records, the first frame's tokens clean) and Qwen-Image-Edit (source-image
records, CFG 3.0), each at rollout tp 2 (two worker processes, the transformer sharded; SD3.5 at tp 4 too): the
workers report our platform and the family's pipeline class; the trajectories (every record crossing the workers'
message queues) equal the family's diffusers engine's for the same seeds; a bucketed weight update over
`collective_rpc` reaches the next rollout, equal to the diffusers engine holding the same weights; a partial update is
refused by name. Then FP8 (`rollout.quantization=fp8`), FLUX.1 at rollout tp 1 and SD3.5 at tp 2: the workers'
linears hold FP8 weights, and the probe before and after an update passes or fails the trainer's quantized check as it
should. (The same classes in
the trainer's ranks, `rollout.vllm_omni_process=inline`, with the bridge's plans: test_image_vllm_omni.py,
test_wan_vllm_omni.py, test_qwen_image_edit_vllm_omni.py.)

Only the first engine of the module pays vLLM-Omni's imports (in the fork server, about 20 s); each next one starts in
a few seconds."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_omni.rollout.base import SamplingParams
from tests.distributed.vllm_omni_helpers import perturbed, trajectory_diff
from tests.processes import fork_servers

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

IMAGE = SamplingParams(height=64, width=64, num_steps=4, noise_level=0.7, window_size=2, window_range=(0, 3),
                       max_sequence_length=16)
VIDEO = SamplingParams(height=32, width=32, num_frames=5, num_steps=4, noise_level=1.0, window_size=2,
                       window_range=(0, 3), max_sequence_length=16, guidance_scale=5.0, negative_prompt="blurry")
PARAMS = {"sd3": replace(IMAGE, guidance_scale=4.5, negative_prompt="blurry"),
          "flux": replace(IMAGE, distilled_guidance=2.0),
          "wan": VIDEO,
          # Wan2.2-TI2V's layout: image-to-video records, 9 frames at 64 x 64, each clip's first latent frame its image
          "wan_ti2v": replace(VIDEO, height=64, width=64, num_frames=9),
          "qwen_image_edit": replace(IMAGE, guidance_scale=3.0, negative_prompt=" ")}
CLASSES = {"sd3": "FlowGRPOSD3Pipeline", "flux": "FlowGRPOFluxPipeline", "wan": "FlowGRPOWanPipeline",
           "wan_ti2v": "FlowGRPOWanPipeline", "qwen_image_edit": "FlowGRPOQwenImageEditPipeline"}
SEEDS = [3, 4, 5, 6]
FIELDS = ("images", "latents", "next_latents", "log_probs", "prompt_embeds", "sigmas", "window_start", "seeds")
OPTIONAL = ("negative_prompt_embeds", "pooled_embeds", "negative_pooled_embeds", "distilled_guidance", "cond_latents")
# Measured (fp32, 2 shared cores), the served tp-2 engines against the diffusers engines, largest over images,
# latents and log-probs: SD3.5 3.2e-6, FLUX.1 2.1e-6, Wan2.2 2.5e-6, Qwen-Image-Edit 8.3e-7 (log-probs <= 1.2e-7).
TOL = 2e-5


def _folder(root: Path, family: str) -> tuple[Path, list[str]]:
    """The family's offline tiny folder (seed 0) and two prompts for it (Qwen-Image-Edit: records of two source
    images of different sizes; Wan: the head-dim-12 folder, whose RoPE vLLM-Omni's Wan transformer splits as
    diffusers does)."""
    prompts = ["a red cat", 'a sign that says "OPEN"']
    if family == "wan":
        from tests.distributed.test_wan_vllm_omni import make_folder

        return make_folder(root), prompts
    if family == "wan_ti2v":  # the TI2V folder with head dim 12, two image records (a gradient, a checkerboard)
        from tests.distributed.test_wan_vllm_omni import image_records, make_ti2v_folder

        return make_ti2v_folder(root), image_records(root)
    if family == "qwen_image_edit":
        import numpy as np
        from PIL import Image

        from model_providers.qwen_image_edit.data import EditRecord
        from model_providers.qwen_image_edit.tiny_pipeline import make_tiny_edit_pipeline

        rng, records = np.random.RandomState(1), []
        for i, (word, size) in enumerate((("CAT", (64, 64)), ("DOG", (80, 64)))):
            path = root / f"source{i}.png"
            Image.fromarray((rng.rand(size[1], size[0], 3) * 255).astype("uint8")).save(path)
            records.append(EditRecord(str(path), f"write {word}").prompt)
        return make_tiny_edit_pipeline(root / "edit", seed=0), records
    from model_providers import get_family

    return Path(get_family(family).tiny_pipeline.make(root / family, 0)), prompts


def _start(folder: Path, tp: int, quantization: Any = None, vae_dtype: torch.dtype | None = None):
    """The engine as its owning rank starts it: `start_omni` (worker processes, sleep mode on) behind the client,
    the folder's weights loaded (quantized in when `quantization` asks), its VAE in `vae_dtype` (None: fp32, the
    model's). Returns (engine, seconds to start)."""
    from megatron_omni.rollout.quantization import QuantizationSpec
    from megatron_omni.rollout.vllm_omni.engine import VllmOmniRolloutEngine, pipeline_class_of, start_omni

    quantization = quantization or QuantizationSpec()
    started = time.monotonic()
    omni = start_omni(folder, tp, SimpleNamespace(dtype=torch.float32, quantization=quantization, vae_dtype=vae_dtype),
                      pipeline_class_of(folder)[0])
    engine = VllmOmniRolloutEngine(folder, tp, torch.float32, omni=omni, quantization=quantization)
    engine.load_initial_weights()
    return engine, time.monotonic() - started


def _reference(folder: Path, quantization: Any = None):
    from megatron_omni.rollout.registry import EngineSettings, build_engine

    return build_engine("diffusers", folder, EngineSettings(tp=1, dtype=torch.float32, max_batch_size=4,
                                                            **({} if quantization is None
                                                               else {"quantization": quantization})))


def _diff(a, b) -> dict[str, float]:
    return trajectory_diff(a, b, FIELDS, optional=OPTIONAL, meta=("prompts", "img_shape", "cfg_rescale",
                                                                   "cond_shapes", "clean_tokens"))


def _error(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 (the caller asserts which one)
        return str(e)
    return "no error"


# Every family at rollout tp 2; SD3.5 also at tp 4 (four worker processes, the tiny transformer's 4 heads one per
# rank, as SD3.5-Medium's 24 split 4 and 8 ways). The tiny FLUX.1 cannot: vLLM-Omni shards its text encoder too,
# whose tiny config has 2 heads (the workers refuse tp 4 at start-up: "num_heads (2) must be divisible by tp_size").
SERVED = [*((family, 2) for family in PARAMS), ("sd3", 4)]


@pytest.fixture(scope="module", params=SERVED, ids=[f"{family}-tp{tp}" for family, tp in SERVED])
def served(request, tmp_path_factory) -> dict[str, Any]:
    """One family's engine at rollout tp 2 (or 4), used and closed: its workers' reports, its trajectories against
    the diffusers engine before and after a bucketed update of perturbed weights, and what a partial update
    raised."""
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims

    install_import_shims()
    family, tp = request.param
    folder, prompts = _folder(tmp_path_factory.mktemp(f"served_{family}_tp{tp}"), family)
    params, ref = PARAMS[family], _reference(folder)
    engine, start_s = _start(folder, tp=tp)
    res: dict[str, Any] = {"family": family, "tp": tp, "start_s": start_s}
    try:
        res["reports"] = engine._rpc("platform_report")[0]
        seen: list = []
        got = engine.generate(prompts, params, group_size=2, seeds=SEEDS, on_sample=seen.append)
        res["seen"] = sorted(s.index for s in seen)
        res["shape"] = (tuple(got.images.shape), tuple(got.log_probs.shape))
        res["clean_tokens"] = got.clean_tokens
        res["parity"] = _diff(got, ref.generate(prompts, params, group_size=2, seeds=SEEDS))
        weights = perturbed({k: v.detach().clone() for k, v in ref._policy_transformer().named_parameters()}, 100)
        engine.bucket_bytes = 64 * 1024  # several buckets
        res["sent"] = sorted(engine.load_weights(weights.items())) == sorted(weights)
        ref.load_weights(weights.items())
        after = engine.generate(prompts, params, seeds=SEEDS[::2])
        res["updated"] = _diff(after, ref.generate(prompts, params, seeds=SEEDS[::2]))
        res["moved"] = float((after.images - got.images[::2]).abs().max())
        res["missing"] = sorted(weights)[0]
        res["partial"] = _error(engine.load_weights, [(k, v) for k, v in weights.items() if k != res["missing"]])
        res["n_tensors"] = len(weights)
    finally:
        engine.close()
    print(f"{family}: served engine (tp {tp}, worker processes) started in {start_s:.1f} s; vs diffusers max |diff|",
          {k: f"{v:.1e}" for k, v in res["parity"].items()}, "after the update",
          {k: f"{v:.1e}" for k, v in res["updated"].items()})
    return res


def test_the_family_pipeline_serves_from_forked_worker_processes(served: dict) -> None:
    reports, tp = served["reports"], served["tp"]
    assert len(reports) == tp and len({r["pid"] for r in reports}) == tp, reports
    servers = fork_servers(os.getpid())
    assert len(servers) == 1 and {r["parent_pid"] for r in reports} == {servers[0]}, (servers, reports)
    for r in reports:
        assert r["pipeline"] == CLASSES[served["family"]], r
        assert (r["platform"], r["attention"], r["tp_size"]) == ("CpuOmniPlatform", ["CpuSDPAImpl"], tp), r
        assert r["empty_linear_weights"] == 0 and r["linears"] > 0 and r["fp8_linear_weights"] == 0, r
        assert r["vae_dtype"] == "torch.float32", r  # `rollout.vae_dtype=auto`: the model's


def test_trajectories_equal_the_diffusers_engines(served: dict) -> None:
    assert served["seen"] == [0, 1, 2, 3]  # every sample reported as it finished
    params = PARAMS[served["family"]]
    frames = (params.num_frames,) if params.num_frames > 1 else ()  # [N, F, C, H, W] for a video
    assert served["shape"] == ((4, *frames, 3, params.height, params.height), (4, 2)), served["shape"]
    assert max(served["parity"].values()) <= TOL, served["parity"]
    if served["family"] == "wan_ti2v":  # the first latent frame's 4 tokens clean on both engines (meta: equal)
        assert served["clean_tokens"] == 4, served["clean_tokens"]


def test_a_bucketed_update_reaches_the_next_rollout_and_a_partial_one_is_refused(served: dict) -> None:
    assert served["sent"]
    assert served["moved"] > 1e-2, served["moved"]
    assert max(served["updated"].values()) <= TOL, served["updated"]
    # refused by the workers (vLLM-Omni's RPC error names each rank's), naming the tensor that was not sent
    partial = served["partial"]
    assert f"partial weight update: 1 of {served['n_tensors']} transformer tensors were not sent" in partial, partial
    assert served["missing"] in partial and all(f"rank {r}" in partial for r in range(served["tp"])), partial


# FLUX.1 at tp 1 and SD3.5 at tp 2: what the worker processes add to FP8 (the quantized load through our receiver,
# the bucketed update, the probe over RPC) is the same code for both families, and each family's FP8 linears at both
# tp sizes are checked in the trainer's ranks (test_image_vllm_omni.py::test_fp8_rollout_on_vllm_omni). SD3.5 takes
# tp 2 because its row-parallel FP8 linears see sharded inputs there (FLUX.1 quantizes none of its row-parallel ones).
@pytest.fixture(scope="module", params=[("flux", 1), ("sd3", 2)], ids=["flux-tp1", "sd3-tp2"])
def served_fp8(request, tmp_path_factory) -> dict[str, Any]:
    """One family's FP8 engine at rollout tp 1 or 2 (one worker process per tp rank), its VAE in bf16
    (`rollout.vae_dtype=bf16`: what the worker's pipeline class reads from `custom_pipeline_args`; the probe does not
    decode): its reports, and its probe of the fixed probe batch against the unquantized and the fake-quantized
    diffusers engines, before and after an update."""
    from megatron_omni.rollout.probe import PROBE_DISTILLED_GUIDANCE, probe_trajectory
    from megatron_omni.rollout.quantization import QuantizationSpec
    from megatron_omni.rollout.vllm_omni.plugin import install_import_shims
    from model_providers import get_family

    install_import_shims()
    name, tp = request.param
    family = get_family(name)
    folder, _ = _folder(tmp_path_factory.mktemp(f"fp8_{name}"), name)
    spec = QuantizationSpec("fp8", tuple(family.quantized_linears))
    hf_cfg = {k: v for k, v in json.loads((folder / "transformer" / "config.json").read_text()).items()
              if not k.startswith("_")}
    traits = family.traits
    probe = probe_trajectory(hf_cfg, channels=traits.token_channels(hf_cfg), text_dim=int(hf_cfg[traits.text_dim_key]),
                             pooled_dim=int(hf_cfg[traits.pooled_dim_key]),
                             distilled_guidance=PROBE_DISTILLED_GUIDANCE if hf_cfg.get("guidance_embeds") else None)
    ref, fake = _reference(folder), _reference(folder, spec)
    engine, start_s = _start(folder, tp=tp, quantization=spec, vae_dtype=torch.bfloat16)
    res: dict[str, Any] = {"family": name, "tp": tp, "spec": spec, "probe": probe, "start_s": start_s}
    try:
        res["reports"] = engine._rpc("platform_report")[0]
        res["means"] = {"before": engine.probe(probe), "unquantized": ref.probe(probe), "fake": fake.probe(probe)}
        weights = perturbed({k: v.detach().clone() for k, v in ref._policy_transformer().named_parameters()}, 100)
        engine.bucket_bytes = 64 * 1024
        engine.load_weights(weights.items())
        for e in (ref, fake):
            e.load_weights(weights.items())
        res["means"].update(after=engine.probe(probe), unquantized_after=ref.probe(probe), fake_after=fake.probe(probe))
    finally:
        engine.close()
    return res


def test_fp8_engine_in_a_worker_process_passes_the_trainers_quantized_probe(served_fp8: dict) -> None:
    """The quantized probe the trainer runs after every sync (`probe.check_quantized_probe`, the dtype tolerance and
    the quantizer's bound) passes before and after the update, and fails for the stale weights. At tp 1 the engine
    sits nearer ModelOpt's fake quantization of the same weights than the unquantized model (an fp32 difference in
    a GEMM can flip one FP8 rounding, so not equal: measured 1.2e-7 and 5.4e-4 against 2.5e-3); at tp 2 a row-parallel
    FP8 linear scales each token's input by its shard's max, a rounding of its own (test_image_vllm_omni.py), so only
    the trainer's bound holds there."""
    from megatron_omni.rollout.probe import ProbeMismatch, check_quantized_probe, probe_tolerance
    from megatron_omni.rollout.quantization import probe_relative_tolerance

    reports = served_fp8["reports"]
    assert len(reports) == served_fp8["tp"] and os.getpid() not in {r["pid"] for r in reports}, reports
    for report in reports:
        assert report["fp8_linear_weights"] > 0 and report["tp_size"] == served_fp8["tp"], report
        assert report["vae_dtype"] == "torch.bfloat16", report
    m, probe = served_fp8["means"], served_fp8["probe"]
    tol, rel = probe_tolerance(torch.float32, torch.float32), probe_relative_tolerance(served_fp8["spec"])
    checks = {when: check_quantized_probe(m[when], m[unquantized], probe, tol, rel, when)
              for when, unquantized in (("before", "unquantized"), ("after", "unquantized_after"))}
    with pytest.raises(ProbeMismatch, match="stale"):
        check_quantized_probe(m["before"], m["unquantized_after"], probe, tol, rel, "stale")
    for when, fake, unquantized in (("before", "fake", "unquantized"), ("after", "fake_after", "unquantized_after")):
        vs_fake = float((m[when] - m[fake]).abs().max())
        vs_unquantized = float((m[when] - m[unquantized]).abs().max())
        print(f"{served_fp8['family']} FP8 served (tp {served_fp8['tp']}) {when} the update: probe vs fake "
              f"quantization {vs_fake:.1e}, vs unquantized {vs_unquantized:.1e} (bound {checks[when].bound:.1e}); "
              f"started in {served_fp8['start_s']:.1f} s")
        if served_fp8["tp"] == 1:
            assert vs_fake <= 0.5 * vs_unquantized, (when, vs_fake, vs_unquantized)
