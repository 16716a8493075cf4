"""Errors a user can act on. Each carries one sentence; the CLI prints it and exits 2."""

from __future__ import annotations

__all__ = ["ConfigError", "DigenError", "NonFiniteError", "RewardError"]


class DigenError(Exception):
    """A problem with the user's input or environment, stated in one sentence."""


class ConfigError(DigenError, ValueError):
    """A config key has a value that is not allowed."""


class RewardError(DigenError):
    """A reward function failed, or returned something other than one finite float per sample."""


class NonFiniteError(DigenError):
    """A loss or gradient became NaN or infinite (``train.on_nonfinite = fail``)."""
