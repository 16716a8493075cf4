"""Trainer-assisted generation (TAG) policies and the bubble-triggered search (BTS).

The driver (and the simulator) call a policy at every trainer *bubble* — a free trainer, an
empty UQ, the step not finished, and a micro-batch left that may start now::

    insert = policy.decide(state, costs)   # state: SchedState, costs: Costs
    # True: this trainer generates the next micro-batch now (TAG); False: it waits for UQ
    # and is not asked again until it has done an update.

Policies:

- :class:`NoTAG` never inserts;
- :class:`StaticTAG` ``(k)`` inserts at the bubbles of a step until it has inserted ``k`` TAG
  micro-batches in that step, then never again (at the start of a step every trainer meets a
  bubble, so these are the "k TAG micro-batches before updates start");
- :class:`BTS` runs :func:`search` at every bubble with the costs it is given (fresh
  estimates each time) and answers with the first decision of the best schedule found.

:func:`search` is the paper's recursive bubble-triggered search: from the bubble, run the
model (``_engine.Engine``, the simulator's own rules) forward to the next bubble under
*skip* and under *insert*, recursively, and keep the schedule whose step ends (sync done)
first. A state is compressed to counters and relative clocks (pending, ready, updated,
per-worker time-to-free and task, queue contents by step and GAP group); identical
compressed states share one answer (memo), and a branch whose lower bound cannot beat the
best schedule found so far is cut (branch and bound; bounds in ``Engine.lower_bound``).

The search is depth-first and *anytime*. Its first dive follows the previous bubble's plan,
then a greedy heuristic (:func:`_greedy`), and always completes; the never-TAG schedule is
the first incumbent when there is no plan. Alternatives are then explored deepest first —
the end of a step, where TAG decisions matter most — until ``node_limit`` nodes have been
expanded; past it the open branches are abandoned and the result says ``exact=False``.
Within budget the answer is optimal over all skip/insert sequences, which
:func:`brute_force` checks by enumeration on small instances.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from digen.sched._engine import GEN, TAG, UPDATE, Engine
from digen.sched.costs import Costs, OnlineProfiler
from digen.sched.names import Pool
from digen.sched.state import SchedState, WorkerClock

if TYPE_CHECKING:
    from digen.sched.scheduler import Scheduler

__all__ = [
    "BTS",
    "TAG_POLICIES",
    "make_tag_policy",
    "BTSStats",
    "NoTAG",
    "SchedState",
    "SearchResult",
    "StaticTAG",
    "TagPolicy",
    "WorkerClock",
    "brute_force",
    "decide_at_bubble",
    "search",
]

_INF = math.inf


class TagPolicy(ABC):
    """Decides, at a trainer bubble, whether that trainer generates one micro-batch now."""

    name: str = "tag-policy"

    @abstractmethod
    def decide(self, state: SchedState, costs: Costs) -> bool:
        """True: the trainer at ``state.trainer`` generates the next micro-batch (TAG)."""

    def reset(self) -> None:  # noqa: B027 - optional hook, a no-op for stateless policies
        """Forget anything learnt from an earlier run (called before each simulation)."""


class NoTAG(TagPolicy):
    """Never uses trainers for generation: the plain disaggregated schedule."""

    name = "none"

    def decide(self, state: SchedState, costs: Costs) -> bool:
        return False


class StaticTAG(TagPolicy):
    """Insert at bubbles until ``k`` TAG micro-batches were inserted in this step (``state.tags``)."""

    def __init__(self, k: int) -> None:
        if not isinstance(k, int) or k < 0:
            raise ValueError(f"StaticTAG k must be an integer >= 0, got {k!r}")
        self.k = k
        self.name = f"static-{k}"

    def decide(self, state: SchedState, costs: Costs) -> bool:
        return state.tags < self.k


@dataclass(frozen=True)
class SearchResult:
    """Best schedule from one bubble to the end of its train step."""

    makespan: float
    """Predicted end of the step's sync under :attr:`plan`, in seconds (absolute)."""
    insert: bool
    """The decision for the bubble searched from (first entry of :attr:`plan`)."""
    plan: tuple[bool, ...]
    """Decisions at this and every later bubble of the step, in order."""
    exact: bool
    """True when the search finished within its budget: :attr:`makespan` is then optimal."""
    nodes: int
    """Bubbles (search-tree nodes) expanded; the first complete dive is never cut, so it can
    exceed the budget on long steps."""
    elapsed_ms: float
    """Wall time of the search."""


# -- heuristic used for incumbents and child ordering ---------------------------------------


