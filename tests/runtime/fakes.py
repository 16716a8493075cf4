"""Fake actors for the driver's loops: no processes, no models, scripted timings.

A :class:`World` is what the fake actors share: a seeded RNG for their costs, how they
sleep (real seconds on the event loop, or a :class:`VirtualClock`'s ticks), the log of every
call and the failures to inject. Results are made up but shaped like the real ones, so the
driver's book-keeping runs exactly as with worker processes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from digen.runtime.driver.handles import GeneratorHandle, ScorerHandle, TrainerHandle
from digen.runtime.messages import LossStats, Scores, TimedResult
from digen.runtime.transport.actors import Arrival, WorkerDied
from digen.sched.names import Pool, pool_of, worker_name


class InjectedFailure(RuntimeError):
    """What a fake actor raises where a test asked it to fail."""


@dataclass
class Payload:
    """Stands in for the actor layer's counters."""

    n: int = 0

    def __sub__(self, other: Payload) -> Payload:
        return Payload(self.n - other.n)

    @property
    def megabytes(self) -> float:
        return self.n / 1e6


class VirtualClock:
    """Time in event-loop iterations: :meth:`run` advances it by one per iteration, and
    :meth:`sleep` yields until it has moved on by ``ticks``. With no real timers anywhere, a
    seeded run interleaves its coroutines the same way every time, however loaded the
    machine, and a cost of thousands of ticks takes no wall time to wait out."""

    def __init__(self, limit: int) -> None:
        self.now = 0
        self.limit = limit

    async def run(self) -> None:
        """Tick until ``limit``: returning means the code under test never finished."""
        while self.now < self.limit:
            await asyncio.sleep(0)
            self.now += 1

    async def sleep(self, ticks: float) -> None:
        end = self.now + max(1, round(ticks))
        while self.now < end:
            await asyncio.sleep(0)

    def seconds(self) -> float:
        return self.now * 1e-3


def _real_cost(rng: random.Random, worker: str, method: str) -> float:
    return rng.uniform(0.0005, 0.004)


@dataclass
class World:
    """What the fake actors share: versions, the log of calls, the untrained count."""

    rng: random.Random
    fail_on: tuple[str, str] | None = None
    """(worker, method) whose every call fails."""
    fail_at: int | None = None
    """The index (from 0, over every call of every actor) of the one call that fails."""
    kill_at: frozenset[int] = frozenset()
    """Indices of calls whose generator is lost as they run (while another generator lives)."""
    join_at: frozenset[int] = frozenset()
    """Indices of calls as which a new generator joins the world (``next_arrival``)."""
    generators: int = 0
    """Generators the run started with."""
    arrivals: asyncio.Queue = field(default_factory=asyncio.Queue)
    newcomers: list[str] = field(default_factory=list)
    """Generators that joined the world while the run ran, in order."""
    dead: dict[str, WorkerDied] = field(default_factory=dict)
    losses: asyncio.Queue = field(default_factory=asyncio.Queue)
    holders: dict[tuple[int, int], str] = field(default_factory=dict)
    """Who holds each micro-batch's rollout now."""
    trained: set[tuple[int, int]] = field(default_factory=set)
    forgotten: set[tuple[int, int]] = field(default_factory=set)
    """Micro-batches a live holder dropped to have them made again (a lost lane scored them)."""
    remade: int = 0
    """Generations of a micro-batch a lost generator had made (or was making)."""
    cost: Callable[[random.Random, str, str], float] = _real_cost
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    now: Callable[[], float] = lambda: asyncio.get_running_loop().time()
    log: list[tuple] = field(default_factory=list)
    calls: int = 0
    starts: list[tuple[float, str]] = field(default_factory=list)
    """(time, method) of every call as it started."""
    running: int = 0
    failed: str | None = None
    made: dict[tuple[int, int], int] = field(default_factory=dict)
    untrained_max: int = 0
    untrained: int = 0

    async def work(self, worker: str, method: str) -> tuple[float, float]:
        """One call's cost waited out, or the injected failure raised."""
        index, self.calls = self.calls, self.calls + 1
        self.starts.append((self.now(), method))
        self.running += 1
        if index in self.join_at:
            self.newcomers.append(
                worker_name(Pool.GENERATOR, self.generators + len(self.newcomers))
            )
            self.arrivals.put_nowait(Arrival(self.newcomers[-1], "fake", 0))
        try:
            if worker in self.dead:
                raise self.dead[worker].again()
            if index in self.kill_at and self._may_lose(worker):
                await self.sleep(self.cost(self.rng, worker, method) / 2)
                self.dead[worker] = WorkerDied(worker, None, -9)
                self.losses.put_nowait(self.dead[worker])
                raise self.dead[worker].again()
            if self.fail_on == (worker, method) or self.fail_at == index:
                await self.sleep(self.cost(self.rng, worker, method) / 2)
                self.failed = f"{method} on {worker} (call {index}) failed on purpose"
                raise InjectedFailure(self.failed)
            t0 = self.now()
            await self.sleep(self.cost(self.rng, worker, method))
            if worker in self.dead:  # lost while this call ran
                raise self.dead[worker].again()
            return t0, self.now()
        finally:
            self.running -= 1

    def _may_lose(self, worker: str) -> bool:
        """A newcomer, or a generator the run started with while another of those lives
        (so one is always left, whatever the newcomers do)."""
        if pool_of(worker) != Pool.GENERATOR or worker in self.dead:
            return False
        first = self.generators - sum(w not in self.newcomers for w in self.dead)
        return worker in self.newcomers or first > 1


