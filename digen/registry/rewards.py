"""Every reward a config names without a module path: one line each, and nothing to import.

Config validation reads this (a typo in ``rewards.0.name`` is reported without importing
torch); :func:`digen.rewards.hooks.load_hook` and :func:`digen.rewards.scoring.build_reward`
import a reward's module only when it is used. Any other reward is named by
``module:function`` or ``path/to/file.py:function``. To ship a new built-in, write it in a
module of this package (a function, or a class built with the reward's ``options``; see
``digen/rewards/builtin.py`` and ``digen/rewards/clip.py``) and add its line below.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BUILTIN_REWARDS", "BuiltinReward"]


@dataclass(frozen=True, slots=True)
class BuiltinReward:
    """One reward digen ships, by the name a config gives it."""

    name: str
    target: str
    """``"module:attr"`` of its implementation."""
    built_from: str
    """How a run makes its hook from a config entry: ``name`` (a function, taking no
    ``options``), ``options`` (a class, built with the entry's ``options`` as keyword
    arguments) or ``url`` (a client of a reward server, built from the entry's ``url`` and
    ``options``: it cannot be loaded by name alone)."""


BUILTIN_REWARDS: dict[str, BuiltinReward] = {
    r.name: r
    for r in (
        BuiltinReward("jpeg_compressibility", "digen.rewards.builtin:jpeg_compressibility", "name"),
        BuiltinReward(
            "jpeg_incompressibility", "digen.rewards.builtin:jpeg_incompressibility", "name"
        ),
        BuiltinReward("ocr", "digen.rewards.ocr:OcrReward", "options"),
        BuiltinReward("clip", "digen.rewards.clip:ClipScore", "options"),
        BuiltinReward("shapes", "digen.rewards.shapes:ShapesReward", "options"),
        BuiltinReward("http", "digen.rewards.http:HttpReward", "url"),
    )
}
