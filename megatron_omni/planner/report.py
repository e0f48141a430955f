"""What a dry run prints: the planner's time and plan reports and their table, and the MFU figures it reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_omni.parallel.layout import ParallelLayout
from megatron_omni.planner import specs
from megatron_omni.planner.flops import ForwardFlops
from megatron_omni.planner.memory import GIB, MemoryReport
from megatron_omni.planner.specs import GPUS, GPUSpec, Precision, RolloutSpec, Workload


@dataclass(frozen=True)
class TimeReport:
    """Predicted seconds per step and throughput."""

    rollout_s: float
    old_logprob_s: float
    train_s: float
    communication_s: float  # the non-overlapped part, already included in the three above
    bubble_fraction: float
    step_s: float
    images_per_s_per_gpu: float
    sync_s: float = 0.0  # trainer -> rollout weight sync, once per step (included in step_s)


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


@dataclass(frozen=True)
class LoRAReport:
    """What a LoRA plan counted: the adapters' rank, alpha and target patterns, the linears they adapt, their
    parameters in the whole model (`total`) and per rank of each pipeline stage, and the frozen base's."""

    rank: int
    alpha: float | None
    targets: tuple[str, ...]
    modules: int
    total: int
    stage_adapters: list[int]
    stage_base: list[int]

    def line(self) -> str:
        """The report's LoRA line."""
        alpha = "" if self.alpha is None else f", alpha {self.alpha:g}"
        return (f"LoRA: rank {self.rank}{alpha} on {self.modules} linears ({', '.join(self.targets)}): "
                f"{_count(self.total)} adapter parameters, {_count(max(self.stage_adapters))} per rank, beside "
                f"{_count(max(self.stage_base))} frozen base parameters per rank; gradients and optimizer states "
                "are the adapters' only, the KL reference is the base with the adapters off (no copy), and the "
                "backward skips the base's weight gradients")


