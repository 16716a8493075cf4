"""The disaggregated driver: the paper's Algorithm 1 as asyncio coroutines.

The driver holds no model and moves no tensors: it passes keys, rewards, advantages and
versions, and trainers fetch rollouts from the generators that keep them
(:mod:`digen.runtime.worker.store`). Its coroutines share one :class:`asyncio.TaskGroup`, so
a failure anywhere cancels the rest and surfaces as one error naming the worker:

- :meth:`Driver._generator_loop`, one per generator (lines 5-17): what trainers made (SQ)
  first, else the next micro-batch admission allows (TCSS staleness, ``C_gen``), generated
  and scored where its pixels are, or, with ``runtime.schedule.score_overlap``, scored by
  :meth:`Driver._scorer_loop` on the actor beside it. A scored group's micro-batches go on UQ;
- :meth:`Driver._trainer_loop`, one per trainer (lines 18-26): update what UQ holds; at a
  *bubble* (UQ empty) the TAG policy decides whether the trainer generates instead;
- :meth:`Driver._train_step` (lines 27-31): as each mini-batch is trained every trainer
  steps; after the last, the generators load the new version behind what they are making
  (:class:`~digen.runtime.driver.step.StepEnd`).

Who runs what next is the :class:`~digen.sched.scheduler.Scheduler`'s (the simulator runs the
same one with a clock). The loops ask it and hand the work to
:class:`~digen.runtime.driver.work.Work`; the other rooms are mapped in
:mod:`digen.runtime.driver`.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Coroutine, Sequence
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

from digen.algos.train_step import mini_batches
from digen.checkpoint import Checkpoint
from digen.config import DigenConfig, schedule_plan
from digen.prompts import PromptSet
from digen.runtime.driver.accounting import CostLedger
from digen.runtime.driver.cluster import Cluster, ClusterBackend
from digen.runtime.driver.evaluation import Members, evaluate
from digen.runtime.driver.pool import GeneratorPool
from digen.runtime.driver.progress import Progress
from digen.runtime.driver.recovery import Recovery
from digen.runtime.driver.step import StepEnd
from digen.runtime.driver.updates import RolloutRef, Updates
from digen.runtime.driver.work import Calls, Parts, Work
from digen.runtime.messages import EvalScores, StepResult
from digen.runtime.transport.actors import WorkerDied
from digen.sched.microbatch import MicroBatch
from digen.sched.names import Pool, TaskKind, worker_names
from digen.sched.scheduler import Scheduler
from digen.sched.tag import decide_at_bubble, make_tag_policy
from digen.sched.trace import Trace

__all__ = ["Driver"]


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
        self.prompts = lru_cache(maxsize=8)(
            lambda step: prompts.for_step(cfg.seed, step, cfg.data.train_batch_size)
        )
        """``prompts(step)``: the texts and metadata of the step's prompts."""
        self.plan = schedule_plan(cfg, first_step=resume.step if resume is not None else 0)
        """The run's schedule (:mod:`digen.sched.plan`): the rules below all read it."""
        self.sched = Scheduler(self.plan)
        workers = worker_names(Pool.GENERATOR, cfg.runtime.generators)
        workers += worker_names(Pool.TRAINER, self.plan.trainers)
        self.accounts = CostLedger(cfg, trace, workers, resume.path if resume else None)
        self.tag_policy = make_tag_policy(self.plan.tag, self.plan.tag_k)
        minis = mini_batches(cfg)  # one optimizer step each (train.mini_batch_size)
        self.mini_ids = [self.plan.ids_of(prompts) for prompts in minis]
        """Per mini-batch, the ids of its micro-batches (the same in every step)."""
        self.progress = Progress(self.sched, self.mini_ids)
        """What the loops wait on: a change, each mini-batch trained, its optimizer step."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._call = Calls(self.sched, self.accounts, clock)
        """Awaits every actor call, telling the scheduler and the accounts."""
        self._tg: asyncio.TaskGroup | None = None
        self._loops: list[asyncio.Task] = []
        # the rooms beside the loops (the package's docstring maps them)
        self.pool = GeneratorPool(
            cfg, cluster, self.sched, trace, clock, stopping=lambda: self.sched.stopping
        )
        self.pool.start = self._start
        weights = {r.name: r.weight for r in rewards or cfg.rewards}
        self.updates = Updates(cfg, self.sched, weights, self.pool.holder_lost)
        self.recovery = Recovery(cluster, self.sched, self.updates, self.pool, self.progress)
        parts = Parts(
            cluster, self.sched, self._call, self.accounts, self.progress, self.recovery,
            self.updates, self.prompts,
        )  # fmt: skip
        self.step_end = StepEnd(parts, self.pool, self.mini_ids, self._start_generator)
        self.work = Work(cfg, parts, len(minis[0]), self.step_end.handed_out)

    @property
    def version(self) -> int:
        """The trainers' weights: the train step being trained."""
        return self.sched.version

    def request_stop(self) -> None:
        """Stop at the next micro-batch boundary (callable from any thread or a signal
        handler): calls already running finish, no new generation, score or update starts,
        and :meth:`run` returns the steps completed. A step whose micro-batches were all
        trained still takes its optimizer step; a partly trained one is left (its gradients
        are dropped with the run, its weights were not changed), so a checkpoint written
        next holds the last completed step, and a resume makes the rest again."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.step_end.begin_stop)

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
        self.work.samples_at = samples_at or (lambda step: False)
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
                    if on_step is not None:
                        go = on_step(result)
                        if inspect.isawaitable(go):
                            go = await go
                        if go is False:
                            break
                for task in self._loops:
                    task.cancel()
        except BaseExceptionGroup as group:
            await self._raise_failure(group, went_on=self.sched.lost)
        return results

    def _start_loops(self, steps: range) -> None:
        """Algorithm 1's coroutines: one per generator, scoring lane and trainer, and the
        pool's watchers."""
        for i, g in enumerate(self.gens):
            self._start(f"loop-{g.worker}", partial(self._generator_loop, i))
        for i in range(len(self.gens) if self.work.overlap else 0):
            self._start(f"loop-scorer-{i}", partial(self._scorer_loop, i))
        for j, t in enumerate(self.trainers):
            self._start(f"loop-{t.worker}", partial(self._trainer_loop, j, steps))
        self._start("loop-watch", partial(self.pool.watch_losses, self.recovery.lose))
        if self.cfg.runtime.elastic.accept_generators:
            self._start("loop-arrivals", partial(self.pool.watch_arrivals, self.accounts.workers))

    async def _train_step(self, s: int) -> StepResult | None:
        """Lines 27-31: as each mini-batch of step ``s`` is trained, every trainer steps;
        after the last, the new weights go out. None: stopped inside the step."""
        since = self.clock(), self.cluster.payload  # the previous step's end
        stepped = []  # (version, grad norm, seconds) per mini-batch
        for m in range(len(self.mini_ids)):
            if not await self.progress.trained_or_stopped(s, m, self._call.quiet):
                return None
            stepped.append(await self.step_end.optimizer_step(s, m))
        return await self.step_end.finish(s, since, stepped)

    def _start(self, name: str, make: Callable[[], Coroutine[Any, Any, None]]) -> bool:
        """Run ``make()`` as one of the running driver's tasks (False: it is not running)."""
        if self._tg is None:
            return False
        self._loops.append(self._tg.create_task(make(), name=name))
        return True

    def _start_generator(self, i: int) -> None:
        """The loops of generator ``i``, which joined the running run."""
        self._start(f"loop-{self.gens[i].worker}", partial(self._generator_loop, i))
        if self.work.overlap:
            self._start(f"loop-scorer-{i}", partial(self._scorer_loop, i))

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
                    await self.progress.until(
                        lambda: (
                            i in self.sched.lost
                            or self.sched.generator_work(i, take=False) is not None
                        )
                    )
                    continue
                running.append((work.mb.step, work.mb.mb))
                if work.kind == TaskKind.SCORE:  # SQ: what trainers made, first
                    await self.work.score(i, RolloutRef(work.mb, work.holder, work.version))
                elif work.remake is not None:
                    await self.work.make_again(i, work.remake)
                else:
                    made = await self.work.generate(self.gens[i], work.mb, TaskKind.GENERATE)
                    if self.work.overlap:
                        await self.progress.notify()  # on its scoring lane's queue
                    else:
                        await self.work.score(i, made)  # where its pixels are
        except WorkerDied as died:
            if died.worker not in self.gens[i].members:  # (any process of a generator)
                raise
            await self.recovery.lose(i, died, running)

    async def _scorer_loop(self, i: int) -> None:
        """Scoring lane ``i``: score what trainers made (SQ) first, else what generator ``i``
        made, in the order made; the generator does not wait for it."""
        took = None
        try:
            while i not in self.sched.lost:
                took = self.sched.lane_work(i)
                if took is None:
                    await self.progress.until(
                        lambda: (
                            i in self.sched.lost
                            or (not self.sched.stopping and self.sched.has_to_score(i))
                        )
                    )
                    continue
                await self.work.score(i, RolloutRef(took.mb, took.holder, took.version))
        except WorkerDied as died:
            if died.worker != self.work.scorers[i].worker:
                raise
            await self.recovery.lose(i, died, [(took.mb.step, took.mb.mb)] if took else [])

    async def _trainer_loop(self, j: int, steps: range) -> None:
        """Update what UQ holds, mini-batch by mini-batch; at a bubble, maybe generate (TAG);
        after each mini-batch, its optimizer step."""
        for s in steps:
            for m, ids in enumerate(self.mini_ids):
                while not self.progress.trained(s, m):
                    if mbs := self.sched.take_updates(s, ids):
                        await self.work.update(j, [self.updates[s, mb] for mb in mbs])
                    elif (tag := self._bubble(j, s)) is not None:
                        await self.work.generate(self.trainers[j], tag, TaskKind.TAG)  # onto SQ
                        await self.progress.notify()  # a generator scores it
                    else:  # wait for UQ (not asked about a bubble again before an update)
                        await self.progress.until(
                            lambda s=s, m=m, ids=ids: (
                                self.progress.trained(s, m) or self.sched.has_update(s, ids)
                            )
                        )
                await self.progress.wait_stepped(s, m)

    def _bubble(self, j: int, s: int) -> MicroBatch | None:
        """Trainer ``j`` found UQ empty in step ``s``: the micro-batch it makes now (TAG),
        or None (it waits)."""
        if not self.sched.at_bubble(j, s):
            return None
        profiler = self.accounts.profiler
        return self.sched.answer(
            j, decide_at_bubble(self.tag_policy, profiler, self.sched, j, self.clock)
        )

    async def evaluate(
        self, prompts: Sequence[str], metadata: Sequence[dict], samples: int
    ) -> tuple[int, list[EvalScores]]:
        """Evaluate the generators' current weights
        (:func:`~digen.runtime.driver.evaluation.evaluate`): the version and the scores."""
        size = self.plan.layout.samples_per_microbatch if self.plan.layout else None
        scorers, lose = self.work.scorers, self.recovery.lose
        members = Members(self.gens, scorers, self.trainers[0], self.sched, lose)
        return await evaluate(members, self.cfg.eval.ema > 0, size, prompts, metadata, samples)