def _greedy(eng: Engine) -> bool:
    """The heuristic answer: insert when either rule below says so.

    - *sooner*: a TAG would finish the next micro-batch before a generator could (one is
      free once its running task and its share of the queued scoring are done: scoring has
      priority);
    - *balance*: with this TAG, the trainers' remaining work (running tasks, updates not yet
      started, the TAG) still ends no later than the generators' (running tasks, pending
      generations, scores the step still needs), each spread evenly over its pool. TAG adds
      generation throughput while there is plenty left to generate, and stops once the
      trainers would become the tail.
    """
    model = eng.model
    now = eng.now
    kind, busy, wstep = eng.kind, eng.busy, eng.wstep
    v = eng.version
    free = _INF
    gsum = 0.0
    to_score = 0  # micro-batches of this step still to be scored
    queued = len(eng.sq)  # everything in SQ or being generated must be scored first
    for i in range(model.generators):
        k = kind[i]
        if not k:
            free = 0.0
            continue
        a = busy[i] - now
        gsum += a
        if a < free:
            free = a
        if k == GEN:
            queued += 1
            to_score += wstep[i] == v
    tsum = 0.0
    updates = 0
    for j in range(model.generators, model.workers):
        k = kind[j]
        if k:
            tsum += busy[j] - now
            if k == UPDATE:
                updates += 1
            elif k == TAG:
                queued += 1
                to_score += wstep[j] == v
    if model.tag_cost <= free + queued * model.score_cost / model.generators + model.gen_cost:
        return True
    to_score += sum(1 for e in eng.sq if e[0] == v)
    pending = model.microbatches - eng.fm if eng.fs == v else 0
    to_score += pending
    not_started = model.microbatches - eng.updated - updates
    gen_end = (gsum + pending * model.gen_cost + to_score * model.score_cost) / model.generators
    return (tsum + model.tag_cost + not_started * model.update_cost) / model.trainers <= gen_end


def _follow(
    eng: Engine, trainer: int, decisions: tuple[bool, ...] | None, fixed: bool | None
) -> tuple[float, tuple[bool, ...]]:
    """Finish ``eng`` answering with ``decisions`` in order (then greedy), or always ``fixed``."""
    plan: list[bool] = []
    j = trainer
    while True:
        if fixed is not None:
            d = fixed
        elif decisions is not None and len(plan) < len(decisions):
            d = decisions[len(plan)]
        else:
            d = _greedy(eng)
        plan.append(d)
        eng.decide(j, d)
        j = eng.run()
        if j < 0:
            return eng.now, tuple(plan)


# -- the search -----------------------------------------------------------------------------


class _Memo:
    """Answers per compressed state, valid for one (costs, configuration, version)."""

    __slots__ = ("exact", "lower", "tag")

    def __init__(self, tag: tuple) -> None:
        self.tag = tag
        self.exact: dict[tuple, tuple[float, tuple]] = {}  # key -> (time to finish, plan cons)
        self.lower: dict[tuple, float] = {}  # key -> time to finish is at least this


class _Searcher:
    __slots__ = ("memo", "nodes", "limit", "deadline", "complete", "guide", "found", "hits")

    def __init__(self, memo: _Memo, limit: int, deadline: float, guide: tuple[bool, ...]):
        self.memo = memo
        self.nodes = 0
        self.limit = limit
        self.deadline = deadline
        self.complete = True
        self.guide = guide
        self.found = False  # the budget only applies once one complete schedule is known
        self.hits = 0

    def solve(self, eng: Engine, j: int, bound: float, gi: int) -> tuple[float, tuple]:
        """Best finish from ``eng`` (stopped at trainer ``j``'s bubble).

        Returns ``(value, plan)``: when ``value < bound`` it is achieved by ``plan`` (a cons
        list ``(decision, rest)``); otherwise ``value`` is only a lower bound (``plan = ()``).
        ``gi`` is the position in the guide plan while the path still follows it, else -1.
        """
        memo = self.memo
        key = eng.key()
        now = eng.now
        hit = memo.exact.get(key)
        if hit is not None:
            self.hits += 1
            return now + hit[0], hit[1]
        lb = eng.lower_bound(bound)
        lo = memo.lower.get(key)
        if lo is not None and now + lo > lb:
            lb = now + lo
        if lb >= bound:
            return lb, ()
        if self.found and (
            self.nodes >= self.limit
            or (
                self.nodes & 31 == 0
                and self.deadline < _INF
                and time.perf_counter() > self.deadline
            )
        ):
            # Out of budget: abandon this branch. Reporting it as "no better than the bound"
            # keeps what was already found; nothing is memoised from here on.
            self.complete = False
            self.limit = -1
            return _INF, ()
        self.nodes += 1

        guide = self.guide
        first = guide[gi] if 0 <= gi < len(guide) else _greedy(eng)
        best, best_plan = _INF, None  # best exact child value and its plan
        lowest = _INF  # smallest lower bound among children that could not beat their bound
        for d in (first, not first):
            if best_plan is None:
                b = bound
            elif d:  # insert must beat skip strictly
                b = min(bound, best)
            else:  # skip wins ties
                b = min(bound, math.nextafter(best, _INF))
            if lb >= b:
                v, p = lb, ()
            else:
                c = eng.clone()
                c.decide(j, d)
                jj = c.run()
                if jj < 0:
                    v, p = c.now, ()
                    self.found = True
                else:
                    v, p = self.solve(c, jj, b, gi + 1 if gi >= 0 and d == first else -1)
            if v < b:
                if best_plan is None or v < best or (not d and v <= best):
                    best, best_plan = v, (d, p)
            elif v < lowest:
                lowest = v
        if best_plan is not None:  # exact: every other child is known to be no better
            if self.complete:
                memo.exact[key] = (best - now, best_plan)
            return best, best_plan
        if self.complete:
            prev = memo.lower.get(key)
            if prev is None or lowest - now > prev:
                memo.lower[key] = lowest - now
        return lowest, ()


