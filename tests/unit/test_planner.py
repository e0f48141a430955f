"""Dry-run planner: parameter counts equal the provider's exact per-rank counts, the activation model equals
what our block really saves for backward, the FLOPs of one 20B forward equal a hand count, memory moves
the right way with recompute and TP, and impossible layouts fail with a message naming the problem."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_omni.parallel.layout import LayoutError, ParallelLayout
from megatron_omni.parallel.rank_pool import run_ranks
from megatron_omni.planner import (
    GPUS,
    REFERENCE_IMAGES_PER_S_PER_GPU,
    LoRASpec,
    Precision,
    RolloutSpec,
    Workload,
    memory,
    plan,
)
from megatron_omni.planner.flops import forward_flops, image_tokens, lora_forward_flops
from megatron_omni.planner.memory import (
    block_activation_bytes,
    rank_parameter_counts,
    rollout_parameter_count,
)
from model_providers.qwen_image import provider
from model_providers.qwen_image.presets import PARAMS_20B
from tests.unit.saved_tensors import block_saved_bytes


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("name", ["tiny", "small", "20b"])
def test_parameter_counts_equal_provider_at_every_tp_pp(name: str) -> None:
    cfg = provider.hf_config(name)
    checked = 0
    for tp in _divisors(cfg["num_attention_heads"]):
        for pp in _divisors(cfg["num_layers"]):
            assert rank_parameter_counts(name, tp, pp) == provider.per_rank_parameter_counts(name, tp, pp), (tp, pp)
            checked += 1
    assert checked >= 4
    assert rank_parameter_counts("20b", 1) == [PARAMS_20B]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 2), (8, 4), (2, 3)])
def test_plan_memory_uses_exact_counts(tp: int, pp: int) -> None:
    world = tp * pp * 2
    report = plan("20b", ParallelLayout(tp=tp, pp=pp), world, "H200", Workload(), recompute="full")
    exact = provider.per_rank_parameter_counts("20b", tp, pp)
    prec = Precision()
    assert report.stage_parameters == exact
    assert report.memory.parameters == prec.param_bytes * max(exact)
    assert report.memory.gradients == prec.grad_bytes * max(exact)
    assert report.memory.optimizer_states == -(-prec.optimizer_bytes * max(exact) // 2)  # dp=2


def test_rollout_weights_replicate_adaln() -> None:
    full = rollout_parameter_count("20b", 1)
    assert full == PARAMS_20B
    # adaLN (img_mod/txt_mod, 6.8B) stays whole on every vLLM-Omni rank, so tp=4 keeps far more than 1/4.
    adaln = sum(6 * 3072 * 3072 + 6 * 3072 for _ in range(120))
    assert 6.7e9 < adaln < 6.9e9
    at4 = rollout_parameter_count("20b", 4)
    assert at4 > adaln + (full - adaln) / 4 - 1e8 and at4 < adaln + (full - adaln) / 4 + 1e8


def test_forward_flops_20b_512_matches_hand_count() -> None:
    # 512x512 -> 64x64 latent -> 32x32 patches = 1024 image tokens, + 256 text tokens = s 1280.
    assert image_tokens("20b", 512, 512) == 1024
    h, layers, s = 3072, 60, 1280
    # per block and stream per token: QKV 3h^2 + out h^2 + MLP 8h^2 = 12 h^2 MACs = 24 h^2 FLOPs;
    # joint attention 4 s^2 h per block:  17.39e12 + 1.21e12 = 18.60e12; less the last block's text output
    # projection and MLP, which the model skips (9 h^2 MACs per text token): 18.60e12 - 0.04e12, and its text
    # queries' attention (image queries only there: 4 s_img s h): - 0.004e12.
    attention = 4 * s * s * h * (layers - 1) + 4 * 1024 * s * h
    hand = 24 * h * h * s * layers + attention - 18 * h * h * 256
    assert abs(hand - 18.5551e12) < 1e9
    f = forward_flops("20b", 1024, 256)
    # the rest (adaLN on the timestep embedding, img_in, txt_in, proj_out, embedders) is about 0.02e12
    assert hand < f.total < hand * 1.002, f.total / 1e12
    assert f.attention == attention
    assert abs(f.image_linear - 24 * h * h * 1024 * layers) / f.image_linear < 1e-3
    assert f.qkv_linear == 2 * 3 * h * h * s * layers


def test_flops_split_over_context_parallel() -> None:
    f = forward_flops("20b", 4096, 256)
    # text stream replicated over cp: 4 CP ranks do more than a quarter of the work each
    assert f.per_rank(1, 4, 1) > f.total / 4
    assert f.per_rank(1, 4, 1) == pytest.approx((f.image_linear + f.attention) / 4 + f.text_linear + f.per_sample)
    assert f.per_rank(4, 1, 2) == pytest.approx(f.total / 8)


def test_memory_monotonic_in_recompute_and_tp() -> None:
    wl = Workload(micro_batch_size=4)
    by_mode = {m: plan("20b", ParallelLayout(tp=2), 8, "H200", wl, recompute=m).memory for m in
               ("none", "selective", "full")}
    assert by_mode["none"].activations > by_mode["selective"].activations > by_mode["full"].activations
    assert by_mode["none"].total > by_mode["selective"].total > by_mode["full"].total
    assert by_mode["none"].activations_no_recompute == by_mode["none"].activations
    assert by_mode["none"].activations_full_recompute == by_mode["full"].activations
    prev = None
    for tp in (1, 2, 4, 8):
        m = plan("20b", ParallelLayout(tp=tp), 8, "H200", wl, rollout=RolloutSpec(tp=tp), recompute="none").memory
        if prev is not None:
            assert m.parameters < prev.parameters and m.activations < prev.activations
            assert m.rollout_weights < prev.rollout_weights and m.total < prev.total
        prev = m
    assert not plan("20b", ParallelLayout(tp=1), 8, "H800", wl).memory.fits  # 20B x 6 bytes alone > 80 GB
    assert plan("20b", ParallelLayout(tp=4), 8, "H200", wl, rollout=RolloutSpec(tp=4)).memory.fits


def test_time_model_accounting() -> None:
    wl = Workload(micro_batch_size=2)
    base = plan("20b", ParallelLayout(tp=2), 8, "H200", wl)
    t = base.time
    assert t.step_s == pytest.approx(t.rollout_s + t.old_logprob_s + t.train_s + t.sync_s) and t.sync_s > 0
    assert t.images_per_s_per_gpu == pytest.approx(512 / (t.step_s * 8))
    # rollout compute: 512 images x 10 forwards at MFU (+ text encoder, + TP all-reduces at rollout tp=1: none)
    compute = 512 * 10 * base.flops.total / (8 * GPUS["H200"].peak_bf16_flops * 0.35)
    assert compute < t.rollout_s < compute * 1.01
    cfg = plan("20b", ParallelLayout(tp=2), 8, "H200", dataclasses.replace(wl, cfg=True))
    assert cfg.time.rollout_s == pytest.approx(2 * t.rollout_s, rel=1e-6)
    assert cfg.memory.activations == 2 * base.memory.activations
    no_old = plan("20b", ParallelLayout(tp=2), 8, "H200", dataclasses.replace(wl, recompute_old_logprob=False))
    assert no_old.time.old_logprob_s == 0 and no_old.time.step_s < t.step_s
    slower = plan("20b", ParallelLayout(tp=2), 8, "H200", wl, mfu=0.175)
    assert slower.time.rollout_s > 1.9 * t.rollout_s
    # pipeline bubble: (pp - 1) / micro-batches
    piped = plan("20b", ParallelLayout(tp=2, pp=2), 8, "H200", wl)
    assert piped.time.bubble_fraction == pytest.approx(1 / piped.micro_batches)
    # H800 has the same peak but a slower NVLink: TP all-reduces cost more
    h800 = plan("20b", ParallelLayout(tp=2), 8, "H800", wl)
    assert h800.time.communication_s > t.communication_s and h800.memory.capacity < base.memory.capacity
    assert "0.510" in base.table() and "MFU 0.35" in base.table()
    assert base.ratio_to_reference == pytest.approx(t.images_per_s_per_gpu / REFERENCE_IMAGES_PER_S_PER_GPU)


@pytest.mark.parametrize(
    "layout,world,workload,message",
    [
        (ParallelLayout(tp=16), 16, Workload(), "attention heads 24 are not divisible by tp=16"),
        (ParallelLayout(tp=8, ulysses=2), 16, Workload(), "heads per tensor-parallel rank 3 are not divisible by "
                                                         "ulysses=2"),
        (ParallelLayout(pp=7), 7, Workload(prompts=28, group_size=16), "60 transformer blocks are not divisible"),
        (ParallelLayout(ulysses=3), 3, Workload(prompts=24, group_size=16), "1024 image tokens are not divisible "
                                                                             "by cp=3"),
        (ParallelLayout(tp=8), 12, Workload(), "world size 12 is not divisible by tp\\*ulysses\\*ring\\*pp"),
        (ParallelLayout(tp=2), 8, Workload(height=500), "image height 500 must be a positive multiple"),
        (ParallelLayout(tp=2), 8, Workload(prompts=3, group_size=3), "9 images per step .* not divisible by 2 "
                                                                      "mini-batches"),
        (ParallelLayout(tp=1), 8, Workload(prompts=4, group_size=3), "6 images per mini-batch are not divisible "
                                                                      "by dp=8"),
        (ParallelLayout(tp=2), 8, Workload(micro_batch_size=3), "not divisible by micro-batch size 3"),
        (ParallelLayout(tp=2), 8, Workload(window=11), "window 11 is longer than the 10 sampling steps"),
    ],
)
def test_impossible_layouts_fail_with_a_message(layout, world, workload, message) -> None:
    with pytest.raises(LayoutError, match=message):
        plan("20b", layout, world, "H200", workload)


def test_bad_options_fail_with_a_message() -> None:
    with pytest.raises(LayoutError, match="rollout tp=5"):
        plan("20b", ParallelLayout(tp=2), 8, rollout=RolloutSpec(tp=5))
    with pytest.raises(LayoutError, match="needs its own GPU count"):
        plan("20b", ParallelLayout(tp=2), 8, rollout=RolloutSpec(colocated=False))
    with pytest.raises(LayoutError, match="unknown GPU kind 'A100'"):
        plan("20b", ParallelLayout(tp=2), 8, "A100")
    with pytest.raises(LayoutError, match="mfu=1.5 must be in"):
        plan("20b", ParallelLayout(tp=2), 8, mfu=1.5)
    with pytest.raises(LayoutError, match="unknown recompute mode 'some'"):
        plan("20b", ParallelLayout(tp=2), 8, recompute="some")


def test_separate_rollout_gpus_count_in_throughput() -> None:
    wl = Workload(micro_batch_size=2)
    own = plan("20b", ParallelLayout(tp=2), 8, "H200", wl, rollout=RolloutSpec(tp=2, colocated=False, gpus=8))
    assert own.gpus == 16 and own.memory.rollout_weights == 0
    assert own.time.images_per_s_per_gpu == pytest.approx(512 / (own.time.step_s * 16))


def test_precision_of_config_dtypes() -> None:
    bf16 = Precision.of("bf16", "bf16", True)
    assert (bf16.param_bytes, bf16.grad_bytes, bf16.optimizer_bytes, bf16.activation_bytes) == (2, 4, 12, 2)
    fp32 = Precision.of("fp32", "bf16", False)  # fp32 weights are the main weights: Adam m, v only
    assert (fp32.param_bytes, fp32.optimizer_bytes, fp32.activation_bytes, fp32.rollout_param_bytes) == (4, 8, 4, 2)
    assert not fp32.distributed_optimizer
    with pytest.raises(LayoutError, match="model.params_dtype='fp16'"):
        Precision.of("fp16", "bf16", False)
    wl = Workload(micro_batch_size=2)
    full = plan("20b", ParallelLayout(tp=8), 16, "H200", wl, precision=Precision.of("fp32", "fp32", False))
    mixed = plan("20b", ParallelLayout(tp=8), 16, "H200", wl, precision=Precision.of("bf16", "bf16", False))
    assert full.memory.parameters == 2 * mixed.memory.parameters
    assert full.memory.rollout_weights == 2 * mixed.memory.rollout_weights


def test_sleeping_engine_frees_its_weights_during_the_update() -> None:
    wl = Workload(micro_batch_size=2)
    awake = plan("20b", ParallelLayout(tp=8), 16, "H200", wl, rollout=RolloutSpec(tp=1), recompute="none")
    asleep = plan("20b", ParallelLayout(tp=8), 16, "H200", wl, rollout=RolloutSpec(tp=1, sleeps=True),
                  recompute="none")
    m, a = asleep.memory, awake.memory
    state = m.parameters + m.gradients + m.optimizer_states + m.reserve
    assert m.total == state + max(m.rollout_weights + m.rollout_activations, m.activations)
    assert a.total == state + m.rollout_weights + max(m.rollout_activations, m.activations)
    assert m.total < a.total and "engine asleep during the update" in asleep.table()


def test_weight_sync_time_direct_vs_full() -> None:
    wl = Workload(micro_batch_size=2)
    direct = plan("20b", ParallelLayout(tp=8), 16, "H200", wl, rollout=RolloutSpec(tp=8))
    full = plan("20b", ParallelLayout(tp=8), 16, "H200", wl, rollout=RolloutSpec(tp=1))
    gpu = GPUS["H200"]
    assert direct.time.sync_s == pytest.approx(2 * rollout_parameter_count("20b", 8) / gpu.hbm_bytes_per_s)
    assert full.time.sync_s == pytest.approx(2 * rollout_parameter_count("20b", 1) / (gpu.link_bytes_per_s * 0.7))
    assert "weight sync" in full.table()
    # vLLM-Omni's workers are other processes: full tensors over the links even at the trainer's tp
    rpc = plan("20b", ParallelLayout(tp=8), 16, "H200", wl, rollout=RolloutSpec(tp=8, in_process=False))
    assert rpc.time.sync_s == pytest.approx(2 * rollout_parameter_count("20b", 8) / (gpu.link_bytes_per_s * 0.7))


def test_measured_mfu_file(tmp_path) -> None:
    from megatron_omni.planner import measured_mfu

    good = tmp_path / "gpu_check.json"
    good.write_text('{"mfu": 0.41, "gpu": "H200"}')
    assert measured_mfu(str(good)) == 0.41
    bad = (('{"mfu": 1.5}', "must be a number in"), ('{"gpu": "H200"}', "got None"), ("{", "not a JSON"))
    for text, message in bad:
        good.write_text(text)
        with pytest.raises(ValueError, match=message):
            measured_mfu(str(good))
    with pytest.raises(ValueError, match="no such file"):
        measured_mfu(str(tmp_path / "missing.json"))


# ---------------------------------------------------- activation model against the real block (spawned ranks)

S_IMG, S_TXT, BATCH = 512, 64, 2


def _saved_bytes(rank: int, world_size: int) -> dict[str, tuple[int, int]]:
    """Per recompute mode: bytes of non-parameter tensors one MMDiT block (`small` preset, fp32) saves for
    its backward, and the hidden size."""
    return {mode: _saved_bytes_one(world_size, mode) for mode in ("none", "selective", "full")}


def _saved_bytes_one(world_size: int, recompute: str) -> tuple[int, int]:
    from megatron_omni.models.dit.embeddings import qwen_rope_angles, rope_rotations
    from megatron_omni.parallel import build_parallel_groups

    groups = build_parallel_groups(ParallelLayout(tp=world_size))
    over = {"selective": dict(recompute_granularity="selective")}.get(recompute, {})
    tc = provider.transformer_config(dict(provider.preset("small"), num_layers=1), tp=world_size, **over)
    model = provider.build_model(tc, groups).train()
    h = tc.hidden_size
    img = torch.randn(S_IMG, BATCH, h, requires_grad=True)
    txt = torch.randn(S_TXT, BATCH, h, requires_grad=True)
    temb = torch.randn(BATCH, h)
    ia, ta = (rope_rotations(a) for a in qwen_rope_angles(1, 16, S_IMG // 16, S_TXT, tuple(tc.axes_dims_rope),
                                                          tc.rope_theta))
    # RoPE rotations are computed once per forward and shared by every block: not a per-block activation.
    return block_saved_bytes(model.layers[0], (img, txt, temb, ia, ta, None), recompute,
                             [*model.parameters(), ia, ta]), h


@pytest.mark.parametrize("tp", [1, 2])
def test_activation_model_matches_saved_tensors(tp: int) -> None:
    for mode, (measured, h) in run_ranks(_saved_bytes, tp, timeout_s=300)[0].items():
        predicted = block_activation_bytes(h, S_IMG + S_TXT, BATCH, tp, mode, act_bytes=4)
        # the remainder: per-token norm statistics, the [b, h] modulation vectors (~3%)
        print(f"tp={tp} {mode}: measured {measured} predicted {predicted}")
        assert predicted <= measured < 1.05 * predicted, (mode, measured, predicted)


# Jobs that do not fit, through the entry point's dry run: (recipe, world size, GPU kind, overrides, whether
# some change fits). The first is issue 26's reproduction (the 4-node script on H800 with full recompute).
NOT_FITTING = {
    "4nodes_h800_full_recompute": ("ocr_20b_4nodes", 32, "H800", ["model.recompute=full"], True),
    "2nodes_h800_tp2": ("ocr_20b_2nodes", 16, "H800", ["parallel.tp=2"], True),
    "1node_h800_2048px": ("ocr_20b_1node", 6, "H800", ["rollout.height=2048", "rollout.width=2048"], False),
}


def _dry_run(monkeypatch: pytest.MonkeyPatch, capsys, recipe: str, world: int, gpu: str,
             overrides: list[str]) -> tuple[int, str, str]:
    from megatron_omni.train import main

    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("MODEL_BACKEND", "local")
    monkeypatch.delenv("QWEN_IMAGE_PIPELINE", raising=False)
    monkeypatch.delenv("OCR_PROMPTS", raising=False)
    args = ["--dry-run", "--gpu", gpu, "--recipe", f"examples.qwen_image.recipe:{recipe}"]
    rc = main(args + [x for o in overrides for x in ("--set", o)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("case", sorted(NOT_FITTING))
def test_advice_lists_only_changes_that_fit(case: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Every change a 'does not fit' dry run suggests, applied (its --set overrides, its WORLD_SIZE), plans as
    fitting (rc 0); when nothing fits the message says so instead of suggesting anything."""
    recipe, world, gpu, overrides, some_fit = NOT_FITTING[case]
    rc, out, err = _dry_run(monkeypatch, capsys, recipe, world, gpu, overrides)
    assert rc == 3 and "DOES NOT FIT" in out, out[-1500:]
    lines = out.split("changes that fit", 1)[1].splitlines()[1:] if "changes that fit" in out else []
    advice = [line.split("  -> ")[0].split() for line in lines if line.startswith("  ") and "  -> " in line]
    assert bool(advice) == some_fit, out[-1500:]
    if not some_fit:
        assert "no change the planner tried fits" in err, err
        return
    assert "try one of the changes listed above" in err, err
    for words in advice:
        size = world
        extra = []
        for i, word in enumerate(words):
            if word.startswith("WORLD_SIZE="):
                size = int(word.split("=")[1])
            elif word == "--set":
                extra.append(words[i + 1])
        assert extra or size != world, words
        rc2, out2, err2 = _dry_run(monkeypatch, capsys, recipe, size, gpu, overrides + extra)
        assert rc2 == 0, f"suggested {' '.join(words)} but it plans as rc {rc2}:\n{out2[-1500:]}\n{err2}"
        assert "dry run OK" in out2


