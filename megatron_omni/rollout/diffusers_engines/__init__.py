"""The embedded rollout engines (`rollout.engine=diffusers`): diffusers' modules driven in the trainer's own
ranks. `engine`: Qwen-Image-style pipelines (`DiffusersRolloutEngine`); `wan`: the Wan video family on its hooks;
`ar_dit`: the AR-DiT hybrid (plans from the decoder, the DiT half embedded or served by vLLM-Omni)."""
