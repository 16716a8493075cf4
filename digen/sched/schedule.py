"""The schedule's vocabulary, defined once: task kinds, worker names and the admission rule.

The driver (``digen/runtime/driver.py``), its book-keeping (:mod:`digen.sched.book`), the
simulator's engine and the TAG search all import these; nothing else spells them out.

Admission (:class:`Admission`) decides whether a worker holding policy version ``v`` may start
micro-batch ``m`` of train step ``k`` now. Micro-batches are handed out in order, step by
step, so ``m`` is also how many of step ``k`` went out before it.

- **on-policy** (``max_staleness = 0``): only ``v == k``;
- **TCSS, fixed schedule** (the default): the first ``stale_cap`` micro-batches of every step
  ``k >= 1`` are made with version ``k - 1`` and the rest with version ``k`` — exactly, so
  which trajectories are stale never depends on timing and a seeded run repeats bit for bit;
- **TCSS, eager schedule** (the paper's opportunistic form): a worker with ``v < k`` may start
  one when ``k - v <= max_staleness`` and ``m < stale_cap``; a worker with ``v == k`` may start
  any. How many go out stale then depends on which worker is free first;
- **back-pressure** (the paper's ``C_gen``): nothing starts while ``max_inflight``
  micro-batches are handed out and not yet trained;
- nothing past the run's last step starts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "DRIVER",
    "STALENESS_SCHEDULES",
    "Admission",
    "Pool",
    "TaskKind",
    "index_of",
    "pool_of",
    "stale_cap",
    "worker_name",
    "worker_names",
]


class TaskKind(StrEnum):
    """What a worker can be doing. Values are the strings traces and metrics use."""

    GENERATE = "generate"
    """Sampling a micro-batch on a generator."""
    TAG = "tag"
    """Sampling a micro-batch on a trainer (trainer-assisted generation)."""
    SCORE = "score"
    """Rewards of a micro-batch, on a generator."""
    UPDATE = "update"
    """Forward/backward of a micro-batch on a trainer (gradients kept, no optimizer step)."""
    STEP = "step"
    """The optimizer step that ends a train step (every trainer together)."""
    SYNC = "sync"
    """New weights reaching the generators."""


class Pool(StrEnum):
    """The worker pools, and the scoring lanes (one per generator, in its process)."""

    GENERATOR = "generator"
    TRAINER = "trainer"
    SCORER = "scorer"
    """With ``runtime.score_overlap``: generator ``i``'s rewards run on ``scorer-i``, beside
    its generation (same process, own thread), so scoring never holds up the next micro-batch."""


DRIVER = "driver"
"""The driver's name in traces and in the RPC world."""

STALENESS_SCHEDULES = ("fixed", "eager")


def worker_name(pool: Pool | str, index: int) -> str:
    """``"generator-0"``, ``"trainer-3"``: a pool's name and the worker's index in it."""
    return f"{pool}-{index}"


def worker_names(pool: Pool | str, count: int) -> tuple[str, ...]:
    return tuple(worker_name(pool, i) for i in range(count))


_NAME_RE = re.compile(r"^(.*?)-(\d+)$")


def pool_of(worker: str) -> str:
    """The pool a worker belongs to: its name without a trailing ``-<index>``.

    ``"generator-3" -> "generator"``, ``"trainer-h100-0" -> "trainer-h100"``, ``"driver" ->
    "driver"``: workers of one device type share a prefix, so heterogeneous pools keep
    separate estimates.
    """
    m = _NAME_RE.match(worker)
    return m[1] if m else worker


def index_of(worker: str) -> int:
    """The worker's index within its pool (``"trainer-2" -> 2``; -1 for ``"driver"``)."""
    m = _NAME_RE.match(worker)
    return int(m[2]) if m else -1


def stale_cap(microbatches: int, staleness_ratio: float) -> int:
    """How many of a step's micro-batches TCSS lets start on the previous version.

    ``floor(staleness_ratio * microbatches)`` (with a little slack so that, e.g., 0.3 * 10
    gives 3 despite rounding).
    """
    return math.floor(staleness_ratio * microbatches + 1e-9)


@dataclass(frozen=True, slots=True)
class Admission:
    """The admission rule (module docstring) for one run's settings."""

    max_staleness: int = 0
    """TCSS ``W``: versions a generation may lag its step (0 = on-policy)."""
    stale_cap: int = 0
    """Micro-batches of a step that may (eager) or must (fixed) come from an older version."""
    schedule: str = "fixed"
    """``fixed`` or ``eager`` (see the module docstring)."""
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
        if self.schedule not in STALENESS_SCHEDULES:
            raise ValueError(
                f"staleness schedule {self.schedule!r} is not one of {STALENESS_SCHEDULES}"
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
