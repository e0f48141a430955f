"""The one exception type of the checkpoint tools: bad input named precisely (file, tensor, folder)."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint, folder or request that cannot be converted; the message names the culprit."""
