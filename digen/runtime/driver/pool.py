"""The generator pool's membership: who is in it, a generator lost, one started again, one
that joins by itself.

The driver (:mod:`digen.runtime.driver.loop`) schedules work on the generators that are in
the pool; this module decides what a change of members means and says it:

- a **loss** either ends the run (``runtime.elastic.on_generator_loss = fail``, fewer
  than ``runtime.elastic.min_generators`` left, a weight broadcast group) or is gone on
  without: the driver has what the lost generator held made again by the others, and the
  pool logs it, tells the runner (``on_change``) and, with
  ``runtime.elastic.respawn_generators``, starts a new process in its place after a
  back-off;
- a generator **started again** or one that **joined the world** (``digen join``, with
  ``runtime.elastic.accept_generators``) waits in :attr:`GeneratorPool.joining` until the
  next weight sync, where it takes that step's weights before any work
  (:mod:`~digen.runtime.driver.step`), and the pool says it is back.

What each member holds and which ones are alive is the scheduler's
(:class:`~digen.sched.scheduler.Scheduler`): the pool reads it and keeps only what membership
adds (restarts so far, who is joining).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from digen.config import DigenConfig
from digen.runtime.transport.actors import WorkerDied
from digen.sched.names import Pool, pool_of
from digen.sched.scheduler import Scheduler
from digen.sched.trace import Trace

__all__ = ["GeneratorPool"]

Start = Callable[[str, Callable[[], Coroutine[Any, Any, None]]], bool]
"""``start(name, make)``: run ``make()`` as a task of the running driver (False: not running)."""


def _log() -> logging.Logger:
    return logging.getLogger("digen")


class GeneratorPool:
    """Membership of the generator pool (module docstring)."""

    def __init__(
        self,
        cfg: DigenConfig,
        cluster: Any,
        sched: Scheduler,
        trace: Trace,
        clock: Callable[[], float],
        stopping: Callable[[], bool],
    ) -> None:
        """``cluster``: the actors; ``sched``: who is alive and what each holds; ``trace``:
        where losses and returns are marked; ``stopping``: whether the run is stopping (no
        restart, no new member then)."""
        self.rt, self.cluster, self.sched = cfg.runtime, cluster, sched
        self.trace, self.clock, self.stopping = trace, clock, stopping
        self.respawns: dict[int, int] = defaultdict(int)
        """Restarts of each generator so far (``runtime.elastic.respawn_generators``)."""
        self.joining: set[int] = set()
        """Generators started again or arrived, joining at the next weight sync."""
        self.on_change: Callable[[dict[str, Any]], Any] | None = None
        """Told (sync or async) of each generator lost: ``{"event", "worker", "cause",
        "remade", "dropped", "generators"}``, and of each one back (``"event":
        "generator_joined"``); the runner logs them and rewrites ``workers.json``."""
        self.start: Start = lambda name, make: False
        """Set by the running driver: how a restart becomes one of its tasks."""

    @property
    def actors(self) -> list[Any]:
        return self.cluster.gens

    def index(self, worker: str) -> int | None:
        """The pool index of generator ``worker``, or of the generator it is a process of
        (a generator of several devices is lost with any of them); None: not the pool's."""
        for i, g in enumerate(self.actors):
            if worker in g.members:
                return i
        return None

    def holder_lost(self, holder: str) -> bool:
        """Whether ``holder`` is a generator the run has lost (what it holds is gone)."""
        i = self.index(holder)
        return i is not None and i in self.sched.lost

    def refuse_loss(self, died: WorkerDied) -> None:
        """Raise ``died`` again, with the reason, when the run cannot go on without it."""
        left, why = len(self.sched.alive) - 1, None
        if self.rt.elastic.on_generator_loss == "fail":
            why = "runtime.elastic.on_generator_loss is fail"
        elif left < self.rt.elastic.min_generators:
            least = self.rt.elastic.min_generators
            why = f"{left} generator(s) left, fewer than runtime.elastic.min_generators ({least})"
        elif self.rt.transport.weight_sync == "broadcast":
            why = (
                "the weight broadcast group cannot lose a member "
                "(runtime.transport.weight_sync=rpc can)"
            )
        if why is not None:
            raise died.again(why)

    async def lost(self, i: int, died: WorkerDied, remade: int, dropped: int) -> None:
        """Generator ``i`` is out of the pool (``died``), ``remade`` micro-batches it held
        are being made again and ``dropped`` stale ones left out: mark it, say it, tell the
        runner, and start it again if the run allows."""
        self.trace.mark("lost", died.worker, self.clock())
        alive = len(self.sched.alive)
        text = (
            f"{died} The run goes on with {alive} generator(s); "
            f"{remade} micro-batch(es) it held are made again"
        )
        if dropped:
            text += f", {dropped} stale one(s) no generator can remake are dropped"
        _log().warning(text + ".")
        await self._changed(
            {
                "event": "generator_lost",
                "worker": died.worker,
                "cause": str(died),
                "remade": remade,
                "dropped": dropped,
                "generators": alive,
            }
        )
        self._maybe_restart(i, died)

    async def lost_before_joining(self, i: int, died: WorkerDied) -> None:
        """A restarted generator lost before it joined: it held nothing; start it again."""
        _log().warning(f"{died} It had not joined the run yet.")
        self._maybe_restart(i, died)

    def take_joining(self) -> list[int]:
        """The generators waiting to join, now joining (at this weight sync)."""
        joining, self.joining = sorted(self.joining), set()
        return joining

    async def joined(self, i: int, version: int) -> None:
        """Generator ``i`` has version ``version`` and is in the pool again: mark and say it."""
        name = self.actors[i].worker
        self.trace.mark("joined", name, self.clock())
        alive = len(self.sched.alive)
        how = "joined the run"
        if self.respawns[i]:
            how = f"is back (restart {self.respawns[i]} of {self.rt.elastic.max_respawns})"
        _log().warning(
            f"{name} (pid {self.cluster.pid_of(name)}) {how} with version {version}; "
            f"the run goes on with {alive} generator(s)."
        )
        await self._changed(
            {
                "event": "generator_joined",
                "worker": name,
                "generators": alive,
                "version": version,
                "restart": self.respawns[i],
            }
        )

    async def watch_losses(self, lose: Callable[[int, WorkerDied], Awaitable[None]]) -> None:
        """A worker lost while no call to it is running (an idle trainer killed while a
        generator scores a long reward) is seen as soon as the watchdog sees it: a generator
        is gone on without (``lose``), any other loss ends the run."""
        while True:
            died = await self.cluster.next_loss()
            i = self.index(died.worker)
            if i is not None:
                await lose(i, died)
            elif pool_of(died.worker) == Pool.GENERATOR:  # joined the world, not yet the run
                _log().warning(f"{died} It had not joined the run yet.")
            else:
                raise died.again()

    async def watch_arrivals(self, workers: list[str]) -> None:
        """Generators that join the world by themselves
        (``runtime.elastic.accept_generators``): each gets its actors and its name in
        ``workers`` (the cost ledger's), and joins the pool at the next weight sync."""
        while True:
            arrival = await self.cluster.next_arrival()
            if self.stopping():
                continue  # the stop handshake ends it with the others
            try:
                i = await self.cluster.add_generator(arrival.name)
            except WorkerDied as died:
                _log().warning(f"{died} It had not joined the run yet.")
                continue
            if self.sched.add_generator() != i:
                raise RuntimeError(f"{arrival.name}: the pool's generators are out of step")
            workers.append(arrival.name)
            self.joining.add(i)
            _log().warning(
                f"{arrival.name} (host {arrival.host}, pid {arrival.pid}) joined the world; "
                "it joins the run at the next step boundary."
            )

    def _maybe_restart(self, i: int, died: WorkerDied) -> None:
        again = self.rt.elastic.respawn_generators and self.cluster.can_respawn(i)
        if again and self.respawns[i] < self.rt.elastic.max_respawns:
            self.start(f"respawn-{died.worker}", lambda: self._respawn(i))

    async def _respawn(self, i: int) -> None:
        """Start lost generator ``i`` again after the back-off; it joins the pool at the next
        weight sync, with that step's weights. A restart that fails is said in the log and
        tried again, up to ``runtime.elastic.max_respawns``."""
        rt, name = self.rt, self.actors[i].worker
        while self.respawns[i] < rt.elastic.max_respawns and not self.stopping():
            self.respawns[i] += 1
            await asyncio.sleep(rt.elastic.respawn_after_s * 2 ** (self.respawns[i] - 1))
            if self.stopping():
                return
            try:
                await self.cluster.respawn_generator(i)
            except Exception as exc:  # noqa: BLE001 (said, and tried again)
                _log().warning(
                    f"{name} could not be started again ({type(exc).__name__}: {exc}); "
                    f"restart {self.respawns[i]} of {rt.elastic.max_respawns}."
                )
                continue
            self.joining.add(i)
            _log().warning(
                f"{name} (pid {self.cluster.pid_of(name)}) started again (restart "
                f"{self.respawns[i]} of {rt.elastic.max_respawns}); it joins at the next step "
                "boundary."
            )
            return

    async def _changed(self, event: dict[str, Any]) -> None:
        if self.on_change is not None:
            done = self.on_change(event)
            if inspect.isawaitable(done):
                await done
