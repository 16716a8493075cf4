"""Every call the driver awaits on an actor, told to the scheduler and the accounts.

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
from collections.abc import Callable, Coroutine
from typing import Any

from digen.runtime.driver.accounting import CostLedger
from digen.runtime.driver.handles import GeneratorHandle, ScorerHandle, TrainerHandle
from digen.sched.names import TaskKind
from digen.sched.scheduler import Scheduler

__all__ = ["Calls"]


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
