"""Errors a user can act on. Each carries one sentence; the CLI prints it and exits 2."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "DigenError",
    "NonFiniteError",
    "RewardError",
    "RunStopped",
    "stop_if_interrupted",
]


class DigenError(ValueError):
    """A problem with the user's input or environment, stated in one sentence: the one
    error type every layer raises for what its user can act on (the CLI prints it and exits
    2). A ``ValueError``, so code that catches bad values catches these too."""


class ConfigError(DigenError):
    """A config key has a value that is not allowed."""


class RewardError(DigenError):
    """A reward function failed, or returned something other than one finite float per sample."""


class NonFiniteError(DigenError):
    """A loss or gradient became NaN or infinite (``train.on_nonfinite = fail``)."""


class RunStopped(Exception):
    """A run was stopped by a signal (``signal``: ``SIGINT`` or ``SIGTERM``, None for another
    stop), so what runs several runs (``digen bench``) stops too, rather than start the next."""

    def __init__(self, signal: str | None) -> None:
        super().__init__(f"stopped by {signal or 'a stop request'}")
        self.signal = signal


def stop_if_interrupted(result: object) -> None:
    """Raise :class:`RunStopped` when ``result`` (a ``RunResult``) was stopped early."""
    if getattr(result, "interrupted", False):
        raise RunStopped(getattr(result, "stop_signal", None))
