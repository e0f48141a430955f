"""vLLM-Omni's engine entry point, imported as an engine-owning rank imports it (`engine.start_engine`: our import
shims, then `vllm_omni.Omni`): a zygote preload (server.PRELOAD), so a rank that starts an engine does not import
vLLM and vLLM-Omni again (~3 s of CPU each). Their start-up settings are read at import (vLLM's logging config,
the platform plugins): a request that sets them differently runs in a plain interpreter (server.STARTUP_VARIABLES)."""

from megatron_omni.rollout.vllm_omni.plugin import install_import_shims

install_import_shims()

from vllm_omni import Omni  # noqa: E402, F401