def _memo_tag(state: SchedState, costs: Costs) -> tuple:
    return (costs.as_tuple(), state.plan, state.step)


def search(
    state: SchedState,
    costs: Costs,
    *,
    node_limit: int = 32,
    time_limit_ms: float | None = None,
    incumbent: tuple[bool, ...] | None = None,
    _memo: _Memo | None = None,
) -> SearchResult:
    """Best TAG schedule from ``state`` to the end of its train step (paper Algorithm 2).

    ``node_limit`` caps the bubbles expanded once a first complete schedule is known
    (deterministic; ``time_limit_ms`` adds a wall-clock cap): past it the open branches are
    abandoned and the best schedule found is returned with ``exact=False``. The first dive
    follows ``incumbent`` (e.g. the rest of the previous bubble's plan), then the greedy
    heuristic, and is never cut, so the answer is never worse than following ``incumbent``;
    without one, it is never worse than never inserting (NoTAG).
    """
    if not isinstance(node_limit, int) or node_limit < 1:
        raise ValueError(f"node_limit must be an integer >= 1, got {node_limit!r}")
    if time_limit_ms is not None and not time_limit_ms > 0:
        raise ValueError(f"time_limit_ms must be > 0 or None, got {time_limit_ms!r}")
    t0 = time.perf_counter()
    deadline = _INF if time_limit_ms is None else t0 + time_limit_ms / 1000.0
    root = Engine.from_state(state, costs)
    j = root.run()
    if j < 0:  # nothing to decide before the step ends
        return SearchResult(root.now, False, (), True, 0, (time.perf_counter() - t0) * 1e3)

    # Incumbent: without a plan to follow, never-TAG (so a first decision is never predicted
    # worse than NoTAG); with one, the first dive follows it (then the greedy heuristic), so
    # re-planning with unchanged costs never predicts worse than the previous plan.
    if incumbent:
        inc_val, inc_plan = _INF, ()
    else:
        inc_val, inc_plan = _follow(root.clone(), j, None, False)
    tag = _memo_tag(state, costs)
    memo = _memo if _memo is not None and _memo.tag == tag else _Memo(tag)
    s = _Searcher(memo, node_limit, deadline, tuple(incumbent or ()))
    val, cons = s.solve(root, j, math.nextafter(inc_val, _INF), 0)
    if val <= inc_val and cons:
        plan: list[bool] = []
        while cons:
            plan.append(cons[0])
            cons = cons[1]
        best_val, best_plan = val, tuple(plan)
    else:
        best_val, best_plan = inc_val, inc_plan
    return SearchResult(
        makespan=best_val,
        insert=best_plan[0],
        plan=best_plan,
        exact=s.complete,
        nodes=s.nodes,
        elapsed_ms=(time.perf_counter() - t0) * 1e3,
    )


