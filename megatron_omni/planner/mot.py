"""BAGEL's Mixture-of-Transformers in the planner (a pure cost model): per-rank parameters of both experts, the
trainable share that carries gradients and Adam state (the generation expert alone when the understanding expert is
frozen), and the FLOPs of one generation step.

Context parallelism (`cp`: `parallel.ulysses` x `ring`, pp 1; docs/families-bagel.md, "Context parallelism") is
counted as the model builds it: each cp rank holds one contiguous shard of the generation tokens (image latents + 2
markers; shard sizes differ by at most one, so the largest, ceil((n + 2) / cp), is the rank's), which divides their
activations by cp; per layer it all-gathers the shards' k/v (padded to the largest shard) and keeps the gathered
k/v for the attention's backward, whose reduce-scatter moves the same bytes back (`cp_kv_gather_bytes`). The
prompt's understanding pass stays whole on every cp rank; the distributed optimizer shards over dp x cp, as
Qwen-Image's planner counts it (`planner.plan`).

Counts follow how `megatron_omni.models.bagel` builds each tensor (`model_providers.bagel.mapping` gives the
tensor-parallel dim and the pipeline stage of each); the distributed parity test checks them against the built
model's parameter counts per rank. Memory here is weights, gradients and optimizer state only (no activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_providers.bagel.mapping import all_mappings
from model_providers.bagel.provider import arch, bagel_config, megatron_shapes

GIB = 1024**3
# Tensors of the generation side that train with the generation expert (the latent position table is fixed).
_GEN_MODULES = ("time_embedder.", "vae2llm.", "llm2vae.", "decoder.final_layernorm_gen.")


def is_generation_tensor(name: str) -> bool:
    """Whether Megatron tensor `name` belongs to the generation expert (or the generation-side modules)."""
    return name.startswith(_GEN_MODULES) or (name.startswith("decoder.layers.") and "_gen." in name)


# What text-to-image never trains: the fixed latent position table, and the understanding expert's head (its final
# norm and the LM head read no generation step)
_NEVER_TRAINED = ("latent_pos_embed", "decoder.final_layernorm.", "output_layer.")


def is_trained(name: str, experts: str = "generation") -> bool:
    """Whether Megatron tensor `name` trains when `experts` ("generation" | "both", `model.bagel_experts`) train:
    the generation expert's (`is_generation_tensor`), or with "both" every tensor the loss can reach (the
    understanding expert's layers and the token embeddings too: the velocity attends to the prompt's KV cache)."""
    if experts == "generation":
        return is_generation_tensor(name)
    if experts != "both":
        raise ValueError(f"experts must be 'generation' or 'both', not {experts!r}")
    return not name.startswith(_NEVER_TRAINED)


# LoRA's default targets on BAGEL (fnmatch over Megatron module names): every parallel linear of the generation
# expert. Column-parallel (q/k/v, the fused SwiGLU fc1): A [r, in] replicated, B [out / tp, r]; row-parallel (o,
# fc2): A [r, in / tp], B [out, r] replicated (`models.lora`'s tensor-parallel rules).
GEN_LORA_TARGETS = ("decoder.layers.*.self_attention.linear_qkv_gen",
                    "decoder.layers.*.self_attention.linear_proj_gen",
                    "decoder.layers.*.mlp_gen.linear_fc1", "decoder.layers.*.mlp_gen.linear_fc2")
_ROW_PARALLEL = ("linear_proj", "linear_fc2")


def lora_parameter_counts(model: str | dict[str, Any], tp: int, pp: int = 1, rank: int = 64,
                          targets: tuple[str, ...] = GEN_LORA_TARGETS) -> list[int]:
    """Adapter parameters ([pp] counts) one tensor-parallel rank of each pipeline stage holds for LoRA of `rank`
    on the parallel linears matching `targets` (layers only: BAGEL's adapters sit on the MoT layers)."""
    from fnmatch import fnmatch

    cfg = bagel_config(model)
    n_layers = cfg["llm_config"]["num_hidden_layers"]
    if n_layers % pp:
        raise ValueError(f"{n_layers} BAGEL layers are not divisible by pp={pp}")
    out = [0] * pp
    for name, shape in megatron_shapes(cfg).items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not any(fnmatch(module, t) for t in targets):
            continue
        out_f, in_f = shape
        row = module.rsplit(".", 1)[-1].removesuffix("_gen") in _ROW_PARALLEL
        numel = rank * (in_f // tp + out_f) if row else rank * (in_f + out_f // tp)
        out[int(module.split(".")[2]) // (n_layers // pp)] += numel
    return out


def rank_parameter_counts(model: str | dict[str, Any], tp: int, pp: int = 1, trainable: str | None = None
                          ) -> list[int]:
    """Parameters one tensor-parallel rank of each pipeline stage holds ([pp] counts).

    `trainable`: None counts every parameter; "gen" only the generation expert's; "both" every one `is_trained`
    trains with both experts."""
    cfg = bagel_config(model)
    shapes = megatron_shapes(cfg)
    n_layers = cfg["llm_config"]["num_hidden_layers"]
    if n_layers % pp:
        raise ValueError(f"{n_layers} BAGEL layers are not divisible by pp={pp}")
    per_stage = n_layers // pp
    out = [0] * pp
    for m in all_mappings(n_layers, arch(cfg).qk_norm):
        if trainable is not None and not is_trained(m.megatron, "generation" if trainable == "gen" else trainable):
            continue
        numel = 1
        for s in shapes[m.megatron]:
            numel *= s
        if m.tp_dim is not None:
            numel //= tp
        stage = 0 if m.stage == "pre" else pp - 1 if m.stage == "post" else m.layer // per_stage
        out[stage] += numel
    return out


@dataclass(frozen=True)
class MoTMemory:
    """Per-GPU bytes of the most loaded pipeline stage: weights, gradients and Adam state (fp32 master + 2 moments
    for bf16 weights, 2 moments for fp32 weights) of the trainable share."""

    weights: int
    grads: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer

    def gib(self) -> str:
        return (f"weights {self.weights / GIB:.1f} GiB + grads {self.grads / GIB:.1f} GiB + optimizer "
                f"{self.optimizer / GIB:.1f} GiB = {self.total / GIB:.1f} GiB")


def mot_memory(model: str | dict[str, Any], tp: int, pp: int = 1, train: str = "gen", bf16: bool = True,
               dp: int = 1, distributed_optimizer: bool = False, lora_rank: int = 64) -> MoTMemory:
    """Weights of both experts, gradients and optimizer state of the trained share (`train`: "gen" | "both" |
    "lora": adapters of `lora_rank` on the generation expert's linears, `GEN_LORA_TARGETS`), on the most loaded
    stage; a distributed optimizer divides the optimizer state over `dp`. With LoRA the frozen base is counted
    once (its weights; no gradients, no optimizer state) and the adapters add their weights, fp32 gradients and
    Adam state."""
    if train not in ("gen", "both", "lora"):
        raise ValueError(f"train must be 'gen', 'both' or 'lora', not {train!r}")
    params = rank_parameter_counts(model, tp, pp)
    if train == "lora":
        trained = lora_parameter_counts(model, tp, pp, lora_rank)
        params = [p + a for p, a in zip(params, trained, strict=True)]
    else:
        trained = rank_parameter_counts(model, tp, pp, trainable=train)
    i = max(range(pp), key=lambda s: params[s] * (2 if bf16 else 4) + trained[s] * 16)
    width = 2 if bf16 else 4
    opt = trained[i] * (12 if bf16 else 8)
    return MoTMemory(weights=params[i] * width, grads=trained[i] * 4,
                     optimizer=opt // dp if distributed_optimizer else opt)


def generation_step_flops(model: str | dict[str, Any], image_tokens: int, prompt_tokens: int) -> int:
    """Forward FLOPs of one generation step (one CFG branch): the image tokens through the generation expert's
    linears, the 2 image markers through the understanding expert's, non-causal attention of the image query over
    [prompt KV, image query], and the LM-free projections in and out (prompt KV assumed cached)."""
    cfg = bagel_config(model)
    llm = cfg["llm_config"]
    h, ffn, n_layers = llm["hidden_size"], llm["intermediate_size"], llm["num_hidden_layers"]
    heads, groups = llm["num_attention_heads"], llm["num_key_value_heads"]
    d = h // heads
    linear = h * (heads + 2 * groups) * d + heads * d * h + 3 * h * ffn  # qkv, o, gate/up/down per token
    q = image_tokens + 2
    attn = 2 * 2 * q * (prompt_tokens + q) * heads * d  # QK^T and AV
    p = arch(cfg).patch_latent_dim
    io = 2 * image_tokens * (2 * p * h) + 2 * image_tokens * (256 * h + h * h)  # vae2llm, llm2vae, time embedder
    return n_layers * (2 * q * linear + attn) + io


# Megatron's activation estimate per layer and token without recomputation, bf16: 34 h bytes (flash attention: no
# score matrix), divided over tp (sequence-parallel-free CPU form: the full layer count on one stage).
ACTIVATION_BYTES_PER_TOKEN_HIDDEN = 34
# The link efficiency Qwen-Image's planner assumes for collectives (`planner.plan.plan`'s default).
LINK_EFFICIENCY = 0.7


def cp_shard_tokens(image_tokens: int, cp: int) -> int:
    """The generation tokens of the most loaded cp rank: the packed image query (`image_tokens` latents + 2 markers)
    split into cp contiguous shards whose sizes differ by at most one (`models.bagel.mot.TokenShard`)."""
    return -(-(image_tokens + 2) // cp)


def cp_kv_gather_bytes(model: str | dict[str, Any], image_tokens: int, cp: int, tp: int = 1,
                       act_bytes: int = 2) -> int:
    """Bytes one rank receives in one layer's k/v all-gather over cp for one sample (one CFG branch): the other
    cp - 1 ranks' shards, padded to the largest shard, of k and v ([tokens, query groups / tp, head dim] each). The
    backward's reduce-scatter of the k/v gradient sends the same. 0 at cp 1."""
    llm = bagel_config(model)["llm_config"]
    d = llm["hidden_size"] // llm["num_attention_heads"]
    return (cp - 1) * cp_shard_tokens(image_tokens, cp) * 2 * (llm["num_key_value_heads"] // tp) * d * act_bytes


def mot_activation_bytes(model: str | dict[str, Any], image_tokens: int, tp: int = 1, cp: int = 1,
                         branches: int = 2, act_bytes: int = 2) -> int:
    """Activation bytes of one sample's window step on the most loaded rank (bf16, no recompute), for each of
    `branches` CFG branches: Megatron's `ACTIVATION_BYTES_PER_TOKEN_HIDDEN` x h / tp per layer and generation token
    of this rank's cp shard (the largest, `cp_shard_tokens`), plus at cp > 1 the other ranks' k/v that each layer
    gathers and keeps for the attention's backward ([tokens, query groups / tp, head dim], k and v)."""
    llm = bagel_config(model)["llm_config"]
    h, n_layers = llm["hidden_size"], llm["num_hidden_layers"]
    d, groups = h // llm["num_attention_heads"], llm["num_key_value_heads"]
    shard = cp_shard_tokens(image_tokens, cp)
    own = ACTIVATION_BYTES_PER_TOKEN_HIDDEN * n_layers * shard * h * branches // tp
    gathered = (image_tokens + 2 - shard) * 2 * (groups // tp) * d * act_bytes
    return own + n_layers * branches * gathered


# What the allocator and the runtime keep beside the model's tensors (CUDA context, NCCL buffers, fragmentation).
RESERVED_BYTES = 6 * GIB


@dataclass(frozen=True)
class MoTPlan:
    """One BAGEL RL layout on one GPU kind: tp (dp = gpus / tp), the trainer's memory (`MoTMemory`), the activations
    of one sample's window step (forward + backward, both CFG branches), the rollout's own bf16 copy of the model
    (vLLM-Omni's BAGEL pipeline in the trainer's process, whole at rollout tp 1 or a rank's shard at rollout tp = tp:
    both experts, the ViT and VAE left out as small), the total against the GPU's memory, and the step's forward
    FLOPs per GPU."""

    gpu: str
    tp: int
    dp: int
    memory: MoTMemory
    activations: int
    rollout_copy: int
    reserved: int
    capacity: int
    step_flops_per_gpu: float
    step_s: float
    trained_params: int = 0  # of the trained share on the most loaded stage
    params: int = 0  # every parameter of a rank (what a whole frozen copy, the KL reference or the EMA, holds)
    cp: int = 1
    kv_gather_bytes: int = 0  # received per rank in one layer's k/v all-gather, one sample and branch
    cp_comm_s: float = 0.0  # the step's k/v all-gathers and reduce-scatters (in step_s)
    sync_bytes: int = 0  # what each rollout rank receives per sync: every tensor whole (its loader keeps its shard)

    @property
    def total(self) -> int:
        return self.memory.total + self.activations + self.rollout_copy + self.reserved

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def lines(self) -> list[str]:
        m = self.memory
        cp = f" cp={self.cp}" if self.cp > 1 else ""
        lines = [f"{self.gpu} tp={self.tp}{cp} dp={self.dp}: weights {m.weights / GIB:.1f} GiB + grads "
                 f"{m.grads / GIB:.1f} GiB + optimizer states {m.optimizer / GIB:.1f} GiB",
                 f"  + activations {self.activations / GIB:.1f} GiB + rollout copy {self.rollout_copy / GIB:.1f} GiB "
                 f"+ reserved {self.reserved / GIB:.1f} GiB = {self.total / GIB:.1f} GiB of {self.capacity / GIB:.1f} "
                 f"GiB: {'fits' if self.fits else 'does not fit'}",
                 f"  step: {self.step_flops_per_gpu / 1e12:.0f} TFLOPs per GPU, about {self.step_s:.0f} s at the "
                 f"assumed MFU"]
        if self.cp > 1:
            lines.append(f"  cp {self.cp}: the generation tokens' activations / {self.cp}; k/v all-gather "
                         f"{self.kv_gather_bytes / 2**20:.1f} MiB received per layer and sample, the same reduce-"
                         f"scattered in backward: {self.cp_comm_s:.1f} s of the step")
        return lines


def plan_mot(model: str | dict[str, Any], gpu: str, gpus: int = 8, height: int = 1024, width: int = 1024,
             prompt_tokens: int = 64, samples: int = 64, num_steps: int = 10, window: int = 2, cfg: bool = True,
             train: str = "gen", mfu: float = 0.3, bf16: bool = True, distributed_optimizer: bool = True,
             rollout_bytes: int = 2, lora_rank: int = 64, cp: int = 1, rollout_sharded: bool = False
             ) -> list[MoTPlan]:
    """Every tensor-parallel size BAGEL's query groups and the GPU count admit, planned for FlowGRPO on
    text-to-image: `samples` images per step of `num_steps` denoising steps (the rollout: every step, one forward
    per CFG branch), `window` of them trained (recompute + forward + backward: 4 forwards' worth) per sample.
    `bf16`: the trainer's weights (else fp32); `rollout_bytes`: per parameter of the rollout's copy; `train`
    "lora": adapters of `lora_rank` (`mot_memory`; the backward still runs through the generation expert, so the
    activations are those of full training, and the rollout receives merged weights: the same copy). `cp`: context
    parallelism of the trainer (dp = gpus / (tp x cp)): the generation tokens' activations / cp plus the gathered
    k/v (`mot_activation_bytes`), and per trained sample and branch three k/v collectives per layer (the old
    log-probs' forward and the training forward all-gather, the backward reduce-scatters; not overlapped, at the
    NVLink bandwidth x `LINK_EFFICIENCY`) added to the step. The rollout's copy is whole (vLLM-Omni at rollout tp 1),
    or with `rollout_sharded` (rollout tp = the plan's tp) a rank's shard, counted as the trainer's."""
    from megatron_omni.planner.specs import GPUS

    if gpu not in GPUS:
        raise ValueError(f"unknown GPU kind {gpu!r}; known: {sorted(GPUS)}")
    spec = GPUS[gpu]
    c = bagel_config(model)
    llm, b = c["llm_config"], c["bagel"]
    stride = b["vae_config"]["downsample"] * b["latent_patch_size"]
    if cp < 1:
        raise ValueError(f"cp={cp} must be >= 1")
    if height % stride or width % stride or max(height, width) > stride * b["max_latent_size"]:
        raise ValueError(f"image {height}x{width} must be multiples of {stride} up to {stride * b['max_latent_size']}")
    image_tokens = (height // stride) * (width // stride)
    branches = 2 if cfg else 1
    n_layers = llm["num_hidden_layers"]
    step = generation_step_flops(c, image_tokens, prompt_tokens)
    total_params = sum(rank_parameter_counts(c, 1))
    plans = []
    if cp > image_tokens + 2:
        raise ValueError(f"cp={cp} exceeds the {image_tokens + 2} generation tokens of a {height}x{width} image")
    for tp in (1, 2, 4, 8):
        if gpus % (tp * cp) or llm["num_key_value_heads"] % tp:
            continue
        dp = gpus // (tp * cp)
        mem = mot_memory(c, tp, 1, train, bf16=bf16, dp=dp * cp, distributed_optimizer=distributed_optimizer,
                         lora_rank=lora_rank)
        trained = (lora_parameter_counts(c, tp, 1, lora_rank) if train == "lora"
                   else rank_parameter_counts(c, tp, 1, trainable=train))
        act = mot_activation_bytes(c, image_tokens, tp, cp, branches)
        flops = samples * branches * step * (num_steps + 4 * window) / gpus
        kv = cp_kv_gather_bytes(c, image_tokens, cp, tp)
        cp_s = samples / dp * branches * window * 3 * n_layers * kv / (spec.link_bytes_per_s * LINK_EFFICIENCY)
        rank_params = max(rank_parameter_counts(c, tp, 1))
        copy = rank_params if rollout_sharded else total_params
        plans.append(MoTPlan(gpu, tp, dp, mem, act, copy * rollout_bytes, RESERVED_BYTES, spec.memory_bytes,
                             flops, flops / (spec.peak_bf16_flops * mfu) + cp_s,
                             max(trained), rank_params, cp, kv, cp_s, total_params * rollout_bytes))
    return plans


def main(argv: list[str] | None = None) -> int:
    """`python -m megatron_omni.planner.mot --gpu H200 H800`: the layouts of BAGEL RL on one node of each GPU kind;
    exit 3 when none fits on some kind, 2 on bad input."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m megatron_omni.planner.mot", description=main.__doc__)
    ap.add_argument("--preset", default="7b-mot")
    ap.add_argument("--gpu", nargs="+", default=["H200"], help="GPU kinds, each planned in turn")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--height", type=int, default=1024)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=64, help="images per RL step")
    ap.add_argument("--num-steps", type=int, default=10)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--no-cfg", action="store_true")
    ap.add_argument("--train", default="gen", choices=("gen", "both", "lora"))
    ap.add_argument("--lora-rank", type=int, default=64, help="adapter rank with --train lora")
    ap.add_argument("--cp", type=int, default=1, help="context parallelism (parallel.ulysses x ring)")
    args = ap.parse_args(argv)
    status = 0
    print(f"dry run: world size {args.gpus} trainer ranks (one node of {args.gpus} GPUs; the rollout runs in the "
          "trainer's processes)")
    for gpu in args.gpu:
        try:
            plans = plan_mot(args.preset, gpu, args.gpus, args.height, args.width, samples=args.samples,
                             num_steps=args.num_steps, window=args.window, cfg=not args.no_cfg, train=args.train,
                             lora_rank=args.lora_rank, cp=args.cp)
        except (KeyError, ValueError) as exc:
            print(f"plan: {exc}")
            return 2
        print(f"BAGEL {args.preset} RL on {args.gpus} x {gpu}, {args.height}x{args.width}, {args.samples} images "
              f"per step, {args.num_steps} steps, window {args.window}, train {args.train}")
        print("memory per GPU: weights (both experts, bf16) + grads and optimizer states (the trained share, "
              "distributed optimizer over dp) + activations + the rollout's copy")
        for p in plans:
            print("\n".join(p.lines()))
        fitting = [p for p in plans if p.fits]
        if fitting:
            best = fitting[0]
            print(f"chosen: tp={best.tp}{f' cp={best.cp}' if best.cp > 1 else ''} dp={best.dp} (the smallest tp "
                  "that fits)")
            print(f"step time: about {best.step_s:.0f} s at MFU 0.3 (FLOPs only), "
                  f"{args.samples / best.step_s / args.gpus:.3f} images/s/GPU")
        else:
            print(f"no layout fits on {gpu}")
            status = 3
    weights = sum(rank_parameter_counts(args.preset, 1)) * 2
    print(f"bridge: full tensors gathered over the trainer's tp into vLLM-Omni's BAGEL pipeline at rollout tp 1, "
          f"{weights / GIB:.1f} GiB (bf16) per sync, coverage-checked")
    print("reference (VeRL-Omni and UniRL train BAGEL; no per-GPU throughput of theirs is recorded here)")
    if status == 0:
        print("dry run OK")
    return status

if __name__ == "__main__":
    raise SystemExit(main())
