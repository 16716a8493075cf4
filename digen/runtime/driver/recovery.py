"""A generator lost mid-run (``runtime.elastic.on_generator_loss = continue``): what it held is
made again by the others, from the same keys, before any new micro-batch.

:meth:`Recovery.lose` tells the scheduler, which puts what the lost generator held (made,
being made, being scored) on its remakes; an update that was waiting for one of them is
stood in for until the remake rehomes it (:class:`~digen.runtime.driver.updates.Updates`).
A remake is made by whichever generator asks for work next
(:meth:`~digen.runtime.driver.work.Work.make_again`). Stale work (TCSS) whose version no
generator holds any more cannot be made again: it is left out of its step
(:meth:`Recovery.drop_orphans`), and said so. Whether the run may go on at all, and what the
log and the runner hear, is the :class:`~digen.runtime.driver.pool.GeneratorPool`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from digen.runtime.driver.pool import GeneratorPool
from digen.runtime.driver.progress import Progress
from digen.runtime.driver.updates import Updates, UpdateTask
from digen.runtime.transport.actors import WorkerDied
from digen.sched.scheduler import Remake, Scheduler

__all__ = ["Recovery"]


class Recovery:
    """Goes on without a lost generator (module docstring)."""

    def __init__(
        self,
        cluster: Any,
        sched: Scheduler,
        updates: Updates,
        pool: GeneratorPool,
        progress: Progress,
    ) -> None:
        self.cluster, self.sched, self.updates = cluster, sched, updates
        self.pool, self.progress = pool, progress

    async def lose(self, i: int, died: WorkerDied, running: Sequence[tuple[int, int]] = ()) -> None:
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
        orphans = self.drop_orphans()
        if first:
            await self.pool.lost(i, died, len(remakes), len(orphans))
        await self.progress.notify()

    def drop_orphans(self) -> list[Remake]:
        """TCSS: scored stale work of a lost generator that no generator can make again (its
        version is gone) is left out of its step's gradient, and said so."""
        orphans = self.sched.orphaned()
        for r in orphans:
            self.updates.done(r.step, r.mb)
            logging.getLogger("digen").warning(
                f"micro-batch {r.mb} of step {r.step} (made with version {r.version} by a lost "
                "generator) is left out of the step: no generator holds that version any more."
            )
            self.progress.maybe_trained(r.step)
        return orphans

    async def update_failed(self, task: UpdateTask, exc: Exception, sharded: bool) -> bool:
        """An update of ``task`` failed with ``exc``: True when its holder was lost (the
        rollout never reached the trainer), which is gone on without and the micro-batch made
        again; False when the failure is the trainer's own, for the caller to raise.
        ``sharded``: the trainer is several members, which cannot go on apart."""
        holder, mb = task.rollout.holder, task.rollout.mb
        i = self.pool.index(holder)
        if i is None or (isinstance(exc, WorkerDied) and exc.worker != holder):
            return False  # the trainer's own failure, or its loss
        died = await self.cluster.death_of(holder)
        if died is None:
            return False
        if sharded:  # the members went apart
            raise died.again("sharded trainers cannot go on from an update it broke") from exc
        await self.lose(i, died)
        if self.updates.current(task):  # else made again already, and rehomed
            self.sched.remake_scored(mb.step, mb.mb)
        self.drop_orphans()
        await self.progress.notify()
        return True