# --- LoRA (model.lora.rank > 0): the base frozen beside the adapters, which alone train.
LORA_TARGETS = ("*.linear_qkv", "*.linear_proj", "*.linear_fc1", "*.linear_fc2")


def _hand_adapter_count(name: str, r: int, tp: int, adaln: bool = False) -> int:
    """Adapter parameters on one rank (pp=1), by hand: a linear [out, in] gets A [r, in] and B [out, r];
    column-parallel (qkv [3h, h], fc1 [4h, h], adaln [6h, h]) keeps A whole and splits B's rows, row-parallel
    (proj [h, h], fc2 [h, 4h]) splits A's columns and keeps B whole."""
    cfg = provider.hf_config(name)
    h = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    column = lambda out, inp: r * inp + out // tp * r  # noqa: E731
    row = lambda out, inp: r * inp // tp + out * r  # noqa: E731
    per_stream = column(3 * h, h) + row(h, h) + column(4 * h, h) + row(h, 4 * h)
    if adaln:
        per_stream += column(6 * h, h)
    return 2 * cfg["num_layers"] * per_stream  # two streams per block


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("adaln", [False, True])
def test_lora_gradients_and_optimizer_states_are_the_adapters_exactly(tp: int, adaln: bool) -> None:
    targets = LORA_TARGETS + (("*.adaln",) if adaln else ())
    r, world = 8, 2 * tp  # dp=2: the distributed optimizer shards Adam over 2
    count = _hand_adapter_count("small", r, tp, adaln)
    h = 256
    assert count == 2 * 4 * r * h * ((4 + 12 / tp) + ((1 + 6 / tp) if adaln else 0))  # the same, summed up
    report = plan("small", ParallelLayout(tp=tp), world, "H200", Workload(), recompute="none",
                  lora=LoRASpec(r, targets, 16.0))
    prec = Precision()
    m = report.memory
    assert m.gradients == prec.grad_bytes * count
    assert m.optimizer_states == -(-prec.optimizer_bytes * count // 2)
    base = provider.per_rank_parameter_counts("small", tp)
    assert m.parameters == prec.param_bytes * (base[0] + count)  # the base stays, beside the adapters
    assert report.lora is not None and report.lora.stage_adapters == [count]
    assert report.lora.modules == 4 * 2 * (5 if adaln else 4)
    assert report.lora.total == _hand_adapter_count("small", r, 1, adaln)  # the whole model: every shard once
    line = next(x for x in report.table().splitlines() if x.startswith("LoRA:"))
    assert f"rank {r}, alpha 16 on {report.lora.modules} linears" in line and "adapter parameters" in line
    # the replicated optimizer: not sharded
    rep = plan("small", ParallelLayout(tp=tp), world, "H200", Workload(), recompute="none",
               precision=Precision(distributed_optimizer=False), lora=LoRASpec(r, targets))
    assert rep.memory.optimizer_states == prec.optimizer_bytes * count


def test_lora_adapters_per_pipeline_stage() -> None:
    # only block 0's image stream: all on the first stage; the fullest stage's adapters count
    c = memory.lora_adapter_counts("small", 2, 2, 4, ["layers.0.img.*"])
    assert c.modules == ("layers.0.img.adaln", "layers.0.img.linear_qkv", "layers.0.img.linear_proj",
                         "layers.0.img.linear_fc1", "layers.0.img.linear_fc2")
    assert c.per_stage == [_hand_adapter_count("small", 4, 2, adaln=True) // 8, 0]
    with pytest.raises(ValueError, match=r"LoRA targets \['\*.to_q'\] match no tensor-parallel linear"):
        memory.lora_adapter_counts("small", 1, 1, 4, ["*.linear_qkv", "*.to_q"])
    with pytest.raises(LayoutError, match="match no tensor-parallel linear"):
        plan("small", ParallelLayout(), 2, lora=LoRASpec(4, ("*.to_q",)))


def test_lora_rank_0_plans_exactly_as_full_fine_tuning() -> None:
    for layout, world, rc in ((ParallelLayout(tp=4), 8, "none"), (ParallelLayout(tp=2, pp=2), 8, "full"),
                              (ParallelLayout(tp=2, ulysses=2), 8, "selective")):
        full = plan("20b", layout, world, "H800", Workload(), recompute=rc)
        assert plan("20b", layout, world, "H800", Workload(), recompute=rc, lora=LoRASpec(0, LORA_TARGETS)) == full
        assert full.lora is None and "LoRA" not in full.table()


def test_lora_memory_and_time_below_full_fine_tuning_20b() -> None:
    wl = Workload()
    for layout, world in ((ParallelLayout(tp=4), 4), (ParallelLayout(pp=4), 4), (ParallelLayout(tp=2, pp=2), 8)):
        full = plan("20b", layout, world, "H800", wl, recompute="none")
        lora = plan("20b", layout, world, "H800", wl, recompute="none", lora=LoRASpec(64, LORA_TARGETS, 128))
        f, m = full.memory, lora.memory
        assert m.total < f.total and not f.fits
        assert f.parameters < m.parameters < 1.05 * f.parameters  # + the adapters (~2% of the base)
        assert m.gradients < f.gradients / 30 and m.optimizer_states < f.optimizer_states / 30
        assert f.activations < m.activations < 1.05 * f.activations  # + the adapters' [tokens, r]
        assert m.rollout_weights == f.rollout_weights
        assert lora.time.train_s < full.time.train_s and lora.time.rollout_s == full.time.rollout_s
        assert lora.time.old_logprob_s > full.time.old_logprob_s  # the adapters' forward
    # the VeRL-Omni H800 setting (4 GPUs, vLLM-Omni asleep during the update): LoRA fits in 80 GB at pp=4
    assert plan("20b", ParallelLayout(pp=4), 4, "H800", wl, recompute="none", rollout=RolloutSpec(sleeps=True),
                lora=LoRASpec(64, LORA_TARGETS)).memory.fits


def test_lora_training_flops_skip_the_base_weight_gradients() -> None:
    """No communication (tp=1, pp=1, the replicated optimizer): training time is FLOPs / (peak x MFU), and LoRA's
    forward + backward = (1 forward + adapters) + (the base's input gradients 1x, attention 2x, adapters 2x)."""
    wl, prec = Workload(), Precision(distributed_optimizer=False)
    full = plan("20b", ParallelLayout(), 8, "H200", wl, precision=prec, recompute="none")
    lora = plan("20b", ParallelLayout(), 8, "H200", wl, precision=prec, recompute="none",
                lora=LoRASpec(64, LORA_TARGETS))
    f = full.flops
    ad = lora_forward_flops("20b", 1024, 256, 64, LORA_TARGETS)
    h = 3072
    # qkv 4hr + proj 2hr + fc1 5hr + fc2 5hr MACs per token per stream, less the last block's text proj/MLP
    assert ad.total == 2 * 64 * h * (16 * 60 * (1024 + 256) - 12 * 256)
    assert full.time.train_s == pytest.approx(3 * f.total * 512 * 2 / 8 / (GPUS["H200"].peak_bf16_flops * 0.35))
    ratio = lora.time.train_s / full.time.train_s
    assert ratio == pytest.approx((2 * f.total + f.attention + 3 * ad.total) / (3 * f.total))
    assert 0.66 < ratio < 0.75  # about 2/3: no weight-gradient GEMMs for the base
    assert lora.flops_per_image < full.flops_per_image


def test_lora_dry_run_drops_the_kl_reference_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's JobConfig -> JobPlan: with LoRA the KL reference is the base with adapters off (no copy)."""
    from examples.qwen_image.recipe import ocr_20b
    from megatron_omni.trainer.config import apply_overrides
    from megatron_omni.trainer.dry_run import job_plan

    monkeypatch.setenv("MODEL_BACKEND", "local")
    monkeypatch.delenv("QWEN_IMAGE_PIPELINE", raising=False)
    cfg = apply_overrides(ocr_20b(), ["algorithm.beta=0.01", "parallel.pp=4"])
    full = job_plan(cfg, 4, "H800")
    assert full.lora is None and [c.label.split(" (")[0] for c in full.state_copies] == ["KL reference"]
    lora = job_plan(apply_overrides(cfg, ["model.lora.rank=64", "model.lora.adaln=true"]), 4, "H800")
    assert lora.state_copies == () and lora.lora == LoRASpec(64, LORA_TARGETS + ("*.adaln",), 128.0)
