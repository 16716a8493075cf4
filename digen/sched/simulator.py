"""Discrete-event simulation of a disaggregated run: G generators, T trainers, S train steps.

The simulator applies the runtime's queue priorities exactly (``digen/runtime/driver/loop.py``),
so that a TAG policy tuned here behaves the same in a real run and so that the search, which
runs this very model forward, predicts what the driver will do.

It follows the schedule's rules (:mod:`digen.sched`) with the numbers of a
:class:`~digen.sched.plan.SchedulePlan`.

Events use the runtime's format (:class:`~digen.sched.trace.TraceEvent`): kinds ``generate``
/ ``tag`` / ``score`` / ``update`` / ``step`` / ``sync``, workers ``generator-i`` /
``trainer-j`` / ``scorer-i``; ``version`` is the policy version the task used (for ``score``, the version
that generated the micro-batch; for ``sync``, the version being installed); ``step`` and
``sync`` events have ``mb = -1``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Literal

from digen.sched._engine import Engine, Model
from digen.sched.admission import Admission, stale_cap
from digen.sched.costs import Costs
from digen.sched.names import TaskKind
from digen.sched.plan import SchedulePlan
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
) -> SimResult:
    """Simulate ``steps`` train steps of ``microbatches`` micro-batches (rules in the module doc).

    ``policy`` (default :class:`NoTAG`) is asked at every bubble with a
    :class:`~digen.sched.state.SchedState`, exactly as the driver would ask it.
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
    )
    return simulate_plan(plan, costs, policy=policy)


def simulate_plan(
    plan: SchedulePlan,
    costs: Costs,
    policy: TagPolicy | None | Literal["plan"] = "plan",
) -> SimResult:
    """Simulate the run ``plan`` describes, from step 0 to its last step, with ``costs`` and
    its TAG policy (``policy="plan"``; or pass one, None for :class:`NoTAG`)."""
    if plan.admission.last_step is None:
        raise ValueError("the plan has no last step: nothing says when the simulation ends")
    steps = plan.admission.last_step + 1
    if policy == "plan":
        policy = make_tag_policy(plan.tag, plan.tag_k)
    pol = NoTAG() if policy is None else policy
    pol.reset()
    eng = Engine(Model(plan, costs), horizon=steps, record=True)
    decisions: list[bool] = []
    while True:
        j = eng.run()
        if j < 0:
            break
        d = bool(pol.decide(eng.to_state(j), costs))
        decisions.append(d)
        eng.decide(j, d)
    order = {name: i for i, name in enumerate(eng.model.names)}
    assert eng.events is not None
    events = sorted(eng.events, key=lambda e: (e.t0, order[e.worker], e.t1))
    stale = Counter(
        e.step for e in events if e.kind in (TaskKind.GENERATE, TaskKind.TAG) and e.version < e.step
    )
    return SimResult(
        makespan=eng.now,
        events=events,
        step_ends=eng.step_ends,
        tag_count=eng.tag_total,
        bubble_count=eng.bubble_total,
        decisions=decisions,
        stale={s: stale.get(s, 0) for s in range(steps)},
    )


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
