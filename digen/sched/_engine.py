"""The discrete-event model of the two pools, shared by the simulator and the TAG search.

One small class, :class:`Engine`, advances the schedule from one trainer bubble to the next
and stops there for a decision. The simulator asks a policy at each stop and records trace
events; the search clones the engine at each stop and explores both answers. Having a single
model is what makes "the search agrees with brute force" and "the search agrees with the
simulator" the same statement.

The rules it applies, ties included, are the schedule's (:mod:`digen.sched`); its
numbers come from the run's :class:`~digen.sched.plan.SchedulePlan`.
"""

from __future__ import annotations

import math

from digen.sched.costs import Costs
from digen.sched.names import Pool, TaskKind, worker_names
from digen.sched.plan import SchedulePlan
from digen.sched.state import WORKER_KINDS, SchedState, WorkerClock
from digen.sched.trace import TraceEvent

_CODE = {kind: i for i, kind in enumerate(WORKER_KINDS)}
"""Task kinds as small ints, for speed: their positions in ``WORKER_KINDS`` (0 = idle)."""
IDLE = _CODE[None]
GEN, TAG, SCORE = _CODE[TaskKind.GENERATE], _CODE[TaskKind.TAG], _CODE[TaskKind.SCORE]
UPDATE, STEP, SYNC = _CODE[TaskKind.UPDATE], _CODE[TaskKind.STEP], _CODE[TaskKind.SYNC]
_INF = math.inf

# Training-side phase of the current step.
_TRAIN, _WANT_STEP, _STEPPING, _WANT_SYNC, _SYNCING = range(5)


class Model:
    """What the engine models, fixed for a run: its :class:`~digen.sched.plan.SchedulePlan`
    and the costs of each kind of task, in flat slots read in the engine's inner loops."""

    __slots__ = (
        "plan",
        "microbatches",
        "generators",
        "trainers",
        "workers",
        "scorers",
        "lanes",
        "group",
        "admission",
        "fixed_quota",
        "names",
        "gen_cost",
        "tag_cost",
        "score_cost",
        "update_cost",
        "step_cost",
        "sync_cost",
        "cheapest_gen",
        "costs",
        "prompt_mbs",
        "update_least",
    )

    def __init__(self, plan: SchedulePlan, costs: Costs) -> None:
        self.plan = plan
        self.microbatches = plan.microbatches
        """``B``: micro-batches per train step."""
        self.generators, self.trainers = plan.generators, plan.trainers
        self.workers = plan.generators + plan.trainers
        self.scorers = plan.generators if plan.score_overlap else 0
        """Scoring lanes: one per generator when scoring overlaps generation, else none."""
        self.lanes = self.workers + self.scorers
        """Lanes the engine tracks: generators, trainers, then scoring lanes (indices >= workers)."""
        self.group = plan.update_group
        """Micro-batches that enter UQ together (a GAP group, or the whole step)."""
        self.admission = plan.admission
        self.fixed_quota = self.admission.quota(self.admission.first_step + 1) > 0
        """Fixed TCSS schedule with a non-empty quota: the sync waits for the early ones."""
        self.names = (
            worker_names(Pool.GENERATOR, self.generators)
            + worker_names(Pool.TRAINER, self.trainers)
            + worker_names(Pool.SCORER, self.scorers)
        )
        self.gen_cost, self.tag_cost = costs.gen, costs.gen_tag
        self.score_cost, self.update_cost = costs.score, costs.update
        self.step_cost, self.sync_cost = costs.step, costs.sync
        self.cheapest_gen = min(self.gen_cost, self.tag_cost)
        self.costs = costs
        self.prompt_mbs = plan.layout.per_group if plan.layout else plan.update_group
        """Grouped updates (``plan.group_updates``): a prompt group's micro-batches, taken
        together (the model does not split a group by the version that made it, as the
        scheduler does under TCSS)."""
        self.update_least = (
            costs.update_for(self.prompt_mbs) / self.prompt_mbs
            if plan.group_updates
            else costs.update
        )
        """The least an update costs a micro-batch (a bound's)."""


