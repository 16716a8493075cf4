"""Every algorithm digen runs, by name: one line each.

Config validation, presets, the CLI, the colocated trainer and the workers all read this;
nothing else lists algorithms. Importing it loads no torch. To add an algorithm, write
``digen/algos/<name>.py`` (one :class:`~digen.algos.base.Algorithm` subclass; see
``digen/algos/mixgrpo.py`` and ``docs/EXTENDING.md``) and add its line below.
"""

from __future__ import annotations

from digen.algos.base import Algorithm
from digen.algos.dancegrpo import DanceGRPO
from digen.algos.flowgrpo import FlowGRPO
from digen.algos.mixgrpo import MixGRPO
from digen.errors import DigenError

__all__ = ["ALGORITHMS", "ALGO_NAMES", "get_algorithm"]

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        FlowGRPO(),
        DanceGRPO(),
        MixGRPO(),
    )
}
ALGO_NAMES: tuple[str, ...] = tuple(ALGORITHMS)


def get_algorithm(name: str) -> Algorithm:
    """The algorithm registered as ``name``."""
    if name not in ALGORITHMS:
        raise DigenError(f"unknown algorithm '{name}'; choose one of: {', '.join(ALGO_NAMES)}.")
    return ALGORITHMS[name]
