"""Discrete-event simulation of a disaggregated run: G generators, T trainers, S train steps.

The simulator is a clock around the driver's own scheduler
(:class:`~digen.sched.scheduler.Scheduler`): each free worker is asked what it runs next
exactly as the driver (``digen/runtime/driver/loop.py``) asks, its task ends after its
kind's cost, and what it made, scored or trained is told back the driver's way. What the
clock adds is the model of time: tasks ending at one instant take effect together, the
optimizer step and the weight sync run on every worker at once, and the tie rules of
:mod:`digen.sched` serve simultaneous free workers. A TAG policy tuned here therefore sees
what it will see in a real run. The TAG search runs a compiled copy of this model
(``_engine.Engine``, cloned at every node); ``tests/sched/test_scheduler.py`` checks that
the two give the same schedule, event for event.

It follows the schedule's rules (:mod:`digen.sched`) with the numbers of a
:class:`~digen.sched.plan.SchedulePlan`.

Events use the runtime's format (:class:`~digen.sched.trace.TraceEvent`): kinds ``generate``
/ ``tag`` / ``score`` / ``update`` / ``step`` / ``sync``, workers ``generator-i`` /
``trainer-j`` / ``scorer-i``; ``version`` is the policy version the task used (for ``score``, the version
that generated the micro-batch; for ``sync``, the version being installed); ``step`` and
``sync`` events have ``mb = -1``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from enum import IntEnum
from typing import Literal

from digen.sched.admission import Admission, stale_cap
from digen.sched.costs import Costs
from digen.sched.names import Pool, TaskKind, worker_names
from digen.sched.plan import SchedulePlan
from digen.sched.scheduler import Scheduler
from digen.sched.tag import NoTAG, TagPolicy, make_tag_policy
from digen.sched.trace import Trace, TraceEvent

__all__ = ["SimResult", "ideal_bound", "simulate", "simulate_plan"]


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulation."""

    makespan: float
    """End of the last sync, in seconds from the start."""
    events: list[TraceEvent]
    """Every task, sorted by start time then worker."""
    step_ends: list[float]
    """When each step's sync ended."""
    tag_count: int
    """TAG micro-batches over the whole run."""
    bubble_count: int
    """Bubbles the policy was asked about."""
    decisions: list[bool]
    """The policy's answers, in order (True = TAG inserted)."""
    stale: dict[int, int]
    """Per step, micro-batches generated on an older version (TCSS)."""

    @property
    def step_times(self) -> list[float]:
        """Duration of each step (previous sync end to this one)."""
        out, prev = [], 0.0
        for t in self.step_ends:
            out.append(t - prev)
            prev = t
        return out

    @property
    def mean_step_time(self) -> float:
        """Makespan divided by the number of steps."""
        return self.makespan / len(self.step_ends)

    @property
    def trace(self) -> Trace:
        """The events as a :class:`Trace` (statistics, Chrome export, timeline plot)."""
        return Trace(self.events)