class Engine:
    """Mutable schedule state plus the rules that advance it (see the module docstring)."""

    __slots__ = (
        "model",
        "horizon",
        "events",
        "now",
        "version",
        "phase",
        "busy",
        "kind",
        "wstep",
        "wmb",
        "wver",
        "wt0",
        "wcount",
        "waiting",
        "sq",
        "tsq",
        "uq",
        "scored",
        "updated",
        "fs",
        "fm",
        "untrained",
        "dispatch",
        "tags",
        "bubbles",
        "done",
        "step_ends",
        "tag_total",
        "bubble_total",
        "log",
    )

    def __init__(
        self, model: Model, *, horizon: int, record: bool = False, log: bool = False
    ) -> None:
        n = model.lanes
        self.model = model
        self.horizon = horizon
        """Stop when the version reaches this (the number of steps to run from step 0)."""
        self.events: list[TraceEvent] | None = [] if record else None
        self.now = 0.0
        self.version = 0
        self.phase = _TRAIN
        self.busy = [_INF] * n  # expected end of the current task, seconds; inf when idle
        self.kind = [IDLE] * n
        self.wstep = [-1] * n
        self.wmb = [-1] * n
        self.wver = [-1] * n
        self.wt0 = [0.0] * n
        self.wcount = [1] * n  # micro-batches the running update takes (grouped: several)
        self.waiting = [False] * n  # used for trainers only (indices G..n-1)
        self.sq: list[tuple[int, int, int]] = []  # (step, mb, generation version), FIFO
        self.tsq: list[list[tuple[int, int, int]]] = [[] for _ in range(model.scorers)]
        """Per scoring lane, what its generator made and it has not started scoring, FIFO."""
        self.uq: dict[int, list[int]] = {}  # step -> ready micro-batch ids, FIFO
        self.scored: dict[tuple[int, int], int] = {}  # (step, group) -> scored, partial only
        self.updated = 0
        self.fs = 0  # frontier: next micro-batch to hand out is (fs, fm)
        self.fm = 0
        self.untrained = 0  # handed out, not yet trained (C_gen back-pressure)
        self.dispatch = True  # tasks at `now` have taken effect; free workers not yet served
        self.tags = 0
        self.bubbles = 0
        self.done = False
        self.step_ends: list[float] = []
        self.tag_total = 0
        self.bubble_total = 0
        self.log: list[tuple] | None = [] if log else None
        """With ``log=True``: every transition in order, to replay the history elsewhere:
        ``("take", step, mb, version)``, ``("start", worker, kind, step, mb, t)``,
        ``("finish", worker, kind, step, mb, version, t)``, ``("wait", trainer)``,
        ``("bubble", trainer, insert)``, ``("version", v)``."""

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def from_state(cls, state: SchedState, costs: Costs, *, steps: int = 1) -> Engine:
        """A model positioned at ``state``, to run ``steps`` train steps from its step."""
        model = Model(state.plan, costs)
        eng = cls(model, horizon=state.step + steps)
        now = float(state.now)
        eng.now = now
        eng.version = state.step
        for i, w in enumerate(state.generators + state.trainers + state.scorers):
            code = _CODE.get(w.kind, -1)
            if code < 0:
                raise ValueError(f"worker kind {w.kind!r} is not one of {WORKER_KINDS}")
            if code in (STEP, SYNC):
                raise ValueError("a bubble cannot be decided while the step or sync is running")
            eng.kind[i] = code
            if code:
                eng.busy[i] = max(float(w.busy_until), now)
                eng.wstep[i], eng.wmb[i], eng.wver[i] = w.step, w.mb, state.step
                eng.wt0[i] = now
                eng.wcount[i] = w.count
            eng.waiting[i] = w.waiting and i >= model.generators
        eng.sq = [(s, m, state.step) for s, m in state.sq]
        eng.tsq = [[(s, m, state.step) for s, m in q] for q in state.to_score]
        eng.uq = {state.step: list(range(state.uq))}
        eng.scored = {(s, g): c for s, g, c in state.partial_groups}
        eng.updated = state.updated
        eng.fs, eng.fm = state.next_mb
        eng.untrained = state.untrained
        eng.tags, eng.bubbles = state.tags, state.bubbles
        return eng

    def to_state(self, trainer: int) -> SchedState:
        """The :class:`SchedState` a policy sees at this stop (``trainer`` is at the bubble)."""
        model = self.model
        clocks = []
        for i in range(model.lanes):
            k = self.kind[i]
            if k:
                count = self.wcount[i] if k == UPDATE else 1
                clocks.append(
                    WorkerClock(
                        WORKER_KINDS[k], self.busy[i], self.wstep[i], self.wmb[i], count=count
                    )
                )
            else:
                clocks.append(WorkerClock(waiting=self.waiting[i]))
        return SchedState(
            now=self.now,
            trainer=trainer,
            plan=model.plan,
            step=self.version,
            generators=tuple(clocks[: model.generators]),
            trainers=tuple(clocks[model.generators : model.workers]),
            scorers=tuple(clocks[model.workers :]),
            next_mb=(self.fs, self.fm),
            sq=tuple((s, m) for s, m, _ in self.sq),
            to_score=tuple(tuple((s, m) for s, m, _ in q) for q in self.tsq),
            uq=len(self.uq.get(self.version, ())),
            updated=self.updated,
            partial_groups=tuple(sorted((s, g, c) for (s, g), c in self.scored.items())),
            untrained=self.untrained,
            tags=self.tags,
            bubbles=self.bubbles,
        )

    def clone(self) -> Engine:
        """An independent copy (trace recording is not carried over)."""
        c = Engine.__new__(Engine)
        c.model = self.model
        c.horizon = self.horizon
        c.events = None
        c.now = self.now
        c.version = self.version
        c.phase = self.phase
        c.busy = self.busy[:]
        c.kind = self.kind[:]
        c.wstep = self.wstep[:]
        c.wmb = self.wmb[:]
        c.wver = self.wver[:]
        c.wt0 = self.wt0[:]
        c.wcount = self.wcount[:]
        c.waiting = self.waiting[:]
        c.sq = self.sq[:]
        c.tsq = [q[:] for q in self.tsq]
        c.uq = {s: q[:] for s, q in self.uq.items()}
        c.scored = self.scored.copy()
        c.updated = self.updated
        c.fs = self.fs
        c.fm = self.fm
        c.untrained = self.untrained
        c.dispatch = self.dispatch
        c.tags = self.tags
        c.bubbles = self.bubbles
        c.done = self.done
        c.step_ends = self.step_ends[:]
        c.tag_total = self.tag_total
        c.bubble_total = self.bubble_total
        c.log = None
        return c

    # -- running ----------------------------------------------------------------------------

    def run(self) -> int:
        """Advance to the next bubble that needs a decision.

        Returns the index of the trainer at that bubble (0-based among trainers), or -1 when
        the horizon is reached (``self.now`` is then the end of the last sync).
        """
        busy = self.busy
        B = self.model.microbatches
        while True:
            if self.dispatch:
                j = self._dispatch()
                if j >= 0:
                    return j
                self.dispatch = False
            t = min(busy)
            if t == _INF:  # cannot happen with G, T >= 1; guards against a silent hang
                raise RuntimeError("the schedule stalled with work left")
            self.now = t
            if busy.count(t) == 1:
                self._finish(busy.index(t), t)
            else:
                ws, wm = self.wstep, self.wmb
                for _, _, i in sorted([(ws[i], wm[i], i) for i, b in enumerate(busy) if b == t]):
                    self._finish(i, t)
            if self.phase != _TRAIN or self.updated == B:
                self._advance_phase()
                if self.done:
                    return -1
            self.dispatch = True

    def decide(self, trainer: int, insert: bool) -> None:
        """Answer the bubble ``run`` stopped at: TAG one micro-batch, or wait for UQ."""
        j = self.model.generators + trainer
        self.bubbles += 1
        self.bubble_total += 1
        if self.log is not None:
            self.log.append(("bubble", trainer, insert))
        if insert:
            s, m = self._take()
            self._start(j, TAG, s, m, self.version, self.model.tag_cost)
            self.tags += 1
            self.tag_total += 1
        else:
            self.waiting[j] = True

    def finish(self, insert: bool = False) -> float:
        """Run to the horizon answering every bubble the same way; return the finish time."""
        while True:
            j = self.run()
            if j < 0:
                return self.now
            self.decide(j, insert)

    # -- internals --------------------------------------------------------------------------

    def _start(self, i: int, k: int, s: int, m: int, v: int, cost: float) -> None:
        if self.log is not None:
            self.log.append(("start", i, k, s, m, self.now))
        self.kind[i] = k
        self.wstep[i] = s
        self.wmb[i] = m
        self.wver[i] = v
        self.wt0[i] = self.now
        self.busy[i] = self.now + cost

    def _admissible(self) -> bool:
        """Whether the next micro-batch may start now (the admission rule)."""
        return self.model.admission.admits(self.fs, self.fm, self.version, self.untrained)

    def _quota_pending(self) -> bool:
        """Fixed TCSS: the next step's early micro-batches are not all handed out yet."""
        return self.model.fixed_quota and self.model.admission.quota_pending(
            self.version + 1, (self.fs, self.fm)
        )

    def _take(self) -> tuple[int, int]:
        s, m = self.fs, self.fm
        if m + 1 == self.model.microbatches:
            self.fs, self.fm = s + 1, 0
        else:
            self.fm = m + 1
        self.untrained += 1
        if self.log is not None:
            self.log.append(("take", s, m, self.version))
        return s, m

    def _dispatch(self) -> int:
        model = self.model
        kind = self.kind
        G, n = model.generators, model.workers
        ph = self.phase
        now = self.now
        busy, wstep, wmb, wver, wt0 = self.busy, self.wstep, self.wmb, self.wver, self.wt0
        sq = self.sq
        if model.scorers:  # scoring lanes: SQ first, then what their own generator made
            for i, q in enumerate(self.tsq):
                x = n + i
                if kind[x] == IDLE and (sq or q):
                    s, m, v = sq.pop(0) if sq else q.pop(0)
                    if self.log is not None:
                        self.log.append(("start", x, SCORE, s, m, now))
                    kind[x] = SCORE
                    wstep[x], wmb[x], wver[x], wt0[x] = s, m, v, now
                    busy[x] = now + model.score_cost
        if (ph < _WANT_SYNC or (ph == _WANT_SYNC and self._quota_pending())) and IDLE in kind[:G]:
            scores_here = not model.scorers
            for i in range(G):
                if kind[i] == IDLE:
                    if sq and scores_here:
                        s, m, v = sq.pop(0)
                        if self.log is not None:
                            self.log.append(("start", i, SCORE, s, m, now))
                        kind[i] = SCORE
                        wstep[i], wmb[i], wver[i], wt0[i] = s, m, v, now
                        busy[i] = now + model.score_cost
                    elif self._admissible():
                        s, m = self._take()
                        if self.log is not None:
                            self.log.append(("start", i, GEN, s, m, now))
                        kind[i] = GEN
                        wstep[i], wmb[i], wver[i], wt0[i] = s, m, self.version, now
                        busy[i] = now + model.gen_cost
                    else:
                        break
        if ph != _TRAIN or IDLE not in kind[G:n]:
            return -1
        waiting = self.waiting
        v = self.version
        uq = self.uq.get(v)
        if uq and True in waiting:
            for j in range(G, n):
                if kind[j] == IDLE and waiting[j]:
                    kind[j] = UPDATE
                    wstep[j], wmb[j], wver[j], wt0[j] = v, uq.pop(0), v, now
                    if self.log is not None:
                        self.log.append(("start", j, UPDATE, v, wmb[j], now))
                    busy[j] = now + self._update_cost(j, uq)
                    waiting[j] = False
                    if not uq:
                        break
        for j in range(G, n):
            if kind[j] == IDLE and not waiting[j]:
                if uq:
                    kind[j] = UPDATE
                    wstep[j], wmb[j], wver[j], wt0[j] = v, uq.pop(0), v, now
                    busy[j] = now + self._update_cost(j, uq)
                    if self.log is not None:
                        self.log.append(("start", j, UPDATE, v, wmb[j], now))
                elif self._admissible():
                    return j - G
                else:
                    waiting[j] = True
                    if self.log is not None:
                        self.log.append(("wait", j - G))
        return -1

    def _update_cost(self, j: int, uq: list[int]) -> float:
        """Trainer ``j`` starts the update of ``wmb[j]``: with grouped updates it takes the
        rest of that micro-batch's prompt group off ``uq`` too. Its seconds."""
        model = self.model
        if not model.plan.group_updates:
            return model.update_cost
        g = self.wmb[j] // model.prompt_mbs
        mates = [m for m in uq if m // model.prompt_mbs == g]
        for m in mates:
            uq.remove(m)
        self.wcount[j] = 1 + len(mates)
        return model.costs.update_for(self.wcount[j])

    def _finish(self, i: int, t: float) -> None:
        """Let worker ``i``'s task, ending at ``t``, take effect."""
        k = self.kind[i]
        s, m = self.wstep[i], self.wmb[i]
        if self.log is not None:
            self.log.append(("finish", i, k, s, m, self.wver[i], t))
        if self.events is not None:
            model = self.model
            self.events.append(
                TraceEvent(WORKER_KINDS[k], model.names[i], s, m, self.wver[i], self.wt0[i], t)
            )
        self.kind[i] = IDLE
        self.busy[i] = _INF
        self.wstep[i] = -1
        self.wmb[i] = -1
        if k == GEN:  # scored at once where it was made (or queued on its scoring lane)
            if self.model.scorers:
                self.tsq[i].append((s, m, self.wver[i]))
            else:
                self._start(i, SCORE, s, m, self.wver[i], self.model.score_cost)
        elif k == TAG:
            self.sq.append((s, m, self.wver[i]))
        elif k == SCORE:
            if self.model.group == 1:
                q = self.uq.get(s)
                if q is None:
                    self.uq[s] = [m]
                else:
                    q.append(m)
            else:
                self._scored(s, m)
        elif k == UPDATE:
            self.updated += self.wcount[i]
            self.untrained -= self.wcount[i]
            self.wcount[i] = 1

    def _scored(self, s: int, m: int) -> None:
        """GAP groups: a group enters UQ when its last micro-batch is scored."""
        gs = self.model.group
        g = m // gs
        size = min(gs, self.model.microbatches - g * gs)
        c = self.scored.get((s, g), 0) + 1
        if c < size:
            self.scored[(s, g)] = c
            return
        self.scored.pop((s, g), None)
        self.uq.setdefault(s, []).extend(range(g * gs, g * gs + size))

    def _advance_phase(self) -> None:
        model = self.model
        kind = self.kind
        G, n = model.generators, model.workers
        while True:
            ph = self.phase
            if ph == _TRAIN:
                if self.updated < model.microbatches:
                    return
                self.phase = _WANT_STEP
            elif ph == _WANT_STEP:
                if any(kind[j] for j in range(G, n)):
                    return
                v = self.version
                for j in range(G, n):
                    self._start(j, STEP, v, -1, v, model.step_cost)
                    self.waiting[j] = False
                self.phase = _STEPPING
                return
            elif ph == _STEPPING:
                if any(kind[j] for j in range(G, n)):
                    return
                self.phase = _WANT_SYNC
            elif ph == _WANT_SYNC:
                if any(kind[:n]) or self._quota_pending():
                    return
                v = self.version
                for i in range(n):
                    self._start(i, SYNC, v, -1, v + 1, model.sync_cost)
                self.phase = _SYNCING
                return
            else:  # _SYNCING
                if any(kind[:n]):
                    return
                self.uq.pop(self.version, None)
                self.version += 1
                if self.log is not None:
                    self.log.append(("version", self.version))
                self.step_ends.append(self.now)
                self.phase = _TRAIN
                self.updated = 0
                self.tags = 0
                self.bubbles = 0
                if self.version >= self.horizon:
                    self.done = True
                    return

    # -- search support ---------------------------------------------------------------------

    def key(self) -> tuple:
        """Everything that decides the rest of the current step, with clocks relative to now.

        Workers of a pool are interchangeable under the tie-breaking rules, so their entries
        are sorted; micro-batch identities matter only through their step and GAP group.
        Idle workers read as ``inf`` time to free.
        """
        model = self.model
        now = self.now
        busy, kind, wstep, waiting = self.busy, self.kind, self.wstep, self.waiting
        G, n, gs = model.generators, model.workers, model.group
        rel = [b - now for b in busy]
        if gs == 1:
            grp = wstep
            gk = tuple(sorted(zip(rel[:G], kind[:G], wstep[:G])))
            tk = tuple(sorted(zip(rel[G:n], kind[G:n], waiting[G:n], wstep[G:n])))
            sq: tuple = tuple([s for s, _, _ in self.sq])
            tsq = [tuple([s for s, _, _ in q]) for q in self.tsq]
            parts: tuple = ()
        else:
            grp = [m // gs if m >= 0 else -1 for m in self.wmb]
            gk = tuple(sorted(zip(rel[:G], kind[:G], wstep[:G], grp[:G])))
            tk = tuple(sorted(zip(rel[G:n], kind[G:n], waiting[G:n], wstep[G:n], grp[G:n])))
            sq = tuple([(s, m // gs) for s, m, _ in self.sq])
            tsq = [tuple([(s, m // gs) for s, m, _ in q]) for q in self.tsq]
            parts = tuple(sorted(self.scored.items()))
        # a scoring lane and its queue go together (the queue is only ever scored there)
        sk = tuple(sorted(zip(rel[n:], kind[n:], wstep[n:], grp[n:], tsq)))
        uq = self.uq.get(self.version)
        return (self.fs, self.fm, self.updated, len(uq) if uq else 0, gk, tk, sq, parts, sk)

    def lower_bound(self, bound: float = _INF) -> float:
        """A time the current step's sync cannot end before, whatever the TAG decisions.

        The largest of four relaxations, each followed by what must come after it:

        - trainers: their running tasks plus every update not started yet, spread evenly
          (then ``step`` and ``sync``);
        - generators (or, with scoring overlapped, the scoring lanes): their running tasks
          plus every score the step still needs, spread evenly (then one ``update``,
          ``step`` and ``sync``);
        - everything: all remaining work plus the optimizer step over all workers (then
          ``sync``);
        - the last pending micro-batch: the earliest time all pending generations can be
          done on generators and trainers together, as if work were divisible and never
          preempted by scoring (then ``score``, ``update``, ``step``, ``sync``).

        The last one costs the most and only bites near the end of a step, so it is computed
        only with at most two pending micro-batches per worker and when the others do not
        already reach ``bound`` (a skipped bound prunes less; it never prunes wrongly).
        """
        model = self.model
        now = self.now
        kind, busy, wstep = self.kind, self.busy, self.wstep
        G, n, B, S = model.generators, model.workers, model.microbatches, model.scorers
        v = self.version
        gsum = 0.0
        ssum = 0.0
        to_score = 0
        for x in range(n, n + S):
            if kind[x]:
                ssum += busy[x] - now
        for q in self.tsq:
            for e in q:
                if e[0] == v:
                    to_score += 1
        for i in range(G):
            k = kind[i]
            if k:
                gsum += busy[i] - now
                if k == GEN and wstep[i] == v:
                    to_score += 1
        tsum = 0.0
        tmax = 0.0
        upd_running = 0
        for j in range(G, n):
            k = kind[j]
            if k:
                a = busy[j] - now
                tsum += a
                if a > tmax:
                    tmax = a
                if k == UPDATE:
                    upd_running += self.wcount[j]
                elif k == TAG and wstep[j] == v:
                    to_score += 1
        for e in self.sq:
            if e[0] == v:
                to_score += 1
        pending = B - self.fm if self.fs == v else 0
        to_score += pending
        not_started = B - self.updated - upd_running
        tail = model.step_cost + model.sync_cost
        best = (tsum + not_started * model.update_least) / model.trainers
        if tmax > best:
            best = tmax
        best += tail
        if to_score:
            if S:
                b = (ssum + to_score * model.score_cost) / S + model.update_cost + tail
            else:
                b = (gsum + to_score * model.score_cost) / G + model.update_cost + tail
            if b > best:
                best = b
        work = (
            gsum
            + tsum
            + ssum
            + pending * model.cheapest_gen
            + to_score * model.score_cost
            + not_started * model.update_least
        )
        b = (work + model.trainers * model.step_cost) / (n + S) + model.sync_cost
        if b > best:
            best = b
        if (
            0 < pending <= 2 * n
            and now + best < bound
            and model.gen_cost > 0
            and model.tag_cost > 0
        ):
            b = self._gen_done_bound(pending) + model.score_cost + model.update_cost + tail
            if b > best:
                best = b
        return now + best

    def _gen_done_bound(self, jobs: int) -> float:
        """Earliest (relative) time ``jobs`` generations can all be done, work divisible."""
        model = self.model
        now = self.now
        busy = self.busy
        G = model.generators
        rg, rt = 1.0 / model.gen_cost, 1.0 / model.tag_cost
        avail = sorted(
            [
                (b - now if b < _INF else 0.0, rg if i < G else rt)
                for i, b in enumerate(busy[: model.workers])  # scoring lanes do not generate
            ]
        )
        first = min(a + 1.0 / r for a, r in avail)
        rate = 0.0
        inter = 0.0
        x = 0.0
        m = len(avail)
        for idx in range(m):
            a, r = avail[idx]
            rate += r
            inter += a * r
            x = (jobs + inter) / rate
            if idx + 1 == m or x <= avail[idx + 1][0]:
                break
        return x if x > first else first
