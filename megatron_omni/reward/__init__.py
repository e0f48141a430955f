"""Rewards: scorers (OCR, VLM judge, rule rewards), the reward server and its async client.

Heavy pieces (rapidocr, aiohttp sessions) load only when used; import from the submodules:
`registry.build_scorer`, `server` (`python -m megatron_omni.reward.server`), `client.RewardClient`,
`launcher.RewardServerProcess`.
"""

from megatron_omni.reward.errors import RewardError, RewardInputError, RewardScorerError, RewardServiceError
from megatron_omni.reward.registry import available_scorers, build_scorer, register_scorer

__all__ = [
    "RewardError",
    "RewardInputError",
    "RewardScorerError",
    "RewardServiceError",
    "available_scorers",
    "build_scorer",
    "register_scorer",
]