def simulate(
    costs: Costs,
    microbatches: int,
    generators: int,
    trainers: int,
    policy: TagPolicy | None = None,
    *,
    steps: int = 1,
    mbs_per_group: int = 1,
    max_staleness: int = 0,
    staleness_ratio: float = 0.0,
    staleness_schedule: str = "fixed",
    max_inflight: int | None = None,
    score_overlap: bool = False,
    group_updates: bool = False,
) -> SimResult:
    """Simulate ``steps`` train steps of ``microbatches`` micro-batches (rules in the module doc).

    ``policy`` (default :class:`NoTAG`) is asked at every bubble with a
    :class:`~digen.sched.state.SchedState`, exactly as the driver would ask it.
    ``group_updates``: a trainer takes a group's queued micro-batches in one update, which
    lasts :meth:`Costs.update_for` their count.
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not 0.0 <= staleness_ratio <= 1.0:
        raise ValueError(f"staleness_ratio must be in [0, 1], got {staleness_ratio!r}")
    plan = SchedulePlan(
        microbatches=microbatches,
        update_group=mbs_per_group,
        generators=generators,
        trainers=trainers,
        admission=Admission(
            max_staleness=max_staleness,
            stale_cap=stale_cap(microbatches, staleness_ratio),
            schedule=staleness_schedule,
            max_inflight=max_inflight,
            last_step=steps - 1,
        ),
        score_overlap=score_overlap,
        group_updates=group_updates,
    )
    return simulate_plan(plan, costs, policy=policy)


def simulate_plan(
    plan: SchedulePlan,
    costs: Costs,
    policy: TagPolicy | None | Literal["plan"] = "plan",
) -> SimResult:
    """Simulate the run ``plan`` describes, from step 0 to its last step, with ``costs`` and
    its TAG policy (``policy="plan"``; or pass one, None for :class:`NoTAG`). With
    ``plan.group_updates`` an update of several micro-batches lasts
    :meth:`~digen.sched.costs.Costs.update_for` their count."""
    if plan.admission.last_step is None:
        raise ValueError("the plan has no last step: nothing says when the simulation ends")
    steps = plan.admission.last_step + 1
    if policy == "plan":
        policy = make_tag_policy(plan.tag, plan.tag_k)
    pol = NoTAG() if policy is None else policy
    pol.reset()
    clock = _Clock(plan, costs, steps)
    decisions: list[bool] = []
    while (j := clock.run()) >= 0:
        d = bool(pol.decide(clock.sched.sched_state(j, clock.now, costs), costs))
        decisions.append(d)
        clock.decide(j, d)
    order = {name: i for i, name in enumerate(clock.names)}
    events = sorted(clock.events, key=lambda e: (e.t0, order[e.worker], e.t1))
    stale = Counter(
        e.step for e in events if e.kind in (TaskKind.GENERATE, TaskKind.TAG) and e.version < e.step
    )
    return SimResult(
        makespan=clock.now,
        events=events,
        step_ends=clock.step_ends,
        tag_count=clock.tag_total,
        bubble_count=clock.bubble_total,
        decisions=decisions,
        stale={s: stale.get(s, 0) for s in range(steps)},
    )


class _Phase(IntEnum):
    """Where the training side of the current step is."""

    TRAIN = 0
    WANT_STEP = 1
    STEPPING = 2
    WANT_SYNC = 3
    SYNCING = 4


class _Clock:
    """Time around a :class:`~digen.sched.scheduler.Scheduler` (module docstring).

    Lanes: generators ``0 .. G-1``, trainers ``G .. G+T-1``, then the scoring lanes.
    """

    def __init__(self, plan: SchedulePlan, costs: Costs, steps: int) -> None:
        self.sched = Scheduler(plan)
        self.costs = costs
        self.updating: dict[int, list[int]] = {}
        """Per trainer lane, the micro-batches its update takes (several: a group's)."""
        g, t = plan.generators, plan.trainers
        self.g, self.workers = g, g + t
        self.lanes = g if plan.score_overlap else 0
        self.names = (
            worker_names(Pool.GENERATOR, g)
            + worker_names(Pool.TRAINER, t)
            + worker_names(Pool.SCORER, self.lanes)
        )
        n = len(self.names)
        self.cost = {
            TaskKind.GENERATE: costs.gen,
            TaskKind.TAG: costs.gen_tag,
            TaskKind.SCORE: costs.score,
            TaskKind.UPDATE: costs.update,
            TaskKind.STEP: costs.step,
            TaskKind.SYNC: costs.sync,
        }
        self.horizon = steps
        rule = plan.admission
        self.fixed_quota = rule.quota(rule.first_step + 1) > 0
        self.now = 0.0
        self.phase = _Phase.TRAIN
        self.ends = [math.inf] * n
        """Per lane, when its task ends (inf: idle)."""
        self.tasks: list[TraceEvent | None] = [None] * n
        """Per lane, its task (its end still to come)."""
        self.events: list[TraceEvent] = []
        self.step_ends: list[float] = []
        self.tag_total = self.bubble_total = 0
        self.serve = True
        """Free workers may not all have been asked since the last change."""

    # -- running ----------------------------------------------------------------------------

    def run(self) -> int:
        """Advance to the next bubble: the index of the trainer at it, or -1 once the
        horizon's last sync has ended (``now`` is then its end)."""
        while True:
            if self.serve:
                j = self._serve()
                if j >= 0:
                    return j
                self.serve = False
            t = min(self.ends)
            if t == math.inf:  # cannot happen with G, T >= 1; guards against a silent hang
                raise RuntimeError("the schedule stalled with work left")
            self.now = t
            ending = [i for i, end in enumerate(self.ends) if end == t]
            for i in sorted(ending, key=lambda i: (self.tasks[i].step, self.tasks[i].mb, i)):
                self._finish(i)
            if self.phase != _Phase.TRAIN or self._updated() == self.sched.plan.microbatches:
                self._advance()
                if self.sched.version >= self.horizon:
                    return -1
            self.serve = True

    def decide(self, trainer: int, insert: bool) -> None:
        """The policy's answer at trainer ``trainer``'s bubble."""
        self.bubble_total += 1
        mb = self.sched.answer(trainer, insert)
        if mb is not None:
            self.tag_total += 1
            v = self.sched.version
            self._start(self.g + trainer, TaskKind.TAG, mb.step, mb.mb, v)

    # -- internals --------------------------------------------------------------------------

    def _start(self, i: int, kind: TaskKind, step: int, mb: int, version: int) -> None:
        self.sched.started(self.names[i], kind, step, mb, self.now)
        self.tasks[i] = TraceEvent(kind, self.names[i], step, mb, version, self.now, self.now)
        self.ends[i] = self.now + self.cost[kind]

    def _busy(self, lanes: range) -> bool:
        return any(self.ends[i] != math.inf for i in lanes)

    def _updated(self) -> int:
        rec = self.sched.record(self.sched.version)
        return len(rec.trained) + len(rec.dropped)

    def _quota_pending(self) -> bool:
        return self.fixed_quota and self.sched.quota_pending(self.sched.version + 1)

    def _serve(self) -> int:
        """Ask the free workers what they run: lanes, generators, then trainers (those
        waiting first), each by index. Returns a trainer at a bubble, or -1."""
        sched, g, n = self.sched, self.g, self.workers
        for x in range(self.lanes):
            if self.ends[n + x] == math.inf and (work := sched.lane_work(x)) is not None:
                self._start(n + x, TaskKind.SCORE, work.mb.step, work.mb.mb, work.version)
        phase = self.phase
        if phase < _Phase.WANT_SYNC or (phase == _Phase.WANT_SYNC and self._quota_pending()):
            for i in range(g):
                if self.ends[i] != math.inf:
                    continue
                work = sched.generator_work(i)
                if work is None:
                    break
                version = work.version if work.kind == TaskKind.SCORE else sched.gen_version[i]
                self._start(i, work.kind, work.mb.step, work.mb.mb, version)
        if phase != _Phase.TRAIN:
            return -1
        v = sched.version
        free = [j for j in range(sched.trainers) if self.ends[g + j] == math.inf]
        waiting = [j for j in free if j in sched.waiting]  # served first
        for j in waiting + [j for j in free if j not in waiting]:
            if ms := sched.take_updates(v):
                self._start(g + j, TaskKind.UPDATE, v, ms[0], v)
                self.ends[g + j] = self.now + self.costs.update_for(len(ms))
                if len(ms) > 1:
                    self.updating[g + j] = ms
            elif j not in sched.waiting and sched.at_bubble(j, v):
                return j
        return -1

    def _finish(self, i: int) -> None:
        """Lane ``i``'s task ends now: it takes effect."""
        task = self.tasks[i]
        assert task is not None
        done = TraceEvent(
            task.kind, task.worker, task.step, task.mb, task.version, task.t0, self.now
        )
        self.events.append(done)
        self.tasks[i], self.ends[i] = None, math.inf
        sched = self.sched
        sched.finished(task.worker)
        if task.kind in (TaskKind.STEP, TaskKind.SYNC):
            return
        mb = sched.record(task.step).mbs[task.mb]
        if task.kind in (TaskKind.GENERATE, TaskKind.TAG):
            sched.generated(mb, task.worker, task.version)
            if task.kind == TaskKind.GENERATE and not self.lanes:  # scored where it was made
                self._start(i, TaskKind.SCORE, task.step, task.mb, task.version)
        elif task.kind == TaskKind.SCORE:
            if sched.scored(mb, [0.0] * len(mb.samples), {}):  # its group: onto UQ together
                for other in sched.record(task.step).group(mb.prompt):
                    sched.queued(task.step, other.mb)
        elif task.kind == TaskKind.UPDATE:
            for m in self.updating.pop(i, [task.mb]):
                sched.trained(task.step, m, None)

    def _advance(self) -> None:
        """The step's end: all trainers step once their updates are done; then, once the
        generators and trainers are free (and the fixed TCSS quota is out), all sync; then the
        version moves."""
        sched, g, n = self.sched, self.g, self.workers
        trainers = range(g, n)
        while True:
            v = sched.version
            if self.phase == _Phase.TRAIN:
                if self._updated() < sched.plan.microbatches:
                    return
                self.phase = _Phase.WANT_STEP
            elif self.phase == _Phase.WANT_STEP:
                if self._busy(trainers):
                    return
                for j in trainers:
                    self._start(j, TaskKind.STEP, v, -1, v)
                sched.waiting.clear()
                self.phase = _Phase.STEPPING
                return
            elif self.phase == _Phase.STEPPING:
                if self._busy(trainers):
                    return
                self.phase = _Phase.WANT_SYNC
            elif self.phase == _Phase.WANT_SYNC:
                if self._busy(range(n)) or self._quota_pending():
                    return
                for i in range(n):
                    self._start(i, TaskKind.SYNC, v, -1, v + 1)
                self.phase = _Phase.SYNCING
                return
            else:
                if self._busy(range(n)):
                    return
                sched.advance(v + 1)
                sched.gen_version = [v + 1] * g
                self.step_ends.append(self.now)
                self.phase = _Phase.TRAIN
                return


def ideal_bound(
    costs: Costs,
    microbatches: int,
    generators: int,
    trainers: int,
    *,
    score_overlap: bool = False,
) -> float:
    """``max(total work / workers, critical path)`` for one train step, in seconds.

    Total work counts each generation at the cheaper of ``gen`` and ``gen_tag``, plus every
    score (unless scoring runs on lanes beside the generators, ``score_overlap``: then the
    scores must fit on the ``generators`` lanes instead) and update, the optimizer step on
    every trainer and the sync on every worker. The critical path is one micro-batch's
    chain: generate, score, update, step, sync. No schedule of the step can be shorter.
    """
    b, n = microbatches, generators + trainers
    gen = min(costs.gen, costs.gen_tag)  # type: ignore[type-var]
    scores = 0.0 if score_overlap else b * costs.score
    work = b * (gen + costs.update) + scores + trainers * costs.step + n * costs.sync
    path = gen + costs.score + costs.update + costs.step + costs.sync
    if not score_overlap:
        return max(work / n, path)
    # the lanes: every score on them, then one update, the step and the sync after the last
    lanes = b * costs.score / generators + costs.update + costs.step + costs.sync
    return max(work / n, path, lanes)
