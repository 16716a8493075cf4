"""The weight sync at a step's end (Algorithm 1, line 31): version ``s + 1`` to every
generator, each behind the generation it is running (trajectory consistency).

With the fixed TCSS schedule the step's early micro-batches (those made one version
behind) go out first: the sync waits until the last of them is handed out
(:meth:`WeightSync.handed_out`), so no generator makes one with weights newer than it was
admitted with. A generator back or new (:class:`~digen.runtime.driver.pool.GeneratorPool`)
takes the version here, before any work, and its loops start.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from digen.runtime.driver.calls import Calls
from digen.runtime.driver.pool import GeneratorPool
from digen.runtime.driver.progress import Progress
from digen.runtime.driver.recovery import Recovery
from digen.runtime.transport.actors import WorkerDied
from digen.sched.names import DRIVER, TaskKind
from digen.sched.scheduler import Scheduler
from digen.sched.trace import Trace

__all__ = ["WeightSync"]


class WeightSync:
    """Sends each new version to the generators (module docstring)."""

    def __init__(
        self,
        cluster: Any,
        sched: Scheduler,
        call: Calls,
        pool: GeneratorPool,
        recovery: Recovery,
        progress: Progress,
        trace: Trace,
        clock: Callable[[], float],
        start_loops: Callable[[int], None],
    ) -> None:
        """``start_loops(i)``: start the driver's loops of generator ``i``, which joined."""
        self.cluster, self.sched, self.call, self.pool = cluster, sched, call, pool
        self.recovery, self.progress, self.trace, self.clock = recovery, progress, trace, clock
        self.start_loops = start_loops
        self._quota_waiter: tuple[int, asyncio.Future[None]] | None = None

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

    async def __call__(self, version: int) -> None:
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