class FakeActor:
    """Runs its calls one at a time, in the order they came, as a worker process does."""

    def __init__(self, world: World, worker: str) -> None:
        self.world, self.worker = world, worker
        self.version = 0
        self.busy = asyncio.Lock()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        async with self.busy:
            return await self._run(method, *args)

    async def _run(self, method: str, *args: Any) -> Any:
        w = self.world
        request = args[0] if args else None
        t0, t1 = await w.work(self.worker, method)
        if method == "update" and request.holder in w.dead:  # its store went with it
            raise RuntimeError("ECONNRESET: connection reset by peer (fetching the rollout)")
        if method == "step":
            w.log.append((self.worker, method, request.microbatches, request.last))
        else:
            w.log.append((self.worker, method, request.step, request.mb))
        if method == "generate":
            step, mb = request.step, request.mb
            if (step, mb) in w.made:  # made again: only what a lost generator held
                again = w.holders[step, mb] in w.dead or (step, mb) in w.forgotten
                assert again, f"micro-batch {(step, mb)} generated twice"
                w.forgotten.discard((step, mb))
                w.remade += 1
            else:
                w.untrained += 1
                w.untrained_max = max(w.untrained_max, w.untrained)
            w.made[(step, mb)] = self.version
            w.holders[step, mb] = self.worker
            return TimedResult(self.version, t0, t1)
        if method == "score":
            n = len(request.prompts)
            return TimedResult(
                Scores([float(request.mb + i) for i in range(n)], {"fake": [1.0] * n}), t0, t1
            )
        if method == "update":
            step, mb, holder = request.step, request.mb, request.holder
            assert self.version == step, f"step {step} trained on version {self.version}"
            assert w.holders[step, mb] == holder, (step, mb, holder, w.holders[step, mb])
            made_by = request.made_by
            assert w.made[step, mb] == made_by, "trained against another version than made it"
            assert (step, mb) not in w.trained, f"micro-batch {(step, mb)} trained twice"
            w.trained.add((step, mb))
            w.untrained -= 1
            return TimedResult(LossStats(terms=len(request.keys), loss=1.0), t0, t1)
        if method == "step":
            self.version += request.last  # the train step's last optimizer step bumps the version
            return TimedResult((self.version, 0.5), t0, t1)
        raise AssertionError(method)


class FakeCluster:
    """The methods of :class:`~digen.runtime.driver.cluster.Cluster` the driver uses."""

    def __init__(self, generators: int, trainers: int, world: World) -> None:
        self.world = world
        self.gens = [
            GeneratorHandle(FakeActor(world, worker_name(Pool.GENERATOR, i)))
            for i in range(generators)
        ]
        self.trainers = [
            TrainerHandle(FakeActor(world, worker_name(Pool.TRAINER, j))) for j in range(trainers)
        ]
        # scoring actors: in their generator's process (its name), with their own queue
        self.scorers = [ScorerHandle(FakeActor(world, gen.worker)) for gen in self.gens]
        self.payload = Payload()
        self.released: list[tuple[str, list]] = []
        self.lost_worker: Exception | None = None
        """What :meth:`lost_behind` finds: a worker lost behind a failed call, if a test says."""
        world.generators = generators

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def next_loss(self) -> WorkerDied:
        """Generators lost at the calls ``World.kill_at`` names, in turn."""
        return await self.world.losses.get()

    async def next_arrival(self) -> Arrival:
        """Generators that join at the calls ``World.join_at`` names, in turn."""
        return await self.world.arrivals.get()

    async def add_generator(self, name: str) -> int:
        self.gens.append(GeneratorHandle(FakeActor(self.world, name)))
        self.scorers.append(ScorerHandle(FakeActor(self.world, name)))
        return len(self.gens) - 1

    def can_respawn(self, i: int) -> bool:
        return False

    def pid_of(self, worker: str) -> int | None:
        return None

    async def death_of(self, worker: str) -> WorkerDied | None:
        return self.world.dead.get(worker)

    async def lost_behind(self, error: BaseException, skip: Any = ()) -> Exception | None:
        return self.lost_worker

    def serve_weights(self, version: int) -> None:
        return None

    async def send_weights(self, i: int, version: int) -> TimedResult:
        gen = self.gens[i].actor
        if gen.worker in self.world.dead:
            raise self.world.dead[gen.worker].again()
        async with gen.busy:  # behind what the generator is running
            t0, t1 = await self.world.work(gen.worker, "load_weights")
            self.world.log.append((gen.worker, "load_weights", version))
            gen.version = version
        return TimedResult(version, t0, t1)

    async def forget(self, holder: str, keys: list) -> None:
        self.world.log.append((holder, "forget", *keys[0]))
        self.world.forgotten.update(keys)

    async def release(self, holder: str, keys: list) -> None:
        self.world.log.append((holder, "release", *keys[0]))
        self.world.untrained -= len(keys)
        self.released.append((holder, keys))
