"""The scheduler: what each free worker runs next, and the account of what ran.

One pure, torch-free state machine that both the driver (``digen/runtime/driver/loop.py``,
real workers) and the simulator (:mod:`digen.sched.simulator`, a clock) run. Events in, as
they happen: a micro-batch handed out, a task started or finished, a micro-batch generated,
scored, queued for update, trained; a generator lost or joined; the version moving.
Decisions out: what a free generator (:meth:`Scheduler.generator_work`), scoring lane
(:meth:`Scheduler.lane_work`) or trainer (:meth:`Scheduler.take_update`,
:meth:`Scheduler.at_bubble`) runs next under the rules of :mod:`digen.sched`; the TAG
policy's answer at a bubble (:meth:`Scheduler.answer`); when a group is complete and a step
trained; and the :class:`~digen.sched.state.SchedState` a TAG policy sees at a bubble.
``tests/sched/test_scheduler.py`` replays the TAG search's model's history into it and
checks every decision and every bubble against the model's.

Identities: a micro-batch is ``(step, mb)``; a group is ``(step, prompt)``. Versions: the
trainers hold :attr:`Scheduler.version` (the train step being trained); each generator holds its
own, which the driver sets when it queues new weights on it.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from digen.sched.costs import Costs
from digen.sched.microbatch import MicroBatch
from digen.sched.names import Pool, TaskKind, index_of, pool_of, worker_name
from digen.sched.plan import SchedulePlan
from digen.sched.state import SchedState, WorkerClock

__all__ = ["Remake", "Scheduler", "StepRecord", "Work"]


@dataclass(slots=True)
class StepRecord:
    """Progress of one train step."""

    step: int
    mbs: list[MicroBatch]
    handed: int = 0
    """Micro-batches handed out so far (they go out in order)."""
    stale: int = 0
    """Of those, made with an older version than the step (TCSS)."""
    made: dict[int, tuple[str, int]] = field(default_factory=dict)
    """mb -> (holder, version): where the rollout and pixels of each generated one live."""
    scored: set[int] = field(default_factory=set)
    rewards: dict[tuple[int, int], float] = field(default_factory=dict)
    """(prompt, sample) -> total reward."""
    components: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    dropped: set[int] = field(default_factory=set)
    """Micro-batches with no sample to train (best-of-N kept none of them)."""
    trained: dict[int, Any] = field(default_factory=dict)
    """mb -> the loss statistics its update returned."""
    thumbnails: dict[int, Any] = field(default_factory=dict)
    tags: int = 0
    """TAG micro-batches inserted while this was the train step."""
    bubbles: int = 0
    """Trainer bubbles decided while this was the train step."""
    remade: int = 0
    """Micro-batches of this step made again after their generator was lost."""
    remade_s: float = 0.0
    """Seconds those remakes took (generation made twice: what the losses cost)."""
    orphaned: int = 0
    """Micro-batches of this step left out of its gradient: scored stale work of a lost
    generator whose version no generator holds any more (TCSS only)."""

    @property
    def size(self) -> int:
        return len(self.mbs)

    def group(self, prompt: int) -> list[MicroBatch]:
        return [m for m in self.mbs if m.prompt == prompt]

    def group_scored(self, prompt: int) -> int:
        """Micro-batches of the group scored so far."""
        return sum(1 for m in self.group(prompt) if m.mb in self.scored)

    @property
    def all_scored(self) -> bool:
        return len(self.scored) == self.size

    @property
    def all_trained(self) -> bool:
        return len(self.trained) + len(self.dropped) == self.size

    def all_trained_in(self, ids: range) -> bool:
        """Every micro-batch of ``ids`` (one mini-batch's) is trained or has nothing to train."""
        return all(m in self.trained or m in self.dropped for m in ids)

    def stats_in_order(self) -> list[Any]:
        """The trained micro-batches' statistics in micro-batch order (a fixed sum order)."""
        return [self.trained[m] for m in sorted(self.trained)]


@dataclass(frozen=True, slots=True)
class Remake:
    """A micro-batch a lost generator held, to make again from its keys.

    ``scored``: its rewards are in (its group may have its advantages): it is made again only
    for the trainers, with the version that made it (``version``), so that its samples are
    the ones scored. Otherwise it is made and scored as if handed out now.
    """

    step: int
    mb: int
    scored: bool
    version: int | None = None
    left_with: str | None = None
    """A live worker that still holds part of it (a trainer's TAG rollout whose pixels the
    lost scoring lane took): to release once it is made again."""


@dataclass(frozen=True, slots=True)
class Work:
    """What a free worker runs next, as the scheduler decides it.

    ``kind``: ``generate`` (``mb``, or ``remake`` to make again from its keys) or ``score``
    (``mb``, whose rollout and pixels ``holder`` keeps, made with ``version``).
    """

    kind: TaskKind
    mb: MicroBatch
    holder: str | None = None
    version: int | None = None
    remake: Remake | None = None


@dataclass(slots=True)
class _Task:
    kind: TaskKind
    t0: float
    step: int
    mb: int


class Scheduler:
    """The driver's ledger of a run's schedule: every micro-batch's hand-out, task, result
    and update as they happen, and what the rules (:mod:`digen.sched`) allow next."""

    def __init__(self, plan: SchedulePlan) -> None:
        """``plan``: the run's schedule (its micro-batches, pools, GAP groups and admission
        rule; it starts at the plan's first step)."""
        self.plan = plan
        first_step = plan.admission.first_step
        self.generators, self.trainers = plan.generators, plan.trainers
        self.version = first_step
        """The trainers' weights: the train step being trained."""
        self.gen_version = [first_step] * plan.generators
        """The version each generator's next call runs with."""
        self.steps: dict[int, StepRecord] = {}
        self.frontier = (first_step, 0)
        """``(step, mb)`` of the next micro-batch to hand out."""
        self.untrained = 0
        """Handed out and neither trained nor dropped (what ``C_gen`` bounds)."""
        self.sq: list[tuple[int, int]] = []
        """Micro-batches made on trainers, waiting for a generator to score them (FIFO)."""
        self.to_score: list[deque[tuple[int, int]]] = [
            deque() for _ in range(plan.generators if plan.score_overlap else 0)
        ]
        """Scoring overlapped: per scoring lane, what its generator made and it has not
        started scoring (FIFO)."""
        self.busy: dict[str, deque[_Task]] = defaultdict(deque)
        """Per worker, the calls sent to it and not finished, oldest (the running one) first."""
        self.waiting: set[int] = set()
        """Trainers idle at a bubble already decided (or with nothing to generate)."""
        self.lost: set[int] = set()
        """Generators out of the pool: lost mid-run (``runtime.elastic.on_generator_loss =
        continue``), or new to it and not yet joined (:meth:`add_generator`)."""
        self.remakes: deque[Remake] = deque()
        """What lost generators held, to make again, oldest first (before any hand-out)."""
        self.remaking: dict[tuple[int, int], int] = {}
        """Remakes taken, by the generator making them."""
        self.uq: dict[int, deque[int]] = defaultdict(deque)
        """Per step, UQ: micro-batches whose group is scored, not yet taken by a trainer, in
        the order they became ready."""
        self.mid_step = False
        """The trainers took an optimizer step of the current train step that was not its
        last: their weights belong to no version until it ends (no TAG until then)."""
        self.stopping = False
        """A stop was asked for: nothing new is handed out, made again or scored."""
        self.grouped: dict[tuple[int, int], int] = {}
        """Grouped updates: ``(step, first micro-batch)`` -> how many the update takes."""

    # --- steps -----------------------------------------------------------------------------

    def record(self, step: int) -> StepRecord:
        rec = self.steps.get(step)
        if rec is None:
            if self.plan.layout is not None:
                mbs = self.plan.microbatches_of(step)
            else:  # a plan that counts only: each update group stands for one prompt
                g = self.plan.update_group
                mbs = [MicroBatch(step, m, m // g, ()) for m in range(self.plan.microbatches)]
            rec = self.steps[step] = StepRecord(step, mbs)
        return rec

    def advance(self, version: int) -> StepRecord:
        """The trainers stepped to ``version``: forget the step before it; returns its record."""
        self.version = version
        self.waiting.clear()
        self.mid_step = False
        self.uq.pop(version - 1, None)
        for key in [k for k in self.grouped if k[0] < version]:
            del self.grouped[key]
        return self.steps.pop(version - 1)

    # --- admission ---------------------------------------------------------------------------

    def next_for(self, version: int) -> MicroBatch | None:
        """The micro-batch a worker holding ``version`` may start now, if any (no hand-out)."""
        s, m = self.frontier
        if not self.plan.admission.admits(s, m, version, self.untrained):
            return None
        return self.record(s).mbs[m]

    def hand_out(self, version: int) -> MicroBatch | None:
        """Take :meth:`next_for` (``version``): it is now this worker's to make."""
        mb = self.next_for(version)
        if mb is None:
            return None
        rec = self.record(mb.step)
        rec.handed += 1
        rec.stale += version < mb.step
        self.untrained += 1
        self.frontier = (mb.step, mb.mb + 1) if mb.mb + 1 < rec.size else (mb.step + 1, 0)
        return mb

    def quota_pending(self, step: int) -> bool:
        """Fixed TCSS: ``step``'s early micro-batches are not all handed out yet."""
        return self.plan.admission.quota_pending(step, self.frontier)

    # --- tasks -------------------------------------------------------------------------------

    def started(self, worker: str, kind: TaskKind, step: int, mb: int, t0: float) -> None:
        """A call was sent to ``worker`` (a worker runs its calls in the order sent)."""
        self.busy[worker].append(_Task(kind, t0, step, mb))
        if kind == TaskKind.UPDATE:
            self.waiting.discard(index_of(worker))

    def finished(self, worker: str) -> None:
        """``worker``'s oldest call returned."""
        queue = self.busy.get(worker)
        if queue:
            queue.popleft()

    # --- results -----------------------------------------------------------------------------

    def generated(self, mb: MicroBatch, holder: str, version: int) -> None:
        self.record(mb.step).made[mb.mb] = (holder, version)
        if pool_of(holder) == Pool.TRAINER:
            self.sq.append((mb.step, mb.mb))
        elif self.plan.score_overlap:
            self.to_score[index_of(holder)].append((mb.step, mb.mb))

    def next_to_score(self, lane: int | None = None) -> tuple[MicroBatch, str, int] | None:
        """The next micro-batch to score, taken: the head of SQ, else (scoring lane ``lane``)
        the head of that lane's own queue; ``lane`` None: a generator scoring its own, which
        takes only from SQ. Returns it with its holder and version, or None."""
        if self.sq:
            step, mb = self.sq.pop(0)
        elif lane is not None and self.to_score[lane]:
            step, mb = self.to_score[lane].popleft()
        else:
            return None
        rec = self.record(step)
        return rec.mbs[mb], *rec.made[mb]

    def has_to_score(self, lane: int | None = None) -> bool:
        """Whether :meth:`next_to_score` (``lane``) would take something."""
        return bool(self.sq) or (lane is not None and bool(self.to_score[lane]))

    def scored(
        self,
        mb: MicroBatch,
        rewards: Sequence[float],
        components: dict[str, Sequence[float]],
        thumbnails: Any = None,
    ) -> bool:
        """Record the rewards of ``mb``'s samples; True when this completes its group."""
        rec = self.record(mb.step)
        rec.scored.add(mb.mb)
        for row, sample in enumerate(mb.samples):
            rec.rewards[(mb.prompt, sample)] = float(rewards[row])
            for name, values in components.items():
                rec.components.setdefault(name, {})[(mb.prompt, sample)] = float(values[row])
        if thumbnails is not None:
            rec.thumbnails[mb.mb] = thumbnails
        return rec.group_scored(mb.prompt) == len(rec.group(mb.prompt))

    def group_rewards(self, step: int, prompt: int, n: int) -> list[float]:
        rec = self.record(step)
        return [rec.rewards[(prompt, s)] for s in range(n)]

    def queued(self, step: int, mb: int) -> None:
        """``(step, mb)`` went on UQ (it has samples to train)."""
        self.uq[step].append(mb)

    def has_update(self, step: int, ids: range | None = None) -> bool:
        """Whether :meth:`take_update` would take something."""
        return any(ids is None or mb in ids for mb in self.uq.get(step, ()))

    def take_update(self, step: int, ids: range | None = None) -> int | None:
        """The head of ``step``'s UQ (among ``ids``, one mini-batch's, where given), taken."""
        queue = self.uq.get(step)
        for mb in queue or ():
            if ids is None or mb in ids:
                queue.remove(mb)
                return mb
        return None

    def take_updates(self, step: int, ids: range | None = None) -> list[int]:
        """What a free trainer slot updates next, taken off UQ: the head of ``step``'s UQ
        (:meth:`take_update`) and, with ``plan.group_updates``, the other micro-batches of
        its prompt group on UQ that the same version made, in micro-batch order (the
        group's micro-batches go on UQ together, so which go together does not depend on
        timing). Empty when UQ has nothing for it."""
        head = self.take_update(step, ids)
        if head is None:
            return []
        if not self.plan.group_updates:
            return [head]
        rec = self.record(step)
        prompt, version = rec.mbs[head].prompt, rec.made[head][1]
        mates = [
            m.mb
            for m in rec.group(prompt)
            if m.mb in self.uq[step] and rec.made[m.mb][1] == version
        ]
        for mb in mates:
            self.uq[step].remove(mb)
        taken = sorted([head, *mates])
        self.grouped[step, taken[0]] = len(taken)
        return taken

    def _off_uq(self, step: int, mb: int) -> None:
        """``(step, mb)`` leaves UQ if it is on it (its rollout was lost, or it is left out)."""
        if mb in self.uq.get(step, ()):
            self.uq[step].remove(mb)

    def dropped(self, step: int, mb: int) -> None:
        """``(step, mb)`` has nothing to train (best-of-N): it counts as trained."""
        self.record(step).dropped.add(mb)
        self.untrained -= 1

    def trained(self, step: int, mb: int, stats: Any) -> None:
        self.record(step).trained[mb] = stats
        self.untrained -= 1

    def idle(self, trainer: int) -> None:
        """Trainer ``trainer`` waits for UQ with nothing it could generate."""
        self.waiting.add(trainer)

    def bubble(self, trainer: int, insert: bool) -> None:
        """Trainer ``trainer``'s bubble was decided (TAG inserted, or it waits for UQ)."""
        rec = self.record(self.version)
        rec.bubbles += 1
        rec.tags += insert
        if not insert:
            self.waiting.add(trainer)

    # --- decisions: what a free worker runs next ----------------------------------------------

    def generator_work(self, i: int, *, take: bool = True) -> Work | None:
        """What free generator ``i`` runs next (None: it waits for a change), taken unless
        ``take`` is False: the head of SQ when it scores (scoring first, so trainers get
        rewards early); else the oldest remake it may make; else the next micro-batch the
        admission rule lets its version start."""
        if self.stopping or i in self.lost:
            return None
        version = self.gen_version[i]
        if not self.plan.score_overlap and self.sq:
            if not take:
                return Work(TaskKind.SCORE, self.record(self.sq[0][0]).mbs[self.sq[0][1]])
            mb, holder, made_by = self.next_to_score()  # type: ignore[misc]
            return Work(TaskKind.SCORE, mb, holder, made_by)
        if self.remakes and (remake := self.take_remake(version, i, take)) is not None:
            return Work(TaskKind.GENERATE, self.record(remake.step).mbs[remake.mb], remake=remake)
        mb = self.hand_out(version) if take else self.next_for(version)
        return None if mb is None else Work(TaskKind.GENERATE, mb)

    def lane_work(self, i: int) -> Work | None:
        """What scoring lane ``i`` scores next, taken: the head of SQ, else the head of what
        its generator made (None: it waits)."""
        if self.stopping or i in self.lost:
            return None
        took = self.next_to_score(i)
        return None if took is None else Work(TaskKind.SCORE, *took)

    def at_bubble(self, trainer: int, step: int) -> bool:
        """Trainer ``trainer``, in train step ``step``, found UQ empty: whether this is a
        bubble for the TAG policy to decide (:meth:`answer`). False: nothing to do but wait
        for UQ (marked waiting where something could have been made), because the step is
        over (its weights are about to change), the run stops, the trainers are between a
        step's optimizer steps, or no micro-batch may start now."""
        if self.version != step or self.record(step).all_trained or self.stopping:
            return False
        if self.mid_step or self.next_for(self.version) is None:
            self.idle(trainer)
            return False
        return True

    def answer(self, trainer: int, insert: bool) -> MicroBatch | None:
        """The TAG policy's answer at trainer ``trainer``'s bubble: with ``insert`` the
        micro-batch it makes now, handed out; else None, and it waits for UQ."""
        self.bubble(trainer, insert)
        return self.hand_out(self.version) if insert else None

    @property
    def plannable(self) -> bool:
        """Whether :meth:`sched_state` shows the whole schedule (remakes pending: it cannot)."""
        return not self.remakes and not self.remaking

    # --- lost generators -------------------------------------------------------------------

    @property
    def alive(self) -> list[int]:
        """The generators not lost, in order."""
        return [i for i in range(self.generators) if i not in self.lost]

    def lose_generator(self, i: int, running: Sequence[tuple[int, int]] = ()) -> list[Remake]:
        """Generator ``i`` (and its scoring lane) is lost with its store: what it held goes
        on :attr:`remakes`, and is returned. ``running``: ``(step, mb)`` it was making or
        scoring when a call to it failed (that task may be off :attr:`busy` already); called
        again for such a call after the loss was recorded, only those are looked at.

        Left out: a micro-batch a trainer is updating from it now (the update may have taken
        its rollout before the loss; :meth:`remake_scored` is for when it did not). What a
        trainer made (TAG) that its lane was scoring is made again too: the lane may have
        taken its pixels with it.
        """
        gen, lane = worker_name(Pool.GENERATOR, i), worker_name(Pool.SCORER, i)
        held = list(running)
        if i not in self.lost:
            self.lost.add(i)
            self.gen_version[i] = -1
            for key in [k for k, g in self.remaking.items() if g == i]:
                del self.remaking[key]  # it was making it again: someone else will
                held.append(key)
            for worker in (gen, lane):
                held += [(t.step, t.mb) for t in self.busy.pop(worker, ()) if t.mb >= 0]
            if self.to_score:
                held += list(self.to_score[i])
                self.to_score[i].clear()
            for s, rec in sorted(self.steps.items()):
                held += [(s, mb) for mb, (holder, _) in sorted(rec.made.items()) if holder == gen]
        updating = {
            (t.step, t.mb)
            for worker, queue in self.busy.items()
            if pool_of(worker) == Pool.TRAINER
            for t in queue
            if t.kind == TaskKind.UPDATE
        }
        out = []
        for s, mb in dict.fromkeys(held):  # once each, in the order found
            rec = self.steps.get(s)
            if rec is None or mb in rec.trained or mb in rec.dropped or (s, mb) in updating:
                continue
            holder, version = rec.made.get(mb, (gen, None))
            left_with = None
            if holder != gen:  # made (again) elsewhere
                tag = pool_of(holder) == Pool.TRAINER
                if not tag or mb in rec.scored or (s, mb) in self.sq:
                    continue  # safe where it is, or still waiting for a lane
                left_with = holder  # the lost lane was scoring it: its pixels may be gone
            remake = self._remake(s, mb, version, left_with)
            if remake is not None:
                out.append(remake)
        return out

    def add_generator(self) -> int:
        """A generator new to the run (it joined the world while the run ran): its index,
        out of the pool until it joins with a version (:meth:`rejoin`)."""
        i = self.generators
        self.generators += 1
        self.gen_version.append(-1)
        self.lost.add(i)
        if self.plan.score_overlap:
            self.to_score.append(deque())
        return i

    def rejoin(self, i: int, version: int) -> None:
        """Generator ``i`` joins the pool (a lost one's new process, or one new to the run),
        holding ``version``, with nothing else."""
        self.lost.discard(i)
        self.gen_version[i] = version

    def remake_scored(self, step: int, mb: int) -> Remake | None:
        """An update of ``(step, mb)`` failed because its holder was lost: make it again
        (None when it already is, or needs nothing)."""
        rec = self.steps.get(step)
        if rec is None or mb in rec.trained or mb in rec.dropped:
            return None
        return self._remake(step, mb, rec.made[mb][1])

    def _remake(
        self, step: int, mb: int, version: int | None, left_with: str | None = None
    ) -> Remake | None:
        rec = self.record(step)
        if (step, mb) in self.remaking or any((r.step, r.mb) == (step, mb) for r in self.remakes):
            return None
        scored = mb in rec.scored
        self._off_uq(step, mb)  # its rollout is gone: on UQ again once made again
        remake = Remake(step, mb, scored, version if scored else None, left_with)
        if not scored:  # a scored one keeps its entry: its group's advantages read it
            rec.made.pop(mb, None)
        self.remakes.append(remake)
        return remake

    def take_remake(self, version: int, generator: int, take: bool = True) -> Remake | None:
        """The oldest remake generator ``generator``, holding ``version``, may make now,
        taken (``take`` False: only looked at): a scored one with exactly the version that
        made it; an unscored one where the admission rule admits it, or with any version
        once no live generator's would."""
        live = [self.gen_version[i] for i in self.alive]
        rule = self.plan.admission
        for k, r in enumerate(self.remakes):
            if r.scored:
                fits = r.version == version
            else:
                fits = rule.admits(r.step, r.mb, version) or not any(
                    rule.admits(r.step, r.mb, v) for v in live
                )
            if fits and not take:
                return r
            if fits:
                del self.remakes[k]
                self.remaking[r.step, r.mb] = generator
                return r
        return None

    def orphaned(self) -> list[Remake]:
        """Scored remakes whose version no live generator holds any more, nor will (versions
        only move forward): taken off :attr:`remakes` and counted as dropped. Under TCSS
        only; the caller releases and reports them."""
        live = [self.gen_version[i] for i in self.alive]
        gone = [r for r in self.remakes if r.scored and all(v > r.version for v in live)]
        for r in gone:
            self.remakes.remove(r)
            self._off_uq(r.step, r.mb)
            self.record(r.step).orphaned += 1
            self.dropped(r.step, r.mb)
        return gone

    def remade(self, remake: Remake, holder: str, version: int, seconds: float) -> None:
        """``remake`` was made again by ``holder``: where it lives now; a scored one goes
        back to where it was (its update), an unscored one on to be scored."""
        self.remaking.pop((remake.step, remake.mb), None)
        rec = self.record(remake.step)
        rec.remade += 1
        rec.remade_s += seconds
        if remake.scored:
            rec.made[remake.mb] = (holder, version)
        else:
            self.generated(rec.mbs[remake.mb], holder, version)

    # --- what a TAG policy sees ----------------------------------------------------------------

    def sched_state(self, trainer: int, now: float, costs: Costs) -> SchedState:
        """The schedule at trainer ``trainer``'s bubble, as :class:`SchedState` describes it.

        Running tasks are expected to end at their start plus the profiled cost of their kind.
        """
        expected = {
            TaskKind.GENERATE: costs.gen,
            TaskKind.TAG: costs.gen_tag,
            TaskKind.SCORE: costs.score,
            TaskKind.UPDATE: costs.update,
        }
        clocks: dict[str, dict[int, WorkerClock]] = {
            Pool.GENERATOR: {},
            Pool.TRAINER: {},
            Pool.SCORER: {},
        }
        for worker, queue in self.busy.items():
            pool = pool_of(worker)
            # a weight load or optimizer step in the queue is short: the model skips it
            task = next((t for t in queue if t.kind in expected), None)
            if pool in clocks and task is not None:
                count = 1
                if task.kind == TaskKind.UPDATE:
                    count = self.grouped.get((task.step, task.mb), 1)
                # an update's expected end: its start plus what that many together cost
                cost = costs.update_for(count) if count > 1 else expected[task.kind]
                until = task.t0 + cost  # type: ignore[operator]
                clocks[pool][index_of(worker)] = WorkerClock(
                    task.kind, until, task.step, task.mb, count=count
                )

        def clock(pool: Pool, i: int) -> WorkerClock:
            if pool == Pool.TRAINER and i == trainer:
                return WorkerClock()  # the one asking: idle, not waiting
            idle = WorkerClock(waiting=pool == Pool.TRAINER and i in self.waiting)
            return clocks[pool].get(i, idle)

        rec = self.record(self.version)
        if self.plan.whole_step:  # one group per step: its scored count
            partial = tuple(
                (s, 0, len(r.scored))
                for s, r in sorted(self.steps.items())
                if 0 < len(r.scored) < r.size
            )
        else:
            partial = tuple(
                (s, p, c)
                for s, r in sorted(self.steps.items())
                for p in sorted({m.prompt for m in r.mbs})
                if 0 < (c := r.group_scored(p)) < len(r.group(p))
            )
        alive = self.alive  # a lost generator is no longer part of the pool planned with
        if len(alive) != self.plan.generators:
            plan = dataclasses.replace(self.plan, generators=len(alive))
        else:
            plan = self.plan
        lanes = [i for i in alive if i < len(self.to_score)]
        return SchedState(
            now=now,
            trainer=trainer,
            plan=plan,
            step=self.version,
            generators=tuple(clock(Pool.GENERATOR, i) for i in alive),
            trainers=tuple(clock(Pool.TRAINER, j) for j in range(self.trainers)),
            scorers=tuple(clock(Pool.SCORER, i) for i in lanes),
            next_mb=self.frontier,
            sq=tuple(self.sq),
            to_score=tuple(tuple(self.to_score[i]) for i in lanes),
            uq=len(self.uq.get(self.version, ())),
            updated=len(rec.trained) + len(rec.dropped),
            partial_groups=partial,
            untrained=self.untrained,
            tags=rec.tags,
            bubbles=rec.bubbles,
        )
