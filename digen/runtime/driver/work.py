"""The work Algorithm 1's loops hand to the actors: generate a micro-batch (line 8, or a
trainer's TAG), make one again, score one (line 11), update one (line 22); and how every
call to an actor is awaited.

Each call of :class:`Work` builds its request, awaits it through :class:`Calls`, and tells
the scheduler and the updates what came back: a scored group gets its advantages and its
micro-batches go on UQ; a trained micro-batch may open its mini-batch's optimizer step. The
driver passes keys, rewards, advantages and versions; the tensors stay where they were made.

:class:`Calls` is the one place a driver call is awaited: the scheduler learns when it
starts and ends (what each worker is busy with, the TAG search's clocks), the
:class:`~digen.runtime.driver.accounting.CostLedger` its span, its worker's own timing and
the call's overhead (trace, profiler). It also keeps the stop handshake's half that is about
calls: once the scheduler is stopping, only a step's optimizer step and weight sync start,
and :attr:`Calls.quiet` is set once no call runs (every worker at a micro-batch boundary).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from digen.algos.train_step import step_terms
from digen.config import DigenConfig
from digen.runtime.driver.accounting import CostLedger
from digen.runtime.driver.handles import GeneratorHandle, ScorerHandle, TrainerHandle
from digen.runtime.driver.progress import Progress
from digen.runtime.driver.recovery import Recovery
from digen.runtime.driver.updates import RolloutRef, Updates, UpdateTask
from digen.runtime.messages import (
    GenerateRequest,
    LossStats,
    SampleKey,
    ScoreRequest,
    UpdateRequest,
)
from digen.sched.microbatch import MicroBatch
from digen.sched.names import Pool, TaskKind, worker_name
from digen.sched.scheduler import Remake, Scheduler

__all__ = ["GRID_SAMPLES", "Calls", "Parts", "Work"]

GRID_SAMPLES = 16
"""Samples per step whose thumbnails come back for the sample grid."""

Prompts = Callable[[int], tuple[list[str], list[dict]]]
"""``prompts(step)``: the texts and metadata of the step's prompts."""


class Calls:
    """Awaits actor calls for the driver and reports them (module docstring)."""

    def __init__(self, sched: Scheduler, accounts: CostLedger, clock: Callable[[], float]):
        self.sched, self.accounts, self.clock = sched, accounts, clock
        self.running = 0
        """Calls sent and not returned."""
        self.quiet = asyncio.Event()
        """Set once stopping and no call is running: every worker is at a micro-batch boundary."""

    def stopping(self) -> None:
        """The scheduler is stopping now: quiet at once if no call runs."""
        if self.running == 0:
            self.quiet.set()

    async def __call__(
        self,
        actor: GeneratorHandle | ScorerHandle | TrainerHandle,
        kind: TaskKind,
        step: int,
        mb: int,
        version: int | None,
        call: Coroutine[Any, Any, Any],
        lane: str | None = None,
    ) -> Any:
        """Await ``call`` (``actor``'s, a task of ``kind`` for ``(step, mb)``) and report it;
        returns the result's value. ``version`` None: the one the call returns (a
        generation); ``lane``: the name the scheduler and the trace know the call's worker by
        (default: the actor's worker; a scoring lane's differs). Once stopping, only a step's
        optimizer step and weight sync start: other calls wait here until the run's loops
        are cancelled."""
        if self.sched.stopping and kind not in (TaskKind.STEP, TaskKind.SYNC):
            if inspect.iscoroutine(call):
                call.close()  # never sent
            await asyncio.get_running_loop().create_future()
        lane = lane or actor.worker
        t0 = self.clock()
        self.sched.started(lane, kind, step, mb, t0)
        self.running += 1
        try:
            res = await call
        finally:
            self.sched.finished(lane)
            self.running -= 1
            if self.sched.stopping and self.running == 0:
                self.quiet.set()
        ver = res.value if version is None else version
        span = self.clock() - t0
        memory = getattr(res, "memory_gb", 0.0)
        self.accounts.record(kind, lane, step, mb, ver, span, res.t0, res.t1, memory)
        return res.value


@dataclass(frozen=True, slots=True)
class Parts:
    """What the driver's rooms share: the workers, the scheduler, the call awaiter, the
    accounts, what the loops wait on, the answers to a loss, the update queue and the
    step's prompts. :class:`Work` and :class:`~digen.runtime.driver.step.StepEnd` read
    them; the driver makes them once."""

    cluster: Any
    sched: Scheduler
    call: Calls
    accounts: CostLedger
    progress: Progress
    recovery: Recovery
    updates: Updates
    prompts: Prompts


