"""McNemar's exact test on an evaluation's paired images (:mod:`digen.run.paired`)."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from digen.run.paired import mcnemar_p, paired_change, paired_changes


def _two_sided_by_enumeration(gained: int, lost: int) -> Fraction:
    """P(an outcome at least as far from an even split as the one seen), counting every
    one of the 2^n equally likely ways n changed images could have split."""
    n = gained + lost
    seen = abs(2 * gained - n)
    outcomes = list(itertools.product((0, 1), repeat=n))
    extreme = sum(abs(2 * sum(o) - n) >= seen for o in outcomes)
    return Fraction(extreme, len(outcomes))


@pytest.mark.parametrize("gained", range(0, 9))
@pytest.mark.parametrize("lost", range(0, 9))
def test_mcnemar_p_is_the_exact_binomial_two_sided_probability(gained: int, lost: int) -> None:
    expected = _two_sided_by_enumeration(gained, lost) if gained + lost else Fraction(1)
    assert mcnemar_p(gained, lost) == pytest.approx(float(expected), rel=1e-12)
    assert mcnemar_p(gained, lost) == mcnemar_p(lost, gained)


def test_mcnemar_p_at_hand_worked_values() -> None:
    assert mcnemar_p(10, 0) == 2 / 1024  # one way of ten all gained, one all lost
    assert mcnemar_p(6, 4) == 2 * (1 + 10 + 45 + 120 + 210) / 1024 == 0.75390625
    assert mcnemar_p(5, 5) == 1.0
    with pytest.raises(ValueError, match=">= 0"):
        mcnemar_p(-1, 2)


def test_paired_change_counts_only_the_images_whose_verdict_changed() -> None:
    c = paired_change("0011001100", "0111000111")
    assert (c.images, c.gained, c.lost) == (10, 3, 1)
    assert (c.before, c.after) == (0.4, 0.6)
    assert c.rise == pytest.approx(0.2)
    assert c.p == mcnemar_p(3, 1)
    with pytest.raises(ValueError, match="same images"):
        paired_change("01", "011")
    with pytest.raises(ValueError, match="same images"):
        paired_change("01", "0x")


def test_paired_changes_per_group_and_over_every_image() -> None:
    first = {"single_object": "0101", "position": "0000"}
    last = {"single_object": "1101", "position": "0110"}
    got = paired_changes(first, last)
    assert list(got) == ["single_object", "position", "all"]
    assert (got["single_object"].gained, got["single_object"].lost) == (1, 0)
    assert (got["position"].gained, got["position"].lost) == (2, 0)
    assert (got["all"].images, got["all"].gained, got["all"].lost) == (8, 3, 0)
    assert got["all"].p == mcnemar_p(3, 0)
