"""The admission rule: which micro-batch a worker holding a given version may start now.

The rule itself (on-policy, TCSS fixed and eager, back-pressure, the run's last step) is
written out in :mod:`digen.sched`; :class:`Admission` applies it for one run's settings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["Admission", "StalenessSchedule", "stale_cap"]


class StalenessSchedule(StrEnum):
    """``runtime.schedule.staleness_schedule`` values (see :mod:`digen.sched`)."""

    FIXED = "fixed"
    EAGER = "eager"


def stale_cap(microbatches: int, staleness_ratio: float) -> int:
    """How many of a step's micro-batches TCSS lets start on the previous version.

    ``floor(staleness_ratio * microbatches)`` (with a little slack so that, e.g., 0.3 * 10
    gives 3 despite rounding).
    """
    return math.floor(staleness_ratio * microbatches + 1e-9)


@dataclass(frozen=True, slots=True)
class Admission:
    """The admission rule (:mod:`digen.sched`) for one run's settings."""

    max_staleness: int = 0
    """TCSS ``W``: versions a generation may lag its step (0 = on-policy)."""
    stale_cap: int = 0
    """Micro-batches of a step that may (eager) or must (fixed) come from an older version."""
    schedule: str = "fixed"
    """``fixed`` or ``eager`` (:mod:`digen.sched`)."""
    max_inflight: int | None = None
    """``C_gen``: micro-batches handed out and not yet trained, at most; None = no bound."""
    last_step: int | None = None
    """Last train step of the run (nothing later starts); None = no end."""
    first_step: int = 0
    """First train step of the run (a resumed run's checkpoint step): it is on-policy, as
    no older weights exist to make its early micro-batches with."""

    def __post_init__(self) -> None:
        for name in ("max_staleness", "stale_cap"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.schedule not in tuple(StalenessSchedule):
            raise ValueError(
                f"staleness schedule {self.schedule!r} is not one of "
                f"{tuple(s.value for s in StalenessSchedule)}"
            )

    def quota(self, step: int) -> int:
        """Fixed schedule: how many of ``step``'s micro-batches are made one version early."""
        if self.schedule != "fixed" or self.max_staleness < 1 or step <= self.first_step:
            return 0
        return self.stale_cap

    def version_for(self, step: int, mb: int) -> int:
        """Fixed schedule: the version micro-batch ``mb`` of ``step`` is made with."""
        return step - 1 if mb < self.quota(step) else step

    def admits(self, step: int, mb: int, version: int, in_flight: int = 0) -> bool:
        """Whether a worker holding ``version`` may start micro-batch ``mb`` of ``step`` now."""
        if self.last_step is not None and step > self.last_step:
            return False
        if self.max_inflight is not None and in_flight >= self.max_inflight:
            return False
        if self.schedule == "fixed":
            return version == self.version_for(step, mb)
        lag = step - version
        return lag <= 0 or (lag <= self.max_staleness and mb < self.stale_cap)

    def quota_pending(self, step: int, next_mb: tuple[int, int]) -> bool:
        """Fixed schedule: whether some of ``step``'s early micro-batches are not handed out yet.

        Version ``step`` must not reach a generator before they are (nobody could make them).
        """
        s, m = next_mb
        if self.last_step is not None and step > self.last_step:
            return False
        return s < step or (s == step and m < self.quota(step))
