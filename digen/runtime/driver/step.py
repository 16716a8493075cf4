"""The end of each mini-batch and of each step (Algorithm 1, lines 27-31): every trainer's
optimizer step, then version ``s + 1`` to every generator, each behind the generation it is
running (trajectory consistency).

With the fixed TCSS schedule the step's early micro-batches (those made one version
behind) go out first: the sync waits until the last of them is handed out
(:meth:`StepEnd.handed_out`), so no generator makes one with weights newer than it was
admitted with. A generator back or new (:class:`~digen.runtime.driver.pool.GeneratorPool`)
takes the version here, before any work, and its loops start. A stop asked for between a
step's first optimizer step and its last waits for the step's end
(:meth:`StepEnd.begin_stop`): the weights a checkpoint holds are never mid-step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from digen.runtime.driver.pool import GeneratorPool
from digen.runtime.driver.work import Parts
from digen.runtime.messages import StepRequest, StepResult
from digen.runtime.transport.actors import WorkerDied
from digen.sched.names import DRIVER, TaskKind

__all__ = ["StepEnd"]

Stepped = tuple[int, float, float]
"""One optimizer step: the trainers' version after it, the gradient norm, its seconds."""


class StepEnd:
    """The trainers' optimizer steps and the weight sync after them (module docstring)."""

    def __init__(
        self,
        parts: Parts,
        pool: GeneratorPool,
        mini_ids: Sequence[range],
        start_loops: Callable[[int], None],
    ) -> None:
        """``mini_ids``: per mini-batch, the ids of its micro-batches; ``start_loops(i)``:
        start the driver's loops of generator ``i``, which joined."""
        self.cluster, self.sched, self.call = parts.cluster, parts.sched, parts.call
        self.accounts, self.recovery, self.progress = parts.accounts, parts.recovery, parts.progress
        self.updates, self.prompts, self.pool = parts.updates, parts.prompts, pool
        self.mini_ids, self.start_loops = mini_ids, start_loops
        self.clock, self.trace = parts.call.clock, parts.accounts.trace
        self._quota_waiter: tuple[int, asyncio.Future[None]] | None = None
        self._stop_after_step = False
        """A stop asked for after the step's first optimizer step: it waits for the step's end."""

    def begin_stop(self) -> None:
        """Stop at the next micro-batch boundary, or, inside a step's optimizer steps, at the
        step's end (:meth:`~digen.runtime.driver.loop.Driver.request_stop`)."""
        if self.sched.mid_step and not self.sched.stopping:
            self._stop_after_step = True  # mid-step weights must not be what a checkpoint holds
            return
        self.sched.stopping = True  # no new generation, score or update starts
        self.call.stopping()
        self.release()

    async def optimizer_step(self, s: int, m: int) -> Stepped:
        """Mini-batch ``m`` of step ``s`` is trained: every trainer steps on its gradients.
        The version moves at the step's last."""
        t0, last = self.clock(), m == len(self.mini_ids) - 1
        if not last:
            self.sched.mid_step = True  # from its start: a stop now must wait for the step's end
        request = StepRequest(self.mini_ids[m], last)
        stepped = await asyncio.gather(
            *(self.call(t, TaskKind.STEP, s, -1, s, t.step(request)) for t in self.cluster.trainers)
        )
        if not last:
            self.progress.stepped(s, m)  # the trainers go on to the next mini-batch
        version, grad_norm = stepped[0]
        return version, grad_norm, self.clock() - t0

    async def finish(self, s: int, since: tuple[float, Any], stepped: list[Stepped]) -> StepResult:
        """Step ``s`` has taken its optimizer steps (``stepped``): the new weights out, and
        the step's metrics row. ``since``: the clock and the driver's payload count when the
        previous step ended."""
        t_start, mark = since
        version = stepped[-1][0]
        rec = self.sched.advance(version)
        self.progress.step_over(s)
        self.updates.step_done(s)
        t1 = self.clock()
        await self.sync(version)
        result = self.accounts.step_result(
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
        if self._stop_after_step:
            self.begin_stop()
        return result

    def handed_out(self) -> None:
        """A micro-batch was handed out: a sync waiting for the fixed TCSS quota may go (the
        caller sends its generate call before it next yields: a weight load queued in
        between would make it with other weights than the ones admitted)."""
        waiting = self._quota_waiter
        if waiting is not None and not self.sched.quota_pending(waiting[0]):
            self.release()

    def release(self) -> None:
        """A sync waiting for the quota goes now (the quota is met, or the run stops)."""
        waiting = self._quota_waiter
        if waiting is not None and not waiting[1].done():
            waiting[1].set_result(None)

    async def sync(self, version: int) -> None:
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
            gen, call = self.cluster.gens[i], self.cluster.send_weights(i, version)
            try:
                await self.call(gen, TaskKind.SYNC, step, -1, version, call)
            except WorkerDied as died:
                if died.worker != gen.worker:
                    raise
                return died
            return None

        async def load(i: int) -> None:
            self.sched.gen_version[i] = version  # the generator's next call runs with it
            if died := await send(i):
                await self.recovery.lose(i, died)

        joining = self.pool.take_joining()

        async def join(i: int) -> None:  # a generator back: this version before any work
            if died := await send(i):
                await self.pool.lost_before_joining(i, died)
                return
            self.sched.rejoin(i, version)
            self.start_loops(i)
            await self.pool.joined(i, version)

        calls = [load(i) for i in self.sched.alive] + [join(i) for i in joining]
        served = self.cluster.serve_weights(version)  # trainer 0's part of a broadcast
        if served is not None:
            trainer = self.cluster.trainers[0]
            calls.append(self.call(trainer, TaskKind.SYNC, step, -1, version, served))
        t0 = self.clock()
        await asyncio.gather(*calls)
        self.trace.record(TaskKind.SYNC.value, DRIVER, step, -1, version, t0, self.clock())
        self.recovery.drop_orphans()
        await self.progress.notify()
