"""Exceptions of the reward package.

Bad input and failed scoring raise; nothing in this package turns a failure into a reward of 0, because a
silent 0 would be learned from as if the policy had produced an unreadable image.
"""

from __future__ import annotations


class RewardError(Exception):
    """Base class of every reward failure."""


class RewardInputError(RewardError, ValueError):
    """A sample cannot be scored as given (wrong image type, prompt without the text asked for, ...).

    The server answers it with a 4xx status: retrying the same request cannot help.
    """


class RewardScorerError(RewardError):
    """A scorer failed on valid input (an OCR engine error, a judge endpoint answering garbage, ...)."""


class RewardServiceError(RewardError):
    """The reward service could not deliver rewards: unreachable, dead, timed out, or refused the request."""


class RewardWeightsError(RewardInputError):
    """A scorer's weights folder or file is missing or holds another architecture than the scorer expects.

    Raised while the scorer is built, before any training step: the server and the trainer exit 2 with the
    message, which names the path and what was expected. Never answered by falling back to another model.
    """
