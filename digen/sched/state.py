"""What a TAG policy sees at a trainer bubble: counters and clocks, nothing heavy.

The real driver fills a :class:`SchedState` from its scheduler's account (queues, the workers'
current tasks with their start times plus the profiled costs); the simulator fills the same
dataclass from its model. A policy therefore cannot tell the two apart, and the search that
the policy runs restarts the model from exactly what the driver knows.

Conventions shared by both:

- times are seconds on one clock; ``busy_until`` is the *expected* end of a running task
  (start + profiled cost); a value in the past means "about to finish" and is read as ``now``;
- micro-batches are handed out in order: step ``s`` micro-batch ``0 .. B-1``, then step
  ``s + 1``; ``next_mb`` is the first one not handed out yet;
- the train step being updated is also the policy version the weights carry (version ``s``
  during step ``s``: weights change only at the optimizer step that ends it).
"""

from __future__ import annotations

from dataclasses import dataclass

from digen.sched.admission import Admission
from digen.sched.names import TaskKind
from digen.sched.plan import SchedulePlan

__all__ = ["WORKER_KINDS", "SchedState", "WorkerClock"]

WORKER_KINDS: tuple[TaskKind | None, ...] = (None, *TaskKind)
"""What a worker can be doing; ``None`` is idle."""


@dataclass(frozen=True, slots=True)
class WorkerClock:
    """One worker's current task and when it is expected to end."""

    kind: str | None = None
    """One of :data:`WORKER_KINDS`; ``None`` when idle."""
    busy_until: float = 0.0
    """Expected end of the task, in seconds (ignored when idle)."""
    step: int = -1
    """Train step of the micro-batch being worked on (-1 for none)."""
    mb: int = -1
    """That micro-batch's index within its step (-1 for none)."""
    waiting: bool = False
    """Trainers only: idle at a bubble already decided (skipped, or nothing to generate).

    Such a trainer stays idle until UQ has work; it is not asked again.
    """
    count: int = 1
    """Micro-batches the running update takes (a group's, with grouped updates)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedState:
    """The schedule at the moment a trainer meets a bubble (UQ empty, step not finished)."""

    now: float
    """Current time, in seconds."""
    trainer: int
    """Index of the trainer at the bubble (the one asking)."""
    plan: SchedulePlan
    """The run's schedule: micro-batches per step, pools, GAP groups, admission (TCSS,
    ``C_gen``, first and last step)."""
    step: int
    """Train step being updated; also the weights' policy version."""
    generators: tuple[WorkerClock, ...]
    """One entry per generator, by index."""
    trainers: tuple[WorkerClock, ...]
    """One entry per trainer, by index (the asking one is idle and not waiting)."""
    next_mb: tuple[int, int]
    """``(step, mb)`` of the next micro-batch to hand out."""
    sq: tuple[tuple[int, int], ...] = ()
    """``(step, mb)`` of every generated micro-batch waiting for scoring, in queue order."""
    scorers: tuple[WorkerClock, ...] = ()
    """Scoring overlapped with generation: one entry per generator's scoring lane, by index;
    empty when generators score what they make themselves."""
    to_score: tuple[tuple[tuple[int, int], ...], ...] = ()
    """Per scoring lane, ``(step, mb)`` of what its generator made and it has not started
    scoring, in queue order (SQ, made on trainers, is shared by all lanes)."""
    uq: int = 0
    """Micro-batches of the train step ready for update (UQ length; 0 at a bubble)."""
    updated: int = 0
    """Updates of the train step already finished."""
    partial_groups: tuple[tuple[int, int, int], ...] = ()
    """``(step, group, scored)`` of every GAP group with some but not all micro-batches scored."""
    untrained: int = 0
    """Micro-batches handed out and not yet trained (all steps)."""
    tags: int = 0
    """TAG micro-batches already inserted during this train step."""
    bubbles: int = 0
    """Bubbles already decided during this train step (this one not counted)."""

    def __post_init__(self) -> None:
        if not self.generators or not self.trainers:
            raise ValueError("a schedule needs at least one generator and one trainer")
        if not 0 <= self.trainer < len(self.trainers):
            raise ValueError(
                f"trainer {self.trainer} is not an index of the {len(self.trainers)} trainers"
            )
        if self.scorers and len(self.scorers) != len(self.generators):
            raise ValueError(
                f"{len(self.scorers)} scoring lanes for {len(self.generators)} generators: "
                "there is one per generator, or none"
            )
        if len(self.to_score) != len(self.scorers):
            raise ValueError("to_score needs one queue per scoring lane")
        plan = self.plan
        if (len(self.generators), len(self.trainers)) != (plan.generators, plan.trainers):
            raise ValueError(
                f"{len(self.generators)} generators and {len(self.trainers)} trainers for a "
                f"plan of {plan.generators} and {plan.trainers}"
            )
        if bool(self.scorers) != plan.score_overlap:
            raise ValueError("scoring lanes are there exactly when the plan overlaps scoring")

    @property
    def version(self) -> int:
        """Policy version of the current weights (equal to :attr:`step`)."""
        return self.step

    @property
    def pending(self) -> int:
        """Micro-batches of the train step not handed out yet."""
        s, m = self.next_mb
        if s > self.step:
            return 0
        return self.microbatches - m

    @property
    def microbatches(self) -> int:
        """Micro-batches per train step (``B``)."""
        return self.plan.microbatches

    @property
    def admission(self) -> Admission:
        """The admission rule of this schedule."""
        return self.plan.admission

    def can_start_next(self) -> bool:
        """Whether the next micro-batch may start now on a worker holding the current version."""
        s, m = self.next_mb
        return self.admission.admits(s, m, self.step, self.untrained)

    @property
    def in_flight(self) -> tuple[tuple[str, float], ...]:
        """``(kind, busy_until)`` of every running generate / TAG task."""
        return tuple(
            (w.kind, w.busy_until)
            for w in self.generators + self.trainers
            if w.kind in (TaskKind.GENERATE, TaskKind.TAG)
        )