@dataclass(frozen=True)
class PlanReport:
    """What a dry run prints: the inputs resolved, the memory and time predictions, and warnings."""

    model: str
    layout: ParallelLayout
    gpu: GPUSpec
    workload: Workload
    rollout: RolloutSpec
    recompute: str
    mfu: float
    gpus: int  # every GPU the job holds (trainer, separate rollout, reward)
    image_tokens: int
    micro_batches: int  # per mini-batch per data-parallel replica
    flops: ForwardFlops  # one forward of one sample
    flops_per_image: float  # rollout + old log-probs + training, all ranks together
    stage_parameters: list[int]  # per rank of each pipeline stage (with LoRA: base + adapters)
    memory: MemoryReport
    time: TimeReport
    warnings: list[str] = field(default_factory=list)
    precision: Precision = field(default_factory=Precision)
    lora: LoRAReport | None = None  # None: full fine-tuning
    family: str = "qwen_image"  # the reference figure is Qwen-Image's: other families print no ratio to it

    @property
    def ratio_to_reference(self) -> float:
        """Predicted images/s/GPU over VeRL-Omni's 0.510."""
        return self.time.images_per_s_per_gpu / specs.REFERENCE_IMAGES_PER_S_PER_GPU

    def table(self) -> str:
        """A printable breakdown, next to the reference figure."""
        m, t, w = self.memory, self.time, self.workload
        gib = lambda b: f"{b / GIB:7.1f} GiB"  # noqa: E731
        lines = [
            f"model {self.model} on {self.gpus} x {self.gpu.name}: {self.layout.describe()}, "
            f"recompute={self.recompute}, rollout tp={self.rollout.tp} "
            f"({'colocated' if self.rollout.colocated else f'{self.rollout.gpus} own GPUs'}"
            f"{'' if self.rollout.replicas is None else f', {self.rollout.replicas} replicas'}), "
            f"{'distributed' if self.precision.distributed_optimizer else 'replicated'} optimizer",
            f"workload: {w.prompts} prompts x {w.group_size}, {w.height}x{w.width} ({self.image_tokens} image"
            f"{f' (of them {w.condition_tokens} source-image)' if w.condition_tokens else ''} + {w.text_tokens} text "
            f"tokens), {w.sampling_steps} steps, window {w.window}, {w.mini_batches} "
            f"mini-batches x {self.micro_batches} micro-batches of {w.micro_batch_size}, cfg={w.cfg}",
            f"assumption: MFU {self.mfu:.2f} of {self.gpu.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16 peak "
            f"(rollout MFU {self.rollout.mfu or self.mfu:.2f}); one forward = {self.flops.total / 1e12:.2f} TFLOP",
            *([self.lora.line()] if self.lora else []),
            "memory per GPU:",
            f"  parameters          {gib(m.parameters)}",
            f"  gradients           {gib(m.gradients)}",
            f"  optimizer states    {gib(m.optimizer_states)}",
            f"  activations         {gib(m.activations)}  (none: {m.activations_no_recompute / GIB:.1f}, "
            f"full recompute: {m.activations_full_recompute / GIB:.1f})",
            f"  rollout weights     {gib(m.rollout_weights)}"
            f"{'  (engine asleep during the update: not resident beside training)' if m.rollout_asleep else ''}",
            f"  rollout activations {gib(m.rollout_activations)}",
            f"  reserve             {gib(m.reserve)}",
            f"  total               {gib(m.total)} of {m.capacity / GIB:.1f} GiB -> "
            f"{'fits' if m.fits else 'DOES NOT FIT'}",
            "step time:",
            f"  rollout             {t.rollout_s:8.1f} s",
            f"  old log-probs       {t.old_logprob_s:8.1f} s",
            f"  training            {t.train_s:8.1f} s  (bubble {t.bubble_fraction:.0%}, "
            f"non-overlapped communication {t.communication_s:.1f} s in all)",
            f"  weight sync         {t.sync_s:8.1f} s",
            f"  step                {t.step_s:8.1f} s  -> {t.images_per_s_per_gpu:.3f} images/s/GPU",
            self._reference_line(),
        ]
        lines += [f"warning: {x}" for x in self.warnings]
        return "\n".join(lines)


    def _reference_line(self) -> str:
        """VeRL-Omni's published figure is Qwen-Image 20B full fine-tuning: a ratio to it means something only for
        that family; the others say what the figure is and print none."""
        head = (f"reference (VeRL-Omni, {specs.REFERENCE_GPUS}xH200): "
                f"{specs.REFERENCE_IMAGES_PER_S_PER_GPU:.3f} images/s/GPU")
        if self.family not in REFERENCE_FAMILIES:
            return (f"{head} is Qwen-Image 20B's; no published per-GPU throughput for {self.family} is recorded "
                    "here, so no ratio")
        return f"{head}, ~{specs.REFERENCE_STEP_S:.0f} s/step; predicted/reference = {self.ratio_to_reference:.2f}"


# The families VeRL-Omni's reference figure was measured on (the edit model is Qwen-Image's transformer with a
# longer image stream: the figure is not its own either).
REFERENCE_FAMILIES = ("qwen_image",)


def measured_mfu(path: str) -> float:
    """The MFU measured by tools/gpu_check.sh (its JSON's `mfu`: one 20B-shaped MMDiT block's forward +
    backward at batch 1, against the GPU's bf16 peak). Raises ValueError naming the file and the problem."""
    import json
    from pathlib import Path

    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (tools/gpu_check.sh writes it)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON file ({exc})") from None
    mfu = data.get("mfu") if isinstance(data, dict) else None
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ValueError(f"{path}: 'mfu' must be a number in (0, 1], got {mfu!r}")
    return float(mfu)


def reference_implied_mfu(report: PlanReport) -> float:
    """The MFU VeRL-Omni's 0.510 images/s/GPU would mean under this report's FLOPs per image (a sanity check
    on the assumed MFU: it is what the reference achieved, communication and overheads included)."""
    return specs.REFERENCE_IMAGES_PER_S_PER_GPU * report.flops_per_image / GPUS["H200"].peak_bf16_flops
