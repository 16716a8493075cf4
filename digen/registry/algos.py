"""Every algorithm digen runs, by name: one line each, naming the class that implements it.

Config validation, presets, the CLI, the trainers and the workers all find algorithms here;
nothing else lists them. This module is a leaf (it imports only :mod:`digen.errors`), so
configuration (below the algorithms in the package's layers) can read an algorithm's own
settings, checks and presets through it without importing the algorithm modules, which are
typed against the config. An algorithm's module is imported the first time it is asked for,
and loads no torch. To add an algorithm, write ``digen/algos/<name>.py`` (one
:class:`~digen.algos.base.Algorithm` subclass; see ``digen/algos/mixgrpo.py`` and
``docs/EXTENDING.md``) and add its line below.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any

from digen.errors import DigenError

__all__ = ["ALGORITHMS", "ALGO_NAMES", "SDE_TYPES", "get_algorithm"]

ALGORITHMS: dict[str, str] = {
    "flowgrpo": "digen.algos.flowgrpo:FlowGRPO",
    "flowgrpo-fast": "digen.algos.flowgrpo_fast:FlowGRPOFast",
    "dancegrpo": "digen.algos.dancegrpo:DanceGRPO",
    "mixgrpo": "digen.algos.mixgrpo:MixGRPO",
    "mixgrpo-flash": "digen.algos.mixgrpo_flash:MixGRPOFlash",
    "nft": "digen.algos.nft:NFT",
    "awm": "digen.algos.awm:AWM",
    "dgpo": "digen.algos.dgpo:DGPO",
}
"""``algo.name`` -> ``module:Class`` of its :class:`~digen.algos.base.Algorithm`."""
ALGO_NAMES: tuple[str, ...] = tuple(ALGORITHMS)
SDE_TYPES: tuple[str, ...] = ("sde", "cps", "dance")
"""The stochastic step kinds (``rollout.sde_type``), whose math is
:data:`digen.algos.transitions.STEP_KINDS`."""


@cache
def get_algorithm(name: str) -> Any:
    """The :class:`~digen.algos.base.Algorithm` registered as ``name`` (one object per name).

    Typed ``Any`` because this leaf may not import the class it returns; configuration reads
    only its ``name``, ``title``, ``sde_types``, ``kl_type``, ``params``, ``check`` and
    ``preset``.
    """
    if name not in ALGORITHMS:
        raise DigenError(f"unknown algorithm '{name}'; choose one of: {', '.join(ALGO_NAMES)}.")
    module, cls = ALGORITHMS[name].split(":")
    return getattr(importlib.import_module(module), cls)()