def brute_force(state: SchedState, costs: Costs, *, max_leaves: int = 1 << 20) -> SearchResult:
    """Try every skip/insert sequence from ``state`` to the end of its step (small cases only).

    Ties go to the sequence that skips earliest (the enumeration tries skip first).
    """
    t0 = time.perf_counter()
    root = Engine.from_state(state, costs)
    j = root.run()
    if j < 0:
        return SearchResult(root.now, False, (), True, 0, (time.perf_counter() - t0) * 1e3)
    best: list = [_INF, ()]
    count = [0, 0]  # leaves, nodes

    def walk(eng: Engine, trainer: int, plan: tuple[bool, ...]) -> None:
        count[1] += 1
        for d in (False, True):
            c = eng.clone()
            c.decide(trainer, d)
            jj = c.run()
            p = (*plan, d)
            if jj >= 0:
                walk(c, jj, p)
                continue
            count[0] += 1
            if count[0] > max_leaves:
                raise ValueError(f"brute force needs more than max_leaves={max_leaves} schedules")
            if c.now < best[0]:
                best[0], best[1] = c.now, p

    walk(root, j, ())
    return SearchResult(
        makespan=best[0],
        insert=best[1][0],
        plan=best[1],
        exact=True,
        nodes=count[1],
        elapsed_ms=(time.perf_counter() - t0) * 1e3,
    )


@dataclass
class BTSStats:
    """What a :class:`BTS` policy's searches cost during one run."""

    decisions: int = 0
    """Bubbles decided."""
    inexact: int = 0
    """Decisions whose search hit its budget."""
    nodes: int = 0
    """Search nodes expanded, all decisions together."""
    ms: list[float] = field(default_factory=list)
    """Wall time of each decision's search, in milliseconds."""


class BTS(TagPolicy):
    """Bubble-triggered search: re-plan the rest of the step at every bubble (see :func:`search`).

    Stateful between bubbles of a run: the rest of the last plan guides the next search of
    the same step, and when the costs, configuration and step are unchanged the memo is
    reused too (a real run feeds fresh estimates each time, so there it is rebuilt).
    ``stats`` (:class:`BTSStats`) keeps per-decision search times for reporting.
    """

    name = "bts"

    def __init__(
        self, *, node_limit: int = 32, time_limit_ms: float | None = None, reuse: bool = True
    ) -> None:
        if not isinstance(node_limit, int) or node_limit < 1:
            raise ValueError(f"BTS node_limit must be an integer >= 1, got {node_limit!r}")
        self.node_limit = node_limit
        self.time_limit_ms = time_limit_ms
        self.reuse = reuse
        self.reset()

    def reset(self) -> None:
        self._plan: tuple[bool, ...] = ()
        self._plan_step = -1
        self._memo: _Memo | None = None
        self.stats = BTSStats()
        self.last: SearchResult | None = None

    def decide(self, state: SchedState, costs: Costs) -> bool:
        memo = self._memo if self.reuse else None
        if memo is None or memo.tag != _memo_tag(state, costs):
            memo = _Memo(_memo_tag(state, costs))
        res = search(
            state,
            costs,
            node_limit=self.node_limit,
            time_limit_ms=self.time_limit_ms,
            incumbent=(self._plan or None) if self._plan_step == state.step else None,
            _memo=memo,
        )
        self._memo = memo if self.reuse else None
        self._plan = res.plan[1:]
        self._plan_step = state.step
        self.last = res
        st = self.stats
        st.decisions += 1
        st.inexact += not res.exact
        st.nodes += res.nodes
        st.ms.append(res.elapsed_ms)
        return res.insert


class TagPolicyName(StrEnum):
    """The values ``runtime.schedule.tag`` accepts."""

    BTS = "bts"
    STATIC = "static"
    NONE = "none"


TAG_POLICIES: dict[str, Callable[[int], TagPolicy | None]] = {
    TagPolicyName.BTS: lambda k: BTS(),
    TagPolicyName.STATIC: StaticTAG,
    TagPolicyName.NONE: lambda k: None,
}
"""``runtime.schedule.tag`` names -> a factory taking ``runtime.schedule.tag_k`` (None:
trainers only train)."""


def make_tag_policy(name: str, k: int) -> TagPolicy | None:
    """The TAG policy ``runtime.schedule.tag = name`` selects (``k``:
    ``runtime.schedule.tag_k``)."""
    return TAG_POLICIES[name](k)


def decide_at_bubble(
    policy: TagPolicy | None,
    profiler: OnlineProfiler,
    sched: Scheduler,
    trainer: int,
    clock: Callable[[], float],
) -> bool:
    """A running driver's TAG decision at trainer ``trainer``'s bubble, on the costs the run
    has measured so far. The run's first bubble is a probe: one TAG times the trainer's
    generation, as the paper does. While remakes are pending the trainer waits (the state the
    search plans on cannot show them)."""
    if policy is None:
        return False
    if not profiler.seen("gen_tag"):
        return True
    if not profiler.ready() or not sched.plannable:
        return False
    costs = profiler.costs(generator_pool=Pool.GENERATOR, trainer_pool=Pool.TRAINER)
    return policy.decide(sched.sched_state(trainer, clock(), costs), costs)
