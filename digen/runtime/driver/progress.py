"""What the driver's loops wait on, and what wakes them.

Every loop that finds nothing to do waits on one condition (:meth:`Progress.until`), asked
again at every change (:meth:`Progress.notify`: a version, SQ, UQ, a trained micro-batch, a
loss). A train step's mini-batches have two gates each: *trained* (every micro-batch of it
updated: its optimizer step may run) and *stepped* (the optimizer step taken: the trainers
go on to the next mini-batch).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Sequence

from digen.sched.scheduler import Scheduler

__all__ = ["Progress"]


class Progress:
    """The driver's wake-ups and step gates (module docstring)."""

    def __init__(self, sched: Scheduler, mini_ids: Sequence[range]) -> None:
        """``mini_ids``: per mini-batch, the ids of its micro-batches (the same every step)."""
        self.sched, self.mini_ids = sched, mini_ids
        self.changed = asyncio.Condition()
        self._trained: dict[tuple[int, int], asyncio.Event] = defaultdict(asyncio.Event)
        self._stepped: dict[tuple[int, int], asyncio.Event] = defaultdict(asyncio.Event)

    async def until(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``, asked again at every :meth:`notify`."""
        async with self.changed:
            await self.changed.wait_for(ready)

    async def notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    def trained(self, s: int, m: int) -> bool:
        """Whether every micro-batch of mini-batch ``m`` of step ``s`` is trained."""
        return self._trained[s, m].is_set()

    def maybe_trained(self, s: int) -> None:
        """Open the trained gate of each mini-batch of step ``s`` that is fully trained: its
        trainers leave its UQ and its optimizer step may run."""
        rec = self.sched.record(s)
        for m, ids in enumerate(self.mini_ids):
            if not self._trained[s, m].is_set() and rec.all_trained_in(ids):
                self._trained[s, m].set()

    async def trained_or_stopped(self, s: int, m: int, quiet: asyncio.Event) -> bool:
        """Wait until mini-batch ``m`` of step ``s`` is trained (True) or ``quiet`` is set: a
        stop has every worker idle (False)."""
        trained = asyncio.ensure_future(self._trained[s, m].wait())
        idle = asyncio.ensure_future(quiet.wait())
        try:
            await asyncio.wait({trained, idle}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            trained.cancel()
            idle.cancel()
        return self._trained[s, m].is_set()

    def stepped(self, s: int, m: int) -> None:
        """Mini-batch ``m`` of step ``s`` took its optimizer step: its trainers go on."""
        self._stepped[s, m].set()

    async def wait_stepped(self, s: int, m: int) -> None:
        await self._stepped[s, m].wait()

    def step_over(self, s: int) -> None:
        """Step ``s`` took its last optimizer step: its trainers go on to the next step, and
        the gates no loop can wait on any more are dropped."""
        self._stepped[s, len(self.mini_ids) - 1].set()
        for key in [k for k in self._trained if k[0] < s]:
            self._trained.pop(key)  # every trainer loop is past step s - 1
        for key in [k for k in self._stepped if k[0] < s - 1]:
            self._stepped.pop(key)
