"""The disaggregated driver: the paper's Algorithm 1 as asyncio coroutines.

The driver holds no model and moves no tensors: generators keep what they make, trainers
fetch rollouts from whoever holds them (:mod:`digen.runtime.worker.store`), and the driver passes
keys, rewards, advantages and versions. Its coroutines are all owned by one
:class:`asyncio.TaskGroup`, so a failure anywhere cancels the rest and surfaces as one error
naming the worker:

- :meth:`Driver._generator_loop`, one per generator (Algorithm 1, lines 5-17): score what
  trainers made (SQ) first; else take the next micro-batch the admission rule allows
  (staleness, and ``C_gen``: at most ``runtime.schedule.max_inflight`` generated and not yet
  trained), generate it and score it where its pixels are. A scored group gets its
  advantages at once and its micro-batches go on the step's UQ. With
  ``runtime.schedule.score_overlap`` (the default) the scoring half of that loop is its own
  coroutine, :meth:`Driver._scorer_loop`, calling the scoring actor beside the generator:
  SQ first, then what its generator made, while the generator goes on generating;
- :meth:`Driver._trainer_loop`, one per trainer (lines 18-26): update what UQ holds; when UQ
  is empty a *bubble* has emerged, and the TAG policy decides whether this trainer
  generates the next micro-batch itself;
- :meth:`Driver.run` (lines 27-31): once every micro-batch of step ``s`` is trained, all
  trainers ``step()``, then the generators load version ``s + 1``, each behind the
  generation it is running (trajectory consistency).

A lost generator is the exception to "a failure ends the run"
(``runtime.elastic.on_generator_loss``): :meth:`Driver._lose` takes it out of the pool, and
what it held is made again by the others from the same keys (:meth:`Driver._make_again`),
before any new micro-batch. Membership itself (whether the run can go on, restarts with
``runtime.elastic.respawn_generators``, generators that join by themselves with
``runtime.elastic.accept_generators``, what the log and the runner are
told) is the :class:`~digen.runtime.driver.pool.GeneratorPool`'s; a generator back or new
joins at the next weight sync (:meth:`Driver._sync`).

Who runs what next, and what was handed out, made, scored and trained, is the
:class:`~digen.sched.scheduler.Scheduler`'s (the one the simulator runs with a clock); what
calls cost is observed by :class:`~digen.runtime.driver.accounting.CostLedger`. The loops
below ask it, await the actors and tell it what happened.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Coroutine, Sequence
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from digen.algos.train_step import mini_batches, step_terms
from digen.checkpoint import PROFILER, Checkpoint
from digen.config import DigenConfig, schedule_plan
from digen.prompts import PromptSet
from digen.runtime.driver.accounting import CostLedger
from digen.runtime.driver.calls import Calls
from digen.runtime.driver.cluster import Cluster, ClusterBackend
from digen.runtime.driver.evaluation import Members, evaluate
from digen.runtime.driver.handles import GeneratorHandle, ScorerHandle, TrainerHandle
from digen.runtime.driver.pool import GeneratorPool
from digen.runtime.driver.updates import RolloutRef, Updates, UpdateTask
from digen.runtime.messages import (
    EvalScores,
    GenerateRequest,
    SampleKey,
    ScoreRequest,
    StepRequest,
    StepResult,
    UpdateRequest,
)
from digen.runtime.transport.actors import WorkerDied
from digen.sched.costs import OnlineProfiler
from digen.sched.microbatch import MicroBatch
from digen.sched.names import DRIVER, Pool, TaskKind, worker_name, worker_names
from digen.sched.scheduler import Remake, Scheduler
from digen.sched.tag import make_tag_policy
from digen.sched.trace import Trace

__all__ = ["Driver"]

GRID_SAMPLES = 16
"""Samples per step whose thumbnails come back for the sample grid."""


class Driver(ClusterBackend):
    """Runs train steps on a generator pool and a trainer pool (module docstring): a
    :class:`~digen.runtime.backend.TrainingBackend`."""

    def __init__(
        self,
        cfg: DigenConfig,
        rewards: Sequence[Any] | None,
        prompts: PromptSet,
        trace: Trace,
        *,
        cluster: Any = None,
        clock: Callable[[], float] = time.time,
        resume: Checkpoint | None = None,
        notes: Path | None = None,
        join_secret: str | None = None,
    ) -> None:
        """``cluster``: the actors (default: a :class:`Cluster` of worker processes; tests
        pass fakes with its methods); ``clock``: the clock task spans are read on;
        ``resume``: a checkpoint the trainers start from (the run continues at its step);
        ``notes``: the run's log, where the workers write their notes; ``join_secret``:
        with ``runtime.elastic.accept_generators``, what a joining generator must prove it knows."""
        self.cfg, self.clock = cfg, clock
        if cluster is None:
            cluster = Cluster(cfg, rewards, resume=resume, notes=notes, join_secret=join_secret)
        self.cluster = cluster
        self.resume = resume
        self.reward_weights = {r.name: r.weight for r in rewards or cfg.rewards}
        """Each reward's weight, by name (for ``algo.reward_weighting = advantage``)."""
        self.prompts = lru_cache(maxsize=8)(
            lambda step: prompts.for_step(cfg.seed, step, cfg.data.train_batch_size)
        )
        """``prompts(step)``: the texts and metadata of the step's prompts."""
        rt = cfg.runtime
        self.plan = schedule_plan(cfg, first_step=resume.step if resume is not None else 0)
        """The run's schedule (:mod:`digen.sched.plan`): the rules below all read it."""
        self.sched = Scheduler(self.plan)
        self.overlap = rt.schedule.score_overlap
        """Scoring on each generator's scoring actor (lane ``scorer-i``), beside generation."""
        workers = worker_names(Pool.GENERATOR, rt.generators)
        workers += worker_names(Pool.TRAINER, self.plan.trainers)
        self.accounts = CostLedger(cfg, trace, workers)
        if resume is not None and (resume.path / PROFILER).is_file():
            # BTS starts from the cost estimates the run had, not from nothing
            self.accounts.profiler = OnlineProfiler.load(resume.path / PROFILER)
        self.tag_policy = make_tag_policy(self.plan.tag, self.plan.tag_k)
        minis = mini_batches(cfg)
        self.mini_size = len(minis[0])
        """Prompts per mini-batch: one optimizer step each (``train.mini_batch_size``)."""
        self.mini_ids = [_ids_of(self.plan.microbatches_of(0), prompts) for prompts in minis]
        """Per mini-batch, the ids of its micro-batches (the same in every step)."""
        self.changed = asyncio.Condition()
        """Wakes the loops waiting for work: a version, SQ, UQ, a trained micro-batch."""
        self._trained: dict[tuple[int, int], asyncio.Event] = defaultdict(asyncio.Event)
        self._stepped: dict[tuple[int, int], asyncio.Event] = defaultdict(asyncio.Event)
        self._stop_after_step = False
        """A stop asked for after the step's first optimizer step: it waits for the step's end."""
        self._quota_waiter: tuple[int, asyncio.Future[None]] | None = None
        self._samples_at: Callable[[int], bool] = lambda step: False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._call = Calls(self.sched, self.accounts, clock)
        """Awaits every actor call, telling the scheduler and the accounts."""
        self._tg: asyncio.TaskGroup | None = None
        self._loops: list[asyncio.Task] = []
        self.pool = GeneratorPool(
            cfg, cluster, self.sched, trace, clock, stopping=lambda: self.sched.stopping
        )
        """Membership: losses, restarts, arrivals (:mod:`digen.runtime.driver.pool`)."""
        self.pool.start = self._start
        self.updates = Updates(cfg, self.sched, self.reward_weights, self.pool.holder_lost)
        """Each scored micro-batch's update until it is trained, and UQ's feed."""

    @property
    def scorers(self) -> list[ScorerHandle]:
        """Each generator's scoring actor (``runtime.schedule.score_overlap``); else the
        generators."""
        return self.cluster.scorers if self.overlap else self.cluster.gens

    @property
    def version(self) -> int:
        """The trainers' weights: the train step being trained."""
        return self.sched.version

    async def restore(self, ckpt: Checkpoint) -> None:
        """The trainers loaded ``ckpt`` as they started (``resume``): nothing left to do."""
        if self.resume is None or ckpt.path != self.resume.path:
            raise ValueError(
                f"the driver's trainers start from the checkpoint it was made with "
                f"({self.resume.path if self.resume else 'none'}), not {ckpt.path}"
            )

    async def write_checkpoint(self, directory: Any) -> None:
        """Trainer 0 writes its weights and optimizer state into a checkpoint directory
        (behind whatever it is running: only ``step`` changes them, and the next step waits
        for this; sharded trainers all take part)."""
        await self.cluster.trainers[0].write_checkpoint(str(directory))
        self.accounts.profiler.save(Path(directory) / PROFILER)

    def request_stop(self) -> None:
        """Stop at the next micro-batch boundary (callable from any thread or a signal
        handler): calls already running finish, no new generation, score or update starts,
        and :meth:`run` returns the steps completed. A step whose micro-batches were all
        trained still takes its optimizer step; a partly trained one is left (its gradients
        are dropped with the run, its weights were not changed), so a checkpoint written
        next holds the last completed step, and a resume makes the rest again."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        if self.sched.mid_step and not self.sched.stopping:
            self._stop_after_step = True  # mid-step weights must not be what a checkpoint holds
            return
        self.sched.stopping = True  # no new generation, score or update starts
        self._call.stopping()
        waiting = self._quota_waiter
        if waiting is not None and not waiting[1].done():
            waiting[1].set_result(None)

    # --- Algorithm 1 -----------------------------------------------------------------------

    async def run(
        self,
        steps: range | int,
        on_step: Callable[[StepResult], Any] | None = None,
        *,
        samples_at: Callable[[int], bool] | None = None,
    ) -> list[StepResult]:
        """Train ``steps`` (a count, or a range from the current version); once per driver.

        ``on_step(result)`` (sync or async) sees each finished step; returning False stops
        the run there.
        ``samples_at(step)``: whether that step brings back thumbnails for a sample grid.
        """
        steps = range(steps) if isinstance(steps, int) else steps
        if not steps or steps.start != self.version:
            raise ValueError(f"steps {steps} must be non-empty and start at {self.version}")
        self.plan = self.sched.plan = self.plan.running(steps.start, steps[-1])
        self._samples_at = samples_at or (lambda step: False)
        self._loop = asyncio.get_running_loop()
        results: list[StepResult] = []
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                self._start_loops(steps)
                for s in steps:
                    result = await self._train_step(s)
                    if result is None:
                        break  # stopped at a micro-batch boundary inside step s
                    results.append(result)
                    if self._stop_after_step:
                        self._begin_stop()
                    if on_step is not None:
                        go = on_step(result)
                        if inspect.isawaitable(go):
                            go = await go
                        if go is False:
                            break
                for task in self._loops:
                    task.cancel()
        except BaseExceptionGroup as group:
            error = _main_error(group)
        else:
            return results
        if not isinstance(error, WorkerDied):
            went_on = [self.gens[i].worker for i in self.sched.lost]  # losses the run survived
            if died := await self.cluster.lost_behind(error, went_on):
                raise died from error  # a call between two workers met the loss first
        raise error from None

    def _start_loops(self, steps: range) -> None:
        """Algorithm 1's coroutines: one per generator, scoring lane and trainer, and the
        pool's watchers."""
        for i, g in enumerate(self.gens):
            self._start(f"loop-{g.worker}", partial(self._generator_loop, i))
        for i in range(len(self.gens) if self.overlap else 0):
            self._start(f"loop-scorer-{i}", partial(self._scorer_loop, i))
        for j, t in enumerate(self.trainers):
            self._start(f"loop-{t.worker}", partial(self._trainer_loop, j, steps))
        self._start("loop-watch", partial(self.pool.watch_losses, self._lose))
        if self.cfg.runtime.elastic.accept_generators:
            self._start("loop-arrivals", partial(self.pool.watch_arrivals, self.accounts.workers))

    async def _train_step(self, s: int) -> StepResult | None:
        """Lines 27-31: as each mini-batch of step ``s`` is trained, every trainer steps;
        after the last, the new weights go out. None: stopped inside the step."""
        since = self.clock(), self.cluster.payload  # the previous step's end
        stepped = []  # (version, grad norm, seconds) per mini-batch
        for m in range(len(self.mini_ids)):
            if not await self._trained_or_stopped(s, m):
                return None
            stepped.append(await self._optimizer_step(s, m))
        return await self._finish_step(s, since, stepped)

    def _start(self, name: str, make: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run ``make()`` as one of the running driver's tasks (False: it is not running)."""
        if self._tg is None:
            return False
        self._loops.append(self._tg.create_task(make(), name=name))
        return True

    async def _lose(
        self, i: int, died: WorkerDied, running: Sequence[tuple[int, int]] = ()
    ) -> None:
        """Generator ``i`` is lost (``died``): go on without it, making again elsewhere what
        it held (``running``: what the failed call was making or scoring), or end the run
        (:meth:`GeneratorPool.refuse_loss`)."""
        first = i not in self.sched.lost
        if first and not self.sched.stopping:
            self.pool.refuse_loss(died)
        remakes = self.sched.lose_generator(i, running)
        for r in remakes:  # off UQ (the scheduler takes it off) until made again, and rehomed
            self.updates.stand_in(r.step, r.mb)
            if r.left_with is not None:  # what a trainer still holds of it goes
                await self.cluster.forget(r.left_with, [(r.step, r.mb)])
        orphans = self._drop_orphans()
        if first:
            await self.pool.lost(i, died, len(remakes), len(orphans))
        await self._notify()

    async def _generator_loop(self, i: int) -> None:
        """Score what trainers made first; else generate the next admitted micro-batch (and
        score it where its pixels are). Scoring overlapped: generate, and leave the scoring
        to :meth:`_scorer_loop`."""
        running: list[tuple[int, int]] = []  # what the call in flight makes or scores
        try:
            while i not in self.sched.lost:
                running.clear()
                work = self.sched.generator_work(i)
                if work is None:
                    await self._until(
                        lambda: (
                            i in self.sched.lost
                            or self.sched.generator_work(i, take=False) is not None
                        )
                    )
                    continue
                running.append((work.mb.step, work.mb.mb))
                if work.kind == TaskKind.SCORE:  # SQ: what trainers made, first
                    await self._score(i, RolloutRef(work.mb, work.holder, work.version))
                elif work.remake is not None:
                    await self._make_again(i, work.remake)
                else:
                    self._handed_out()
                    made = await self._generate(self.gens[i], work.mb, TaskKind.GENERATE)
                    if self.overlap:
                        await self._notify()  # on its scoring lane's queue
                    else:
                        await self._score(i, made)  # where its pixels are
        except WorkerDied as died:
            if died.worker != self.gens[i].worker:
                raise
            await self._lose(i, died, running)

    async def _scorer_loop(self, i: int) -> None:
        """Scoring lane ``i``: score what trainers made (SQ) first, else what generator ``i``
        made, in the order made; the generator does not wait for it."""
        took = None
        try:
            while i not in self.sched.lost:
                took = self.sched.lane_work(i)
                if took is None:
                    await self._until(
                        lambda: (
                            i in self.sched.lost
                            or (not self.sched.stopping and self.sched.has_to_score(i))
                        )
                    )
                    continue
                await self._score(i, RolloutRef(took.mb, took.holder, took.version))
        except WorkerDied as died:
            if died.worker != self.scorers[i].worker:
                raise
            await self._lose(i, died, [(took.mb.step, took.mb.mb)] if took else [])

    async def _trainer_loop(self, j: int, steps: range) -> None:
        """Update what UQ holds, mini-batch by mini-batch; at a bubble, maybe generate (TAG);
        after each mini-batch, its optimizer step."""
        for s in steps:
            for m, ids in enumerate(self.mini_ids):
                while not self._trained[s, m].is_set():
                    if (mb := self.sched.take_update(s, ids)) is not None:
                        await self._update(j, self.updates[s, mb])
                    elif (tag := self._bubble(j, s)) is not None:
                        await self._generate(self.trainers[j], tag, TaskKind.TAG)  # onto SQ
                        await self._notify()  # a generator scores it
                    else:  # wait for UQ (not asked about a bubble again before an update)
                        await self._until(
                            lambda s=s, m=m, ids=ids: (
                                self._trained[s, m].is_set() or self.sched.has_update(s, ids)
                            )
                        )
                await self._stepped[s, m].wait()

    async def _trained_or_stopped(self, s: int, m: int) -> bool:
        """Wait until mini-batch ``m`` of step ``s`` is trained (True) or a stop has every
        worker idle (False)."""
        trained = asyncio.ensure_future(self._trained[s, m].wait())
        quiet = asyncio.ensure_future(self._call.quiet.wait())
        try:
            await asyncio.wait({trained, quiet}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            trained.cancel()
            quiet.cancel()
        return self._trained[s, m].is_set()

    async def _optimizer_step(self, s: int, m: int) -> tuple[int, float, float]:
        """Mini-batch ``m`` of step ``s`` is trained: every trainer steps on its gradients.
        Returns ``(version, grad norm, seconds)``; the version moves at the step's last."""
        t0, last = self.clock(), m == len(self.mini_ids) - 1
        ids = self.mini_ids[m]
        if not last:
            self.sched.mid_step = True  # from its start: a stop now must wait for the step's end
        request = StepRequest(ids, last)
        stepped = await asyncio.gather(
            *(self._call(t, TaskKind.STEP, s, -1, s, t.step(request)) for t in self.trainers)
        )
        if not last:
            self._stepped[s, m].set()  # the trainers go on to the next mini-batch
        version, grad_norm = stepped[0]
        return version, grad_norm, self.clock() - t0

    async def _finish_step(
        self, s: int, since: tuple[float, Any], stepped: list[tuple[int, float, float]]
    ) -> StepResult:
        """Once step ``s`` has taken its optimizer steps (``stepped``): the new weights out.
        ``since``: the clock and the driver's payload count when the previous step ended."""
        t_start, mark = since
        version = stepped[-1][0]
        rec = self.sched.advance(version)
        self._stepped[s, len(self.mini_ids) - 1].set()
        for key in [k for k in self._trained if k[0] < s]:
            self._trained.pop(key)  # every trainer loop is past step s - 1
        for key in [k for k in self._stepped if k[0] < s - 1]:
            self._stepped.pop(key)
        self.updates.step_done(s)
        t1 = self.clock()
        await self._sync(version)
        return self.accounts.step_result(
            rec,
            self.prompts(s)[0],
            version=version,
            grad_norms=[norm for _, norm, _ in stepped],
            step_time_s=self.clock() - t_start,  # since the previous step ended
            optimizer_s=sum(seconds for _, _, seconds in stepped),
            sync_s=self.clock() - t1,
            driver_mb=(self.cluster.payload - mark).megabytes,
            generators_alive=len(self.sched.alive),
        )

    async def evaluate(
        self, prompts: Sequence[str], metadata: Sequence[dict], samples: int
    ) -> tuple[int, list[EvalScores]]:
        """Evaluate the generators' current weights
        (:func:`~digen.runtime.driver.evaluation.evaluate`): the version and the scores."""
        size = self.plan.layout.samples_per_microbatch if self.plan.layout else None
        members = Members(self.gens, self.scorers, self.trainers[0], self.sched, self._lose)
        return await evaluate(members, self.cfg.eval.ema > 0, size, prompts, metadata, samples)

    # --- the work ---------------------------------------------------------------------------

    async def _generate(
        self, actor: GeneratorHandle | TrainerHandle, mb: MicroBatch, kind: TaskKind
    ) -> RolloutRef:
        keys = tuple(SampleKey(mb.step, mb.prompt, s) for s in mb.samples)
        texts = self.prompts(mb.step)[0]
        request = GenerateRequest(mb.step, mb.mb, keys, texts[mb.prompt], True, self._ahead(texts))
        version = await self._call(actor, kind, mb.step, mb.mb, None, actor.generate(request))
        self.sched.generated(mb, actor.worker, version)
        return RolloutRef(mb, actor.worker, version)

    def _ahead(self, texts: list[str]) -> tuple[str, ...]:
        """What a generate call carries besides its prompt: with offloaded text encoders the
        step's prompts, which the worker encodes in one visit of the encoders to its device
        (not one a micro-batch); nothing otherwise."""
        return tuple(texts) if self.cfg.model.offload_text_encoders else ()

    async def _make_again(self, i: int, remake: Remake) -> None:
        """Generator ``i`` makes ``remake`` again from its keys: a scored one only for the
        trainers (no pixels kept), with the version that made it, so its samples are the
        ones its rewards and advantages are of; an unscored one goes on to be scored."""
        gen, s = self.gens[i], remake.step
        mb = self.sched.record(s).mbs[remake.mb]
        keys = tuple(SampleKey(s, mb.prompt, j) for j in mb.samples)
        texts = self.prompts(s)[0]
        keep = not remake.scored
        request = GenerateRequest(s, mb.mb, keys, texts[mb.prompt], keep, self._ahead(texts))
        t0 = self.clock()
        call = gen.generate(request)
        version = await self._call(gen, TaskKind.GENERATE, s, mb.mb, None, call)
        if remake.scored and version != remake.version:
            raise AssertionError(
                f"{mb} was made again with version {version}, not {remake.version}"
            )
        self.sched.remade(remake, gen.worker, version, self.clock() - t0)
        if remake.scored:
            self.updates.rehome(s, mb.mb, gen.worker, version)
        elif not self.overlap:
            await self._score(i, RolloutRef(mb, gen.worker, version))
        await self._notify()

    def _drop_orphans(self) -> list[Remake]:
        """TCSS: scored stale work of a lost generator that no generator can make again (its
        version is gone) is left out of its step's gradient, and said so."""
        orphans = self.sched.orphaned()
        for r in orphans:
            self.updates.done(r.step, r.mb)
            logging.getLogger("digen").warning(
                f"micro-batch {r.mb} of step {r.step} (made with version {r.version} by a lost "
                "generator) is left out of the step: no generator holds that version any more."
            )
            self._maybe_trained(r.step)
        return orphans

    async def _score(self, i: int, made: RolloutRef) -> None:
        g, mb, k = self.scorers[i], made.mb, len(made.mb.samples)
        texts, meta = self.prompts(mb.step)
        thumbs = self._samples_at(mb.step) and mb.mb * k < GRID_SAMPLES
        prompt, data = (texts[mb.prompt],) * k, (meta[mb.prompt],) * k
        call = g.score(ScoreRequest(mb.step, mb.mb, made.holder, prompt, data, thumbs))
        lane = worker_name(Pool.SCORER, i) if self.overlap else g.worker
        scores = await self._call(g, TaskKind.SCORE, mb.step, mb.mb, made.version, call, lane)
        self.accounts.scored(mb.step, scores.latency_s)
        if self.sched.scored(mb, scores.total, scores.components, scores.thumbnails):
            await self._group_scored(mb.step, mb.prompt)

    async def _group_scored(self, s: int, prompt: int) -> None:
        """A group is complete: its updates go to UQ (:meth:`Updates.group_scored`); what
        kept no sample is released where it is held."""
        for holder, mb in self.updates.group_scored(s, prompt):
            await self.cluster.release(holder, [(s, mb)])
        await self._notify()
        self._maybe_trained(s)

    async def _update(self, j: int, task: UpdateTask) -> None:
        t, mb, s = self.trainers[j], task.rollout.mb, task.rollout.mb.step
        keys = tuple(SampleKey(s, mb.prompt, mb.samples[r]) for r in task.rows)
        text = self.prompts(s)[0][mb.prompt]
        scale = 1.0 / step_terms(self.cfg, s, prompts=self.mini_size)  # its optimizer step's
        holder = task.rollout.holder
        made_by = task.rollout.version  # the version that sampled it (TCSS: maybe behind)
        request = UpdateRequest(
            s, mb.mb, holder, keys, task.rows, text, task.advantages, scale, made_by
        )
        call = t.update(request)
        try:
            stats = await self._call(t, TaskKind.UPDATE, s, mb.mb, s, call)
        except Exception as exc:
            i = self.pool.index(holder)
            if i is None or (isinstance(exc, WorkerDied) and exc.worker != holder):
                raise  # the trainer's own failure, or its loss
            died = await self.cluster.death_of(holder)
            if died is None:
                raise
            if len(t.members) > 1:  # sharded: the members went apart
                raise died.again("sharded trainers cannot go on from an update it broke") from exc
            await self._lose(i, died)  # its rollout never reached this trainer: make it again
            if self.updates.current(task):  # else made again already, and rehomed
                self.sched.remake_scored(s, mb.mb)
            self._drop_orphans()
            await self._notify()
            return
        self.updates.done(s, mb.mb)
        self.sched.trained(s, mb.mb, stats)
        await self._notify()
        self._maybe_trained(s)

    def _maybe_trained(self, s: int) -> None:
        """When a mini-batch of step ``s`` is fully trained: release its trainers from its
        UQ, wake its optimizer step."""
        rec = self.sched.record(s)
        for m, ids in enumerate(self.mini_ids):
            if not self._trained[s, m].is_set() and rec.all_trained_in(ids):
                self._trained[s, m].set()  # its trainers go on to its optimizer step

    async def _sync(self, version: int) -> None:
        """Version ``version`` to every generator, queued behind what each is generating."""
        if self.sched.quota_pending(version) and not self.sched.stopping:
            # fixed TCSS: the step's early micro-batches go out first
            self._quota_waiter = (version, asyncio.get_running_loop().create_future())
            try:
                await self._quota_waiter[1]
            finally:
                self._quota_waiter = None
        step = version - 1

        async def send(i: int) -> WorkerDied | None:
            """Version ``version`` to generator ``i``; its loss instead, if it was lost."""
            call = self.cluster.send_weights(i, version)
            try:
                await self._call(self.gens[i], TaskKind.SYNC, step, -1, version, call)
            except WorkerDied as died:
                if died.worker != self.gens[i].worker:
                    raise
                return died
            return None

        async def load(i: int) -> None:
            self.sched.gen_version[i] = version  # the generator's next call runs with it
            if died := await send(i):
                await self._lose(i, died)

        joining = self.pool.take_joining()

        async def join(i: int) -> None:  # a generator back: this version before any work
            if died := await send(i):
                await self.pool.lost_before_joining(i, died)
                return
            self.sched.rejoin(i, version)
            self._start(f"loop-{self.gens[i].worker}", lambda: self._generator_loop(i))
            if self.overlap:
                self._start(f"loop-scorer-{i}", lambda: self._scorer_loop(i))
            await self.pool.joined(i, version)

        calls = [load(i) for i in self.sched.alive] + [join(i) for i in joining]
        served = self.cluster.serve_weights(version)  # trainer 0's part of a broadcast
        if served is not None:
            calls.append(self._call(self.trainers[0], TaskKind.SYNC, step, -1, version, served))
        t0 = self.clock()
        await asyncio.gather(*calls)
        self.accounts.trace.record(TaskKind.SYNC.value, DRIVER, step, -1, version, t0, self.clock())
        self._drop_orphans()
        await self._notify()

    # --- decisions -----------------------------------------------------------------------------

    def _handed_out(self) -> None:
        """A micro-batch was handed out: a weight sync waiting for the fixed TCSS quota may
        go (the caller sends its generate call before it next yields: a weight load queued
        in between would make it with other weights than the ones admitted)."""
        waiting = self._quota_waiter
        released = waiting is not None and not self.sched.quota_pending(waiting[0])
        if released and not waiting[1].done():
            waiting[1].set_result(None)

    def _bubble(self, j: int, s: int) -> MicroBatch | None:
        """Trainer ``j`` found UQ empty in step ``s``: the micro-batch it makes now (TAG),
        or None (it waits)."""
        if not self.sched.at_bubble(j, s):
            return None
        mb = self.sched.answer(j, self._decide_tag(j))
        if mb is not None:
            self._handed_out()
        return mb

    def _decide_tag(self, j: int) -> bool:
        """Ask the TAG policy (the first bubble of a run is a probe of TAG's speed)."""
        profiler = self.accounts.profiler
        if self.tag_policy is None:
            return False
        if not profiler.seen("gen_tag"):
            return True  # one TAG measures the trainer's generation speed, as the paper does
        if not profiler.ready() or not self.sched.plannable:
            return False  # remakes pending: the state the search plans on cannot show them
        costs = profiler.costs(generator_pool=Pool.GENERATOR, trainer_pool=Pool.TRAINER)
        return self.tag_policy.decide(self.sched.sched_state(j, self.clock(), costs), costs)

    # --- plumbing ------------------------------------------------------------------------------

    async def _until(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``, asked again at every change (:meth:`_notify`)."""
        async with self.changed:
            await self.changed.wait_for(ready)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()


def _ids_of(mbs: Sequence[MicroBatch], prompts: range) -> range:
    """The ids of the micro-batches of ``prompts`` (consecutive: they go out prompt by prompt)."""
    ids = [m.mb for m in mbs if m.prompt in prompts]
    if ids != list(range(ids[0], ids[-1] + 1)):
        raise AssertionError(f"the micro-batches of prompts {prompts} are not consecutive: {ids}")
    return range(ids[0], ids[-1] + 1)


def _main_error(group: BaseExceptionGroup) -> BaseException:
    """The error to report for a failed run: a dead worker first, else the first failure."""
    died = group.subgroup(WorkerDied)
    leaves, stack = [], [died if died is not None else group]
    while stack:
        exc = stack.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            stack[:0] = exc.exceptions
        else:
            leaves.append(exc)
    return leaves[0]
