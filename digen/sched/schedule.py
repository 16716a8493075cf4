"""The schedule's vocabulary and its rules, written once: every other module points here.

Words: task kinds (:class:`TaskKind`), pools and worker names (:class:`Pool`,
:func:`worker_name`), the admission rule (:class:`Admission`). The numbers a run's rules use
(micro-batches per step ``B``, GAP groups, trainer slots, the stale cap, ``C_gen``) are
derived once, in :mod:`digen.sched.plan`. The driver (``digen/runtime/driver/loop.py``) follows
these rules with real workers; the simulator's engine (:mod:`digen.sched._engine`) models
them for the simulator and the TAG search; :class:`~digen.sched.book.Book` keeps the
driver's account in the engine's terms.

**Hand-out and versions.** A train step has ``B`` micro-batches, handed out in order (step
``s`` micro-batch ``0 .. B-1``, then step ``s + 1``), so a micro-batch's index ``m`` is also
how many of its step went out before it. Version ``s`` is the policy during step ``s``.

**Admission**: whether a worker holding version ``v`` may start micro-batch ``m`` of step
``k`` now:

- on-policy (``max_staleness = 0``): only ``v == k``;
- TCSS, fixed schedule (the default): the first ``stale_cap`` micro-batches of every step
  after the run's first are made with version ``k - 1`` and the rest with version ``k`` —
  exactly, so which trajectories are stale never depends on timing and a seeded run repeats
  bit for bit (a run's first step, also a resumed run's, is on-policy: no older weights
  exist);
- TCSS, eager schedule (the paper's opportunistic form): a worker with ``v < k`` may start
  one when ``k - v <= max_staleness`` and ``m < stale_cap``; a worker with ``v == k`` may
  start any. How many go out stale then depends on which worker is free first;
- back-pressure (the paper's ``C_gen``): nothing starts while ``max_inflight``
  micro-batches are handed out and not yet trained;
- nothing past the run's last step starts.

**Generators.** A free generator scores the head of SQ (micro-batches trainers made) if SQ
is non-empty — scoring first, so trainers get rewards early; else it generates the next
micro-batch if admitted, and scores it right after (its pixels are there); else it idles
until something changes. With scoring overlapped (``score_overlap``, the runtime's
default) scoring leaves the generator: generator ``i``'s micro-batches queue on its scoring
lane ``scorer-i`` (same process, own thread), which scores the head of SQ if any, else the
head of its own queue, and the generator is free as soon as a generation ends. Scoring
lanes hold no weights: they take no part in the optimizer step or the sync.

**Trainers.** A free trainer updates the head of UQ (the step's micro-batches ready for
update) if any; else it is at a *bubble*. With an admissible micro-batch left, the TAG
policy decides: insert (the trainer generates it, cost ``gen_tag``; it joins SQ and is
scored like any other) or skip (the trainer waits for UQ and is not asked again until it
has done an update). With nothing left to generate it just waits.

**Groups.** Advantages are group-relative, so micro-batches enter UQ a group at a time:
micro-batches ``g*k .. g*k+k-1`` form group ``g`` (``k``: the plan's ``update_group``, a GAP
group or, when updates wait for the whole step, all ``B``), entering UQ together when the
last of them is scored.

**Step end.** Once all ``B`` updates of step ``s`` are done the trainers finish their
current task, then all run the optimizer ``step``; then, once every generator has finished
its current task (and, under the fixed TCSS schedule, step ``s + 1``'s early micro-batches
are handed out), every worker runs ``sync``; then the version becomes ``s + 1``. Generators
keep working during the step but start nothing once the sync is due. Weights change only at
a sync, which waits for running tasks, so every generation has one version.

**Ties** (deterministic, so runs and the model repeat): tasks ending at the same instant
take effect in ``(step, mb)`` order; then free generators are served by index, then free
trainers — those already waiting first, then the ones just freed, each by index;
same-instant bubbles are decided one trainer at a time in that order.
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
