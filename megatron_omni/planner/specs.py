"""What the dry-run planner plans for: GPU kinds, the FlowGRPO workload, the rollout engine and the bytes per
parameter, as plain frozen dataclasses (no config, no process group)."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_omni.parallel.layout import LayoutError

# VeRL-Omni, Qwen-Image full fine-tuning, the reference recipe on 4xH200 (docs/design.md section 3).
REFERENCE_IMAGES_PER_S_PER_GPU = 0.510
REFERENCE_STEP_S = 250.0
REFERENCE_GPUS = 4

# Qwen-Image's rollout pipeline also holds the text encoder (Qwen2.5-VL-7B, about 8.29B parameters) and the
# VAE (about 0.127B): replicated on every rollout GPU here, which is the conservative assumption.
QWEN_IMAGE_TEXT_ENCODER_PARAMS = 8_290_000_000
QWEN_IMAGE_VAE_PARAMS = 127_000_000

DEFAULT_MFU = 0.35
# Bytes per element of the config's dtype names (`model.params_dtype`, `rollout.dtype`, `rollout.vae_dtype`)
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclass(frozen=True)
class GPUSpec:
    """One GPU kind. memory_bytes: what the driver reports as total; peak_bf16_flops: dense bf16 tensor-core
    peak; link_bytes_per_s: NVLink bandwidth per direction per GPU; internode_bytes_per_s: network per GPU."""

    name: str
    memory_bytes: int
    peak_bf16_flops: float
    link_bytes_per_s: float
    internode_bytes_per_s: float = 50e9  # one 400 Gb/s NIC per GPU
    hbm_bytes_per_s: float = 4.8e12


# Sold as 141 GB and 80 GB; nvidia-smi reports 143771 MiB and 81559 MiB. NVLink: 900 and 400 GB/s
# bidirectional. Both have the Hopper SXM dense bf16 peak of about 989 TFLOP/s.
GPUS: dict[str, GPUSpec] = {
    "H200": GPUSpec("H200", 143771 * 1024**2, 989e12, 450e9, hbm_bytes_per_s=4.8e12),
    "H800": GPUSpec("H800", 81559 * 1024**2, 989e12, 200e9, hbm_bytes_per_s=3.35e12),
}


@dataclass(frozen=True)
class Workload:
    """One FlowGRPO step: `prompts x group_size` images of `height x width`, `sampling_steps` denoising
    steps of which `window` are trained, split into `mini_batches` optimizer steps of `micro_batch_size`
    (image, step) samples per forward. `text_tokens` counts the prompt tokens the transformer sees;
    `condition_tokens` the image-stream tokens appended after the generated image's (an edit's source latents)."""

    height: int = 512
    width: int = 512
    text_tokens: int = 256
    sampling_steps: int = 10
    window: int = 2
    prompts: int = 32
    group_size: int = 16
    mini_batches: int = 2
    micro_batch_size: int = 1
    cfg: bool = False
    recompute_old_logprob: bool = True
    condition_tokens: int = 0

    @property
    def images(self) -> int:
        """Images generated per step."""
        return self.prompts * self.group_size


@dataclass(frozen=True)
class RolloutSpec:
    """The rollout engine. colocated: it shares the trainer's GPUs (weights resident beside the training
    state); otherwise it runs on `gpus` GPUs of its own. batch: images in flight per engine instance.
    mfu: defaults to the training MFU. extra_params: non-transformer weights it holds (text encoder, VAE).
    replicas: engine instances that split the images between them; None = every rollout GPU group of `tp`
    (rollout GPUs / tp), which is what the trainer's embedded engine does: every rank rolls out a share.
    sleeps: a colocated engine that frees its GPU memory during the update (vLLM-Omni's sleep mode), so
    its weights are not resident beside the training activations. in_process: its weights are tensors of the
    trainer's own process (the embedded engine), so a sync at the trainer's layout is a local copy; vLLM-Omni's
    workers are processes of their own and receive full tensors."""

    tp: int = 1
    colocated: bool = True
    gpus: int | None = None
    batch: int = 16
    mfu: float | None = None
    extra_params: int = QWEN_IMAGE_TEXT_ENCODER_PARAMS + QWEN_IMAGE_VAE_PARAMS
    replicas: int | None = None
    sleeps: bool = False
    in_process: bool = True


@dataclass(frozen=True)
class LoRASpec:
    """Low-rank adapters (`model.lora`, `megatron_omni/models/lora.py`) on the block linears whose module names
    (`layers.{i}.{img|txt}.{linear}`) match one of `targets` (fnmatch patterns): the base weights are frozen, only
    the adapters have gradients, main params and Adam moments, and the KL reference is the base with the
    adapters switched off (no copy). rank 0 is full fine-tuning; alpha is printed only (it scales, costs nothing)."""

    rank: int
    targets: tuple[str, ...]
    alpha: float | None = None

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter: bf16 weights, fp32 main grads, fp32 master + Adam m, v (12 bytes) sharded over
    dp x cp by Megatron's distributed optimizer; bf16 activations and rollout weights (`of` for a config)."""

    param_bytes: int = 2
    grad_bytes: int = 4
    optimizer_bytes: int = 12
    distributed_optimizer: bool = True
    activation_bytes: int = 2
    rollout_param_bytes: int = 2

    @classmethod
    def of(cls, params_dtype: str, rollout_dtype: str, distributed_optimizer: bool) -> Precision:
        """What Megatron-Core allocates for `model.params_dtype` ('fp32' | 'bf16'): in bf16, 2-byte weights and
        activations and fp32 main params + Adam m, v (12 bytes); in fp32 the weights are the main params, so
        the optimizer holds m, v only (8 bytes). Grads are fp32 either way (grad_reduce_in_fp32)."""
        for field_name, name in (("model.params_dtype", params_dtype), ("rollout.dtype", rollout_dtype)):
            if name not in DTYPE_BYTES:
                raise LayoutError(f"{field_name}={name!r}: expected fp32 or bf16")
        bf16 = params_dtype == "bf16"
        return cls(param_bytes=DTYPE_BYTES[params_dtype], grad_bytes=4, optimizer_bytes=12 if bf16 else 8,
                   distributed_optimizer=distributed_optimizer, activation_bytes=DTYPE_BYTES[params_dtype],
                   rollout_param_bytes=DTYPE_BYTES[rollout_dtype])
