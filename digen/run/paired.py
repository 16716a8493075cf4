"""Whether an evaluation's rise is more than chance: McNemar's exact test on paired images.

An evaluation samples every image from noise fixed per (prompt, image) (the same at every
evaluation of a run, and in either mode), so the first and the last evaluation judge the
same prompt with the same starting noise, image by image. The images whose verdict changed
are what a rise is made of: ``gained`` (failed, then met its caption) and ``lost`` (the
reverse). Under no change in the chance to pass, each changed image is as likely to be
either, so ``gained`` is Binomial(gained + lost, 1/2) and the two-sided exact p-value is
``min(1, 2 P(X <= min(gained, lost)))`` (McNemar's test in its exact, binomial form). Images
whose verdict stayed the same carry no information about the change and do not enter it.

A run writes each evaluation's verdicts to ``eval.jsonl`` as ``eval/passed/<group>``, one
character per image (``1`` met its caption, ``0`` not), in the evaluation's image order.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["PASSED_PREFIX", "Paired", "mcnemar_p", "paired_change", "paired_changes"]

PASSED_PREFIX = "eval/passed/"
"""Key prefix of an evaluation's per-image verdicts in ``eval.jsonl``."""


def mcnemar_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value of ``gained`` against ``lost`` changed pairs."""
    if gained < 0 or lost < 0:
        raise ValueError(f"counts must be >= 0, got {gained} and {lost}.")
    n = gained + lost
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(gained, lost) + 1))
    return min(1.0, 2 * tail / 2**n)


@dataclass(frozen=True, slots=True)
class Paired:
    """The change between two evaluations of the same images."""

    images: int
    before: float
    """Fraction of images that met their caption the first time."""
    after: float
    gained: int
    lost: int
    p: float
    """McNemar's exact two-sided p-value."""

    @property
    def rise(self) -> float:
        return self.after - self.before


def paired_change(before: str, after: str) -> Paired:
    """The change from verdicts ``before`` to ``after`` (strings of ``0`` / ``1``, one per
    image, the same images in the same order)."""
    if len(before) != len(after) or not set(before + after) <= {"0", "1"}:
        raise ValueError("verdicts must be 0/1 strings over the same images.")
    gained = sum(a == "0" and b == "1" for a, b in zip(before, after))
    lost = sum(a == "1" and b == "0" for a, b in zip(before, after))
    n = len(before)
    return Paired(
        images=n,
        before=before.count("1") / n if n else 0.0,
        after=after.count("1") / n if n else 0.0,
        gained=gained,
        lost=lost,
        p=mcnemar_p(gained, lost),
    )


def paired_changes(first: Mapping[str, str], last: Mapping[str, str]) -> dict[str, Paired]:
    """Per group, and ``all`` over every image, the change between two evaluations' verdicts
    (``{group: "0110..."}``, as ``eval.jsonl`` holds them without the key prefix)."""
    groups = [g for g in first if g in last]
    out = {g: paired_change(first[g], last[g]) for g in groups}
    if groups:
        out["all"] = paired_change(
            "".join(first[g] for g in groups), "".join(last[g] for g in groups)
        )
    return out
