"""Judging evaluation images: a pass or a fail per image, where the prompts have a rule.

A reward says how good a sample is; a judge says whether it does what its prompt asks, the
way a benchmark counts it, and groups the prompts so the benchmark's overall score (the
mean of the groups' pass rates) can be formed. An evaluation (``eval.every``) judges its
images with :func:`judge` beside the run's rewards, whatever rewards the run trains on.

One rule ships: GenEval's, for captions of the shapes world (:mod:`digen.shapes`; groups are
GenEval's categories). Prompts with no rule are not judged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Judged", "group_order", "judge"]


@dataclass(frozen=True, slots=True)
class Judged:
    """Each image's judgement, in the order of the images."""

    passed: list[float]
    """1.0 when the image meets every requirement of its prompt, else 0.0."""
    groups: list[str]
    """Each prompt's group (GenEval's category)."""


def judge(pixels: Any, prompts: Sequence[str]) -> Judged | None:
    """Judge ``pixels`` (``uint8 [B, F, H, W, 3]``) against their ``prompts``: GenEval's rule
    where every prompt is a caption of the shapes world; None for any other prompts."""
    from digen.shapes import parse

    try:
        for p in prompts:
            parse(p)
    except ValueError:
        return None
    from digen.rewards.shapes import evaluate

    judged = evaluate(pixels, prompts)
    return Judged([s.strict for s in judged], [s.category for s in judged])


def group_order(groups: Sequence[str]) -> list[str]:
    """``groups`` (each once) in the order a report lists them: GenEval's category order for
    its categories, then any other in the order seen."""
    from digen.shapes import CATEGORIES

    seen = list(dict.fromkeys(groups))
    return [c for c in CATEGORIES if c in seen] + [g for g in seen if g not in CATEGORIES]