class Work:
    """Generation, scoring and updates, as the loops call them (module docstring)."""

    def __init__(
        self, cfg: DigenConfig, parts: Parts, mini_size: int, handed_out: Callable[[], None]
    ) -> None:
        """``mini_size``: prompts per mini-batch (one optimizer step each); ``handed_out()``:
        told as a new micro-batch's generate call goes out (the weight sync's quota)."""
        self.cfg, self.mini_size = cfg, mini_size
        self.cluster, self.sched, self.updates = parts.cluster, parts.sched, parts.updates
        self.call, self.accounts, self.progress = parts.call, parts.accounts, parts.progress
        self.recovery, self.prompts = parts.recovery, parts.prompts
        self.handed_out = handed_out
        self.overlap = cfg.runtime.schedule.score_overlap
        """Scoring on each generator's scoring actor (lane ``scorer-i``), beside generation."""
        self.samples_at: Callable[[int], bool] = lambda step: False
        """``samples_at(step)``: whether that step brings back thumbnails for a sample grid."""

    @property
    def scorers(self) -> list[ScorerHandle] | list[GeneratorHandle]:
        """Each generator's scoring actor (``runtime.schedule.score_overlap``); else the
        generators."""
        return self.cluster.scorers if self.overlap else self.cluster.gens

    async def generate(
        self, actor: GeneratorHandle | TrainerHandle, mb: MicroBatch, kind: TaskKind
    ) -> RolloutRef:
        """``actor`` generates ``mb``, just handed out (``kind``: a generator's, or a
        trainer's TAG), and keeps it; returns where it is and the version that made it."""
        self.handed_out()  # the call goes out before this coroutine first yields
        keys = tuple(SampleKey(mb.step, mb.prompt, s) for s in mb.samples)
        texts = self.prompts(mb.step)[0]
        request = GenerateRequest(mb.step, mb.mb, keys, texts[mb.prompt], True, self._ahead(texts))
        version = await self.call(actor, kind, mb.step, mb.mb, None, actor.generate(request))
        self.sched.generated(mb, actor.worker, version)
        return RolloutRef(mb, actor.worker, version)

    def _ahead(self, texts: list[str]) -> tuple[str, ...]:
        """What a generate call carries besides its prompt: with offloaded text encoders the
        step's prompts, which the worker encodes in one visit of the encoders to its device
        (not one a micro-batch); nothing otherwise."""
        return tuple(texts) if self.cfg.model.offload_text_encoders else ()

    async def make_again(self, i: int, remake: Remake) -> None:
        """Generator ``i`` makes ``remake`` again from its keys: a scored one only for the
        trainers (no pixels kept), with the version that made it, so its samples are the
        ones its rewards and advantages are of; an unscored one goes on to be scored."""
        gen, s = self.cluster.gens[i], remake.step
        mb = self.sched.record(s).mbs[remake.mb]
        keys = tuple(SampleKey(s, mb.prompt, j) for j in mb.samples)
        texts = self.prompts(s)[0]
        keep = not remake.scored
        request = GenerateRequest(s, mb.mb, keys, texts[mb.prompt], keep, self._ahead(texts))
        t0 = self.call.clock()
        call = gen.generate(request)
        version = await self.call(gen, TaskKind.GENERATE, s, mb.mb, None, call)
        if remake.scored and version != remake.version:
            raise AssertionError(
                f"{mb} was made again with version {version}, not {remake.version}"
            )
        self.sched.remade(remake, gen.worker, version, self.call.clock() - t0)
        if remake.scored:
            self.updates.rehome(s, mb.mb, gen.worker, version)
        elif not self.overlap:
            await self.score(i, RolloutRef(mb, gen.worker, version))
        await self.progress.notify()

    async def score(self, i: int, made: RolloutRef) -> None:
        """Scorer ``i`` scores ``made`` where its pixels are; a group complete with it gets
        its advantages and goes on UQ."""
        g, mb, k = self.scorers[i], made.mb, len(made.mb.samples)
        texts, meta = self.prompts(mb.step)
        thumbs = self.samples_at(mb.step) and mb.mb * k < GRID_SAMPLES
        prompt, data = (texts[mb.prompt],) * k, (meta[mb.prompt],) * k
        call = g.score(ScoreRequest(mb.step, mb.mb, made.holder, prompt, data, thumbs))
        lane = worker_name(Pool.SCORER, i) if self.overlap else g.worker
        scores = await self.call(g, TaskKind.SCORE, mb.step, mb.mb, made.version, call, lane)
        self.accounts.scored(mb.step, scores.latency_s)
        if self.sched.scored(mb, scores.total, scores.components, scores.thumbnails):
            await self._group_scored(mb.step, mb.prompt)

    async def _group_scored(self, s: int, prompt: int) -> None:
        """A group is complete: its updates go to UQ (:meth:`Updates.group_scored`); what
        kept no sample is released where it is held."""
        for holder, mb in self.updates.group_scored(s, prompt):
            await self.cluster.release(holder, [(s, mb)])
        await self.progress.notify()
        self.progress.maybe_trained(s)

    async def update(self, j: int, tasks: Sequence[UpdateTask]) -> None:
        """Trainer ``j`` accumulates the gradient of ``tasks`` (one micro-batch's, or a
        group's taken together: ``runtime.schedule.group_updates``), fetching each rollout
        from its holder; a holder lost on the way is gone on without (:class:`Recovery`)."""
        t, first = self.cluster.trainers[j], tasks[0].rollout.mb
        s = first.step
        scale = 1.0 / step_terms(self.cfg, s, prompts=self.mini_size)  # its optimizer step's
        requests = []
        for task in tasks:
            mb = task.rollout.mb
            keys = tuple(SampleKey(s, mb.prompt, mb.samples[r]) for r in task.rows)
            text = self.prompts(s)[0][mb.prompt]
            holder = task.rollout.holder
            made_by = task.rollout.version  # the version that sampled it (TCSS: maybe behind)
            requests.append(
                UpdateRequest(
                    s, mb.mb, holder, keys, task.rows, text, task.advantages, scale, made_by
                )
            )
        call = t.update(requests[0]) if len(requests) == 1 else t.update_group(tuple(requests))
        try:
            stats = await self.call(t, TaskKind.UPDATE, s, first.mb, s, call)
        except Exception as exc:
            for task in tasks:  # the first whose holder was lost (several: sharded, raises)
                if await self.recovery.update_failed(task, exc, sharded=len(t.members) > 1):
                    return  # its rollout never reached this trainer: made again
            raise
        for n, task in enumerate(tasks):  # a group's statistics count once, with its first
            mb = task.rollout.mb.mb
            self.updates.done(s, mb)
            self.sched.trained(s, mb, stats if n == 0 else LossStats())
        await self.progress.notify()
        self.progress.maybe_trained(s)
