"""The experiment trackers a run may also log to (``logger``), by name: each is an optional
extra (``pip install 'digen[<name>]'``), implemented in :mod:`digen.run.trackers`."""

from __future__ import annotations

__all__ = ["TRACKERS"]

TRACKERS: tuple[str, ...] = ("tensorboard", "wandb")
"""What ``logger`` may list; each tracker needs the package of its name."""
