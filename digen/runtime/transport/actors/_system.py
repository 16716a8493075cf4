"""The driver's view: the :class:`ActorSystem` that owns the RPC world, handles, errors.

The driver is rank 0 and runs an asyncio loop; the watchdog turns dead workers into
:class:`WorkerDied`, and every call's payload is counted (:class:`Payload`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.util  # its atexit join must be registered before ours
import os
import pickle
import re
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.rpc as rpc

from digen.runtime.transport.actors import _remote
from digen.runtime.transport.actors._join import JoinDesk
from digen.runtime.transport.actors._remote import (
    _PROBE_TIMEOUT_S,
    DRIVER,
    _construct,
    _invoke,
    _ping,
    _request_exit,
    _run_function,
    _skip,
    _unwrap,
)
from digen.runtime.transport.actors._spec import ExternalLaunch, WorkerSpec
from digen.runtime.transport.actors._transport import (
    _LISTEN_FDS,
    _RANKS_KEY,
    _assign_wire,
    _backend_options,
    _bridge,
    _forget_earlier_worlds,
    _joined,
    _membership_token,
    _quiet_rpc_init_warning,
    _release_token_of,
    _rendezvous_url,
    _set_dynamic,
    _world_store,
    payload_bytes,
    wire,
    wire_name,
)
from digen.runtime.transport.actors._worker import _has_joined, _worker_main
from digen.runtime.transport.forkserver import patched_env
from digen.runtime.transport.join_secret import check_secret
from digen.runtime.transport.sockets import interface_env, listening_socket

_WATCHDOG_PERIOD_S = 0.1
_DEATH_GRACE_S = 0.5
"""How long a failed RPC waits for its worker's exit status before calling it a live error."""
_EXIT_RPC_TIMEOUT_S = 2.0
_SHUTDOWN_TIMEOUT_S = 10.0
_REAP_TIMEOUT_S = 10.0
"""How long a lost worker's process may take to exit after SIGKILL before it counts as stuck."""
_REMOTE_MARK = re.compile(r"^On WorkerInfo\(|^Error on Node |\n\nAt:\n")
"""Torch's wording for failures it caught in Python code (remote or local), as opposed to
the transport's ("EOF: end of file (this error originated at tensorpipe/...)")."""
_TRANSPORT_WORDS = re.compile(
    r"tensorpipe|ECONNRESET|ECONNREFUSED|EPIPE|ENOTCONN|connection (reset|refused|closed)"
    r"|pipe (is )?closed|broken pipe",
    re.IGNORECASE,
)
"""A transport failure's wording, wherever it was raised: in the driver's own call, or in a
worker whose call to another worker failed (then it arrives as that worker's error)."""


_LAUNCH: ExternalLaunch | None = None
"""The launch an :class:`ActorSystem` built without one uses (see :func:`external_launch`)."""


@contextlib.contextmanager
def external_launch(launch: ExternalLaunch) -> Iterator[None]:
    """Make every :class:`ActorSystem` built in this block join ``launch`` instead of spawning.

    For code that builds its system out of reach (the runner's driver); code that builds
    one itself can pass ``launch=`` instead.
    """
    global _LAUNCH
    saved, _LAUNCH = _LAUNCH, launch
    try:
        yield
    finally:
        _LAUNCH = saved


def active_launch() -> ExternalLaunch | None:
    """The external launch an :class:`ActorSystem` built here now would join, if any."""
    return _LAUNCH


class WorkerDied(RuntimeError):
    """A worker process exited or was killed; the RPC world cannot take it back."""

    def __init__(
        self,
        worker: str,
        pid: int | None,
        exitcode: int | None,
        silent_s: float | None = None,
        why: str | None = None,
    ) -> None:
        self.worker, self.pid, self.exitcode, self.silent_s = worker, pid, exitcode, silent_s
        self.why = why
        where = "pid unknown: started by an external launcher" if pid is None else f"pid {pid}"
        how = _describe_exit(exitcode)
        if exitcode is None and silent_s is not None:
            how = f"stopped answering (no heartbeat for {silent_s:g} s: hung, or unreachable)"
        super().__init__(f"worker {worker!r} ({where}) {how}" + (f"; {why}." if why else "."))

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerDied, (self.worker, self.pid, self.exitcode, self.silent_s, self.why))

    def again(self, why: str | None = None) -> WorkerDied:
        """A fresh copy to raise (re-raising one instance keeps growing its traceback);
        ``why``: what the loss means for the run, said after its cause."""
        return WorkerDied(self.worker, self.pid, self.exitcode, self.silent_s, why or self.why)


@dataclass(frozen=True, slots=True)
class Arrival:
    """A worker that joined the running world by itself (:func:`join_world`)."""

    name: str
    host: str
    pid: int


class ActorSystemClosed(RuntimeError):
    """The actor system was stopped (or never started) when a call was made."""


def _is_transport_error(error: BaseException) -> bool:
    seen: set[int] = set()
    stack = [error]
    while stack:
        exc = stack.pop()
        if id(exc) in seen:
            continue
        seen.add(id(exc))
        if _TRANSPORT_WORDS.search(str(exc)):
            return True
        stack += [e for e in (exc.__cause__, exc.__context__) if e is not None]
    return False


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"died with exit code {exitcode}"


@dataclass(frozen=True, slots=True)
class Payload:
    """Bytes of call payload that crossed the driver process, as TensorPipe ships them.

    Counters since the system was built; subtract two readings for what happened between.
    Tensor bytes are the tensors' storages (see :func:`payload_bytes`), other bytes the
    pickled rest of each message: arguments sent, results received.
    """

    sent_tensor_bytes: int = 0
    sent_other_bytes: int = 0
    received_tensor_bytes: int = 0
    received_other_bytes: int = 0

    def __add__(self, other: Payload) -> Payload:
        return Payload(
            self.sent_tensor_bytes + other.sent_tensor_bytes,
            self.sent_other_bytes + other.sent_other_bytes,
            self.received_tensor_bytes + other.received_tensor_bytes,
            self.received_other_bytes + other.received_other_bytes,
        )

    def __sub__(self, other: Payload) -> Payload:
        return Payload(
            self.sent_tensor_bytes - other.sent_tensor_bytes,
            self.sent_other_bytes - other.sent_other_bytes,
            self.received_tensor_bytes - other.received_tensor_bytes,
            self.received_other_bytes - other.received_other_bytes,
        )

    @property
    def megabytes(self) -> float:
        """All four counters together, in MB (1e6 bytes)."""
        total = self.sent_tensor_bytes + self.sent_other_bytes
        return (total + self.received_tensor_bytes + self.received_other_bytes) / 1e6


def run_sync(worker: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run module-level ``fn(*args, **kwargs)`` in ``worker`` and wait for its result.

    Meant for actor methods that need another worker (e.g. pulling weights from
    ``trainer-0``); it blocks the calling thread, so the driver uses
    :meth:`ActorSystem.run` instead.
    """
    return _unwrap(rpc.rpc_sync(wire(worker), _run_function, args=(fn, args, kwargs)))


# --------------------------------------------------------------------------------------
# Handles
# --------------------------------------------------------------------------------------


class ActorHandle:
    """A reference to one actor object living in one worker; cheap to copy and to pickle."""

    __slots__ = ("_system", "actor_id", "cls_name", "worker")

    def __init__(
        self, worker: str, actor_id: int, cls_name: str, system: ActorSystem | None = None
    ) -> None:
        self.worker, self.actor_id, self.cls_name = worker, actor_id, cls_name
        self._system = system

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the address travels; the system (processes, watchdog) stays with the driver.
        return (_rebuild_handle, (self.worker, self.actor_id, self.cls_name))

    def __repr__(self) -> str:
        return f"ActorHandle({self.cls_name} #{self.actor_id} on {self.worker!r})"

    async def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Run ``obj.method(*args, **kwargs)`` in the worker and return its result.

        From the driver, calls to one actor start in the order they were made, one at a
        time. Raises the method's own exception (same type, remote traceback as a note),
        :class:`WorkerDied` when the worker is gone, :class:`ActorSystemClosed` after stop.
        """
        if self._system is not None:
            return await self._system._call(self, method, args, kwargs)
        payload = (self.actor_id, None, method, args, kwargs)
        return _unwrap(await _bridge(rpc.rpc_async(wire(self.worker), _invoke, args=payload)))

    def call_sync(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Blocking call, for actor methods that call an actor in another worker.

        Serialised with the actor's other calls, but not ordered against the driver's.
        """
        payload = (self.actor_id, None, method, args, kwargs)
        return _unwrap(rpc.rpc_sync(wire(self.worker), _invoke, args=payload))


def _rebuild_handle(worker: str, actor_id: int, cls_name: str) -> ActorHandle:
    # A handle coming back to the driver (e.g. returned by an actor) regains the watchdog.
    return ActorHandle(worker, actor_id, cls_name, ActorSystem._active)


def _without(members: str, gone: str) -> str:
    """A dynamic world's list of members (``name-rank,`` entries) without ``gone``'s entry."""
    kept = [entry for entry in members.split(",") if entry and entry.rsplit("-", 1)[0] != gone]
    return "".join(f"{entry}," for entry in kept)


def _unlist(gone: str) -> None:
    """Take ``gone``, the wire name of a lost worker's process (reaped, or out of reach), off
    the dynamic world's list of members in the agent's store, so that a process joining
    later does not greet it: a join greets every listed member, and a gone one would fail
    it. A process killed in the middle of its own join still holds the world's membership
    token; it is released on its behalf first.

    Only the list changes. Every agent keeps its tables of ``gone``: torch's leave path
    (``updateGroupMembership`` with ``isJoin=false``) erases them without the lock the
    agent's RPC threads take to read them, and wipes every reverse device map, so nothing
    here calls it. Nothing addresses ``gone`` again either: a process that takes the lost
    worker's place joins under a wire name of its own (:func:`wire_name`)."""
    agent = rpc.api._get_current_rpc_agent()
    _release_token_of(agent.store, gone)
    names = torch.distributed.PrefixStore("names", agent.store)  # the agent's list of members
    with _membership_token(agent.store, f"{DRIVER}-unlists-{gone}"):
        members = names.get("_ALL_WORKER_INFOS").decode()
        names.set("_ALL_WORKER_INFOS", _without(members, gone))


def _said_if_failed(retirement: asyncio.Task) -> None:
    """Log a lost worker that could not be ended or unlisted (a later join may then fail)."""
    if not retirement.cancelled() and retirement.exception() is not None:
        logging.getLogger("digen").warning(
            f"{retirement.exception()}; a process joining the world later may fail to join."
        )


def _kill(procs: Any) -> None:
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()


def _kill_at_exit() -> None:
    """A driver leaving without stop() must not wait forever for its non-daemonic workers."""
    system = ActorSystem._active
    if system is not None:
        _kill(system._procs.values())


# --------------------------------------------------------------------------------------
# The driver's view
# --------------------------------------------------------------------------------------


class ActorSystem:
    """Owns the RPC world: this process is rank 0 (``"driver"``), each spec a spawned process
    (local launch) or a process an external launcher started (``launch``, see
    :class:`ExternalLaunch`; inside :func:`external_launch` it is the default).

    One system per process at a time (RPC state is process-global); a stopped system may be
    followed by a new one. Use ``async with ActorSystem(specs) as system:``.

    ``address``/``port`` is where the rendezvous store listens (a free port when ``None``);
    on a loopback address every listener of the world stays on loopback. ``rpc_timeout_s``
    bounds each call, ``heartbeat_s`` how long a worker may go without answering the
    watchdog's ping (sent every ``heartbeat_s / 4``) before it counts as dead: a hung or
    unreachable worker is noticed within that time, an exited one within a tenth of a second
    (local launch) or ``heartbeat_s`` (external launch). ``start_timeout_s`` bounds
    the forming of the world, ``stop_timeout_s`` how long stop() waits for workers to exit
    before killing them. Actors live until their worker exits. With external launch the
    rendezvous is ``launch.address:launch.port`` (``address``/``port`` are ignored), nothing
    is spawned or killed, and :meth:`pids` is empty.

    Local workers are forked by a fork server (a clean process, started once per driver
    process, that has imported ``preload``: the first system's list counts), so the second
    and later systems of a process start their workers without importing torch and the
    models again; each worker still gets the driver's environment, working directory,
    ``sys.path``, stdout and stderr as they are when it starts. Where there is no fork
    server, workers are spawned.
    """

    _active: ActorSystem | None = None

    def __init__(
        self,
        workers: Sequence[WorkerSpec],
        *,
        address: str = "127.0.0.1",
        port: int | None = None,
        rpc_timeout_s: float = 600.0,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 5.0,
        launch: ExternalLaunch | None = None,
        heartbeat_s: float = 60.0,
        preload: Sequence[str] = (),
        elastic: bool = False,
        joiners: WorkerSpec | None = None,
        join_secret: str | None = None,
    ) -> None:
        names = [w.name for w in workers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"worker names must be unique; repeated: {dupes}.")
        self.workers = tuple(workers)
        self.launch = launch if launch is not None else _LAUNCH
        if self.launch is not None:
            if self.launch.world != len(self.workers) + 1:
                raise ValueError(
                    f"the launcher started {self.launch.world} processes but this system needs "
                    f"{len(self.workers) + 1}: the driver and {len(self.workers)} workers."
                )
            address, port = self.launch.address, self.launch.port
        self.address, self.port = address, port
        self.rpc_timeout_s = rpc_timeout_s
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.heartbeat_s = heartbeat_s
        self.preload = tuple(preload)
        if elastic and self.launch is not None:
            raise ValueError(
                "an elastic world (workers restarted or joining mid-run) is started by the "
                "driver itself, not by an external launcher."
            )
        if joiners is not None and not elastic:
            raise ValueError("only an elastic world takes workers that join it while it runs.")
        if joiners is not None and join_secret is None:
            raise ValueError(
                "a world that takes workers joining it needs a join secret (join_secret=): "
                "without one anyone who reaches its address could join it."
            )
        if join_secret is not None:
            check_secret(join_secret, "join_secret")
        offered = [joiners] if joiners is not None else []
        mapped = [w.name for w in [*workers, *offered] if w.device_maps]
        if elastic and mapped:
            raise ValueError(
                f"an elastic world stages tensors through the CPU, so its workers take no "
                f"device maps; {mapped} have some."
            )
        self.join_secret = join_secret
        """What a joining worker must prove it knows (:mod:`._join`)."""
        self.elastic = elastic
        """A dynamic RPC world (``init_rpc`` without a world size): a lost worker can be
        started again (:meth:`respawn`), a new process under a wire name of its own
        (:func:`wire_name`). Tensors travel through the CPU (no device maps)."""
        self.joiners = joiners
        """What a process joining the running world becomes (:func:`join_world`): this
        spec, named after it with the next free number (``generator`` -> ``generator-2``
        when ``generator-0`` and ``generator-1`` exist). None: no joins."""
        self._specs = {w.name: w for w in workers}
        self._retirements: dict[str, asyncio.Task] = {}
        self._incarnations: dict[str, int] = {}  # worker -> number of its latest process
        self._rejoining: set[str] = set()  # started again, not joined yet: no heartbeat
        self._arrivals: asyncio.Queue[Arrival] | None = None
        self._desk: JoinDesk | None = None
        self._url: str | None = None
        self._env: dict[str, str] = {}
        self._heartbeats: dict[str, asyncio.Task] = {}
        self._procs: dict[str, multiprocessing.process.BaseProcess] = {}
        self._pids: dict[str, int] = {}
        self._dead: dict[str, WorkerDied] = {}
        self._pending: dict[str, set[asyncio.Future]] = {w.name: set() for w in workers}
        self._ids = itertools.count(1)
        self._seq: dict[int, int] = {}  # actor id -> number of the driver's next call to it
        self._calls = 0
        self._state = "new"  # new -> starting -> running -> stopping -> stopped
        self._watchdog: asyncio.Task | None = None
        self._stopping: asyncio.Task | None = None
        self._probes: dict[str, asyncio.Task] = {}
        self._lost: asyncio.Future[WorkerDied] | None = None
        self._losses: asyncio.Queue[WorkerDied] | None = None
        self.startup_s: float | None = None
        self._payload = Payload()

    # ---- lifecycle ------------------------------------------------------------------

    async def __aenter__(self) -> ActorSystem:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        """Spawn every worker in parallel (local launch), join the RPC world, and start the
        watchdog; with external launch, wait for every named worker to join."""
        if self._state != "new":
            raise RuntimeError(f"an ActorSystem starts once; this one is {self._state}.")
        if ActorSystem._active is not None:
            raise RuntimeError("another ActorSystem is running in this process; stop it first.")
        ActorSystem._active = self
        self._state = "starting"
        t0 = time.perf_counter()
        try:
            await self._start()
        except BaseException:
            await self._teardown(handshake=False)
            raise
        self.startup_s = time.perf_counter() - t0
        self._state = "running"
        self._lost = asyncio.get_running_loop().create_future()
        self._losses = asyncio.Queue()
        if self.joiners is not None:
            self._open_to_joiners(self.joiners)
        if self._dead:  # lost between forming the world and now
            self._lost.set_result(next(iter(self._dead.values())))
            for name, died in self._dead.items():
                self._losses.put_nowait(died)
                if self.elastic:
                    self._retired(name)
        self._watchdog = asyncio.create_task(self._watch(), name="digen-actor-watchdog")

    async def lost(self) -> WorkerDied:
        """Wait for the first worker lost while running (exited, or silent past its
        heartbeat) and return its error: a caller with no call to that worker in flight
        learns of it within the watchdog's bound all the same."""
        if self._lost is None:
            raise RuntimeError(f"the actor system is {self._state}; it has no workers to watch.")
        return await asyncio.shield(self._lost)

    async def next_loss(self) -> WorkerDied:
        """Wait for the next worker lost while running, in the order they were found: a
        run that goes on without a lost worker learns of each one, once."""
        if self._losses is None:
            raise RuntimeError(f"the actor system is {self._state}; it has no workers to watch.")
        return await self._losses.get()

    def _open_to_joiners(self, template: WorkerSpec) -> None:
        """Offer joiners ``template`` through the join desk (:mod:`._join`: only a process
        that proves it knows the join secret gets a name, a rank and the offer) and take the
        ones that arrive with their proof (:meth:`next_arrival`)."""
        self._arrivals = asyncio.Queue()
        loop = asyncio.get_running_loop()
        prefix = template.name
        taken = [w.name for w in self.workers if w.name.rsplit("-", 1)[0] == prefix]
        offer = {
            "threads": template.threads,
            "rpc_threads": template.rpc_threads,
            "rpc_timeout_s": self.rpc_timeout_s,
            # the interfaces a joiner binds to are its own machine's: it finds them itself
            "env": template.env,
            "local_paths": sorted(k for k, v in template.env.items() if os.path.isabs(v)),
        }
        assert self.port is not None and self.join_secret is not None
        desk = JoinDesk(
            self.address,
            self.port,
            self.join_secret,
            pool=prefix,
            first_number=len(taken),
            offer=offer,
            hold_s=self.start_timeout_s,
        )
        self._desk = desk

        def arrived(name: str, host: str, pid: int) -> None:
            if self._state != "running" or name in self._specs:
                return
            spec = dataclasses.replace(template, name=name)
            _assign_wire(name, wire_name(name, 0))  # what the join desk gave it
            self.workers += (spec,)
            self._specs[name] = spec
            self._pending[name] = set()
            self._pids[name] = pid
            assert self._arrivals is not None
            self._arrivals.put_nowait(Arrival(name, host, pid))

        def on_arrival(name: str, host: str, pid: int, proof: str) -> str | None:  # RPC thread
            if self._state != "running":
                return f"the run is {self._state}"
            refused = desk.admit(name, proof)
            if refused is not None:
                return refused
            loop.call_soon_threadsafe(arrived, name, host, pid)
            return None

        _remote._ON_ARRIVAL = on_arrival
        desk.open()

    async def next_arrival(self) -> Arrival:
        """Wait for the next worker that joined the running world by itself, in the order
        they came; it is a worker of this system from then on (calls, watchdog, stop)."""
        if self._arrivals is None:
            raise RuntimeError("this actor system takes no joining workers (joiners=None).")
        return await self._arrivals.get()

    async def death_of(self, worker: str) -> WorkerDied | None:
        """Whether ``worker`` is lost, checked now (its exit status, or with external launch
        a probe): its error, or None while it lives. For a caller whose call through
        another worker failed in transit."""
        return await self._death_of(worker)

    async def _start(self) -> None:
        try:
            sock = listening_socket(self.address, self.port or 0)
        except OSError as exc:
            if self.launch is None:
                raise
            raise OSError(
                exc.errno,
                f"the driver cannot listen on {self.address}:{self.port} for the RPC "
                f"rendezvous ({exc.strerror}); it must be a free port on an address of the "
                "driver's own machine",
            ) from exc
        self.port = sock.getsockname()[1]
        _LISTEN_FDS[self.port] = sock.detach()
        url = _rendezvous_url(self.address, self.port, self.start_timeout_s)
        world = None if self.elastic else len(self.workers) + 1
        self._url = url
        _set_dynamic(self.elastic)

        # Every listener binds to the interface of the run's address, not the host name's.
        env = interface_env(self.address)
        self._env = env
        if self.launch is None:
            self._spawn(env, url, world)

        _forget_earlier_worlds()
        _quiet_rpc_init_warning()
        # The driver's TensorPipe listener reads the interface name from the environment.
        done = threading.Event()
        failure: list[BaseException] = []

        def join_world() -> None:
            try:
                with patched_env(env):
                    rpc.init_rpc(
                        DRIVER,
                        rank=0,
                        world_size=world,  # None: a dynamic world
                        rpc_backend_options=_backend_options(url, self.rpc_timeout_s, 16),
                    )
            except BaseException as exc:
                failure.append(exc)
            finally:
                done.set()

        # A daemon thread, not an executor: if a worker dies mid-start the join blocks until
        # a store timeout, and that must not hold up interpreter exit.
        threading.Thread(target=join_world, name="digen-rpc-init", daemon=True).start()
        deadline = time.monotonic() + self.start_timeout_s
        while not done.is_set():
            self._reap()
            if self._dead:
                raise next(iter(self._dead.values())).again()
            if time.monotonic() > deadline:
                who = "workers" if self.launch is None else "workers started by the launcher"
                raise TimeoutError(
                    f"the RPC world did not form within {self.start_timeout_s:g} s "
                    f"({len(self.workers)} {who} at {url})."
                )
            await asyncio.sleep(0.05)
        if failure:
            raise failure[0]
        if self.elastic:  # the driver's join returns at once: wait for every worker's
            await self._joined_all([w.name for w in self.workers], deadline, url)
            _world_store().add(_RANKS_KEY, len(self.workers))  # ranks 1..n are taken
        if self.launch is not None:
            # The world is complete once init_rpc returns; check that it is the one we want.
            missing = [w.name for w in self.workers if not _joined(w.name)]
            if missing:
                self._state = "running"  # joined: stop() must still release the others
                raise RuntimeError(
                    f"workers {missing} are not in the RPC world at {url}: every rank must "
                    "run the same config, so that the ranks map to the same worker names."
                )

    async def _joined_all(self, names: Sequence[str], deadline: float, url: str) -> None:
        """A dynamic world: wait until every one of ``names`` joined, its join complete (every
        member knows it: :func:`_has_joined`)."""
        while not all([_joined(name) and await self._join_complete(name) for name in names]):
            self._reap()
            lost = [self._dead[n] for n in names if n in self._dead]
            if lost:
                raise lost[0].again()
            if time.monotonic() > deadline:
                missing = [n for n in names if not _joined(n)]
                raise TimeoutError(
                    f"workers {missing} did not join the RPC world at {url} within "
                    f"{self.start_timeout_s:g} s."
                )
            await asyncio.sleep(0.05)

    @staticmethod
    async def _join_complete(name: str) -> bool:
        try:
            return bool(await _bridge(rpc.rpc_async(wire(name), _has_joined, timeout=10)))
        except Exception:  # noqa: BLE001 (not reachable yet: asked again)
            return False

    async def respawn(self, worker: str) -> None:
        """Start lost ``worker`` again (elastic world only). Its old process is ended first
        (killed if it still runs, hung) and reaped, and only then taken off the world's list
        of members; a new process joins under the same worker name with a wire name and a
        rank of its own. Returns once it has joined; its actors are gone with the old
        process. Raises RuntimeError when the old process cannot be ended or unlisted (a
        later call tries again)."""
        if not self.elastic:
            raise RuntimeError("only an elastic ActorSystem can start a worker again.")
        if worker not in self._dead:
            raise RuntimeError(f"worker {worker!r} is not lost; only a lost worker restarts.")
        if worker not in self._procs:
            raise RuntimeError(f"worker {worker!r} was not started here; it cannot restart here.")
        beat = self._heartbeats.pop(worker, None)
        if beat is not None:
            beat.cancel()
        await self._retired(worker)
        old = self._procs.pop(worker)
        with contextlib.suppress(ValueError):
            old.close()
        del self._dead[worker]
        self._retirements.pop(worker, None)
        self._pending[worker] = set()
        assert self._url is not None
        rank = _world_store().add(_RANKS_KEY, 1)
        self._rejoining.add(worker)
        try:
            self._spawn_one(self._specs[worker], rank, None, self._url)
            await self._joined_all([worker], time.monotonic() + self.start_timeout_s, self._url)
        finally:
            self._rejoining.discard(worker)

    def _retired(self, worker: str) -> asyncio.Task:
        """Lost ``worker``'s process ended and off the world's list of members, once per loss
        (again after a failure): killed if it still runs, reaped, and only then unlisted
        (:func:`_unlist`); a worker started elsewhere has no process here to end."""
        task = self._retirements.get(worker)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):
            task = asyncio.ensure_future(self._retire(worker, wire(worker)))
            task.add_done_callback(_said_if_failed)
            self._retirements[worker] = task
        return task

    async def _retire(self, worker: str, gone: str) -> None:
        proc = self._procs.get(worker)
        if proc is not None:
            if proc.exitcode is None:  # hung (lost to its heartbeat), or still on its way out
                proc.kill()
            await asyncio.to_thread(proc.join, _REAP_TIMEOUT_S)
            if proc.exitcode is None:
                raise RuntimeError(
                    f"worker {worker!r} (pid {proc.pid}) did not exit within "
                    f"{_REAP_TIMEOUT_S:g} s of SIGKILL, so it stays on the RPC world's list"
                )
        try:
            await self._in_thread(lambda: _unlist(gone), self.start_timeout_s, f"unlist-{worker}")
        except Exception as exc:
            raise RuntimeError(
                f"lost worker {worker!r} could not be taken off the RPC world's list "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    def _spawn(self, env: dict[str, str], url: str, world: int | None) -> None:
        for rank, spec in enumerate(self.workers, start=1):
            self._spawn_one(spec, rank, world, url)

    def _spawn_one(self, spec: WorkerSpec, rank: int, world: int | None, url: str) -> None:
        from digen.runtime.transport import forkserver

        wire_as = spec.name
        if self.elastic:  # each process of a worker under a name of its own
            number = self._incarnations[spec.name] = self._incarnations.get(spec.name, -1) + 1
            wire_as = wire_name(spec.name, number)
            _assign_wire(spec.name, wire_as)
        env = self._env
        child_env = {**os.environ, **env, "OMP_NUM_THREADS": str(spec.threads), **spec.env}
        proc = forkserver.process(
            _worker_main,
            (spec, rank, world, url, self.rpc_timeout_s, wire_as),
            env=child_env,
            name=f"digen-{spec.name}",
            # Not daemonic: daemonic processes may not start children (DataLoader
            # workers, compile pools). Exit paths are covered by stop(), the atexit
            # hook below, and each worker's watch on its parent.
            daemon=False,
            preload=self.preload,
        )
        forkserver.start(proc)  # returns once the child exists; its start runs in parallel
        self._procs[spec.name] = proc
        self._pids[spec.name] = proc.pid

    async def stop(self) -> None:
        """Ask live workers to exit, shut RPC down locally, then kill whatever is left.

        Idempotent, and bounded in time even when workers are dead or stuck.
        """
        if self._state in ("new", "stopped"):
            self._state = "stopped"
            return
        if self._stopping is None:
            self._stopping = asyncio.create_task(self._teardown(handshake=True))
        await asyncio.shield(self._stopping)

    async def _teardown(self, *, handshake: bool) -> None:
        was_running = self._state == "running"
        self._state = "stopping"
        _remote._ON_ARRIVAL = None
        if self._desk is not None:
            self._desk.close()
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        self._reap()
        for task in [*self._probes.values(), *self._heartbeats.values()]:
            task.cancel()
        for task in self._retirements.values():
            task.cancel()
        for futs in self._pending.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(ActorSystemClosed("the actor system stopped mid-call."))
        if handshake and was_running:
            live = [w.name for w in self.workers if w.name not in self._dead]
            asks = [
                _bridge(rpc.rpc_async(wire(n), _request_exit, timeout=_EXIT_RPC_TIMEOUT_S))
                for n in live
            ]
            # Answers only tell us the message was delivered; a stuck worker is killed below.
            await asyncio.gather(*asks, return_exceptions=True)
        if was_running:
            with contextlib.suppress(Exception):  # a stop goes on to kill what is left
                await self._in_thread(
                    lambda: rpc.shutdown(graceful=False), _SHUTDOWN_TIMEOUT_S, "rpc-shutdown"
                )
        deadline = time.monotonic() + self.stop_timeout_s
        while any(p.exitcode is None for p in self._procs.values()):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        _kill(self._procs.values())
        deadline = time.monotonic() + 2.0
        while any(p.exitcode is None for p in self._procs.values()):
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.02)
        for proc in self._procs.values():
            with contextlib.suppress(ValueError):
                proc.close()
        self._procs.clear()
        if self.port is not None:  # a start that failed before the store took the socket
            fd = _LISTEN_FDS.pop(self.port, None)
            if fd is not None:
                os.close(fd)
        self._state = "stopped"
        _set_dynamic(False)
        if ActorSystem._active is self:
            ActorSystem._active = None

    @staticmethod
    async def _in_thread(fn: Callable[[], None], timeout_s: float, name: str) -> None:
        """Run ``fn`` on a daemon thread and wait for it: its exception is raised here, and
        TimeoutError after ``timeout_s`` (it runs on, unwatched)."""
        loop = asyncio.get_running_loop()
        out: asyncio.Future[None] = loop.create_future()
        out.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, if too late

        def settle(error: BaseException | None) -> None:
            if out.done():
                return
            if error is None:
                out.set_result(None)
            else:
                out.set_exception(error)

        def run() -> None:
            error = None
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 (handed to the waiting loop)
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop may be closed by now
                loop.call_soon_threadsafe(settle, error)

        threading.Thread(target=run, name=f"digen-{name}", daemon=True).start()
        await asyncio.wait_for(asyncio.shield(out), timeout_s)

    # ---- watchdog -------------------------------------------------------------------

    def _reap(self) -> list[str]:
        """Record workers whose process has exited; return the newly dead ones."""
        newly = []
        for name, proc in self._procs.items():
            if name not in self._dead and proc.exitcode is not None:
                self._record(name, WorkerDied(name, proc.pid, proc.exitcode))
                newly.append(name)
        return newly

    def _record(self, worker: str, died: WorkerDied) -> None:
        first = self._dead.get(worker) is not died  # _reap records it, _mark_dead again
        self._dead[worker] = died
        if self._state == "running" and self._lost is not None and not self._lost.done():
            self._lost.set_result(died)
        if first and self._state == "running" and self._losses is not None:
            self._losses.put_nowait(died)
            if self.elastic:
                self._retired(worker)

    async def _watch(self) -> None:
        next_beat = time.monotonic()
        while True:
            for name in self._reap():
                self._mark_dead(name, self._dead[name])
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + self.heartbeat_s / 4
                for w in self.workers:
                    beat = self._heartbeats.get(w.name)
                    if w.name in self._dead or w.name in self._rejoining:
                        continue
                    if beat is None or beat.done():
                        self._heartbeats[w.name] = asyncio.create_task(
                            self._heartbeat(w.name), name=f"digen-heartbeat-{w.name}"
                        )
            await asyncio.sleep(_WATCHDOG_PERIOD_S)

    async def _heartbeat(self, worker: str) -> None:
        """One ping; no answer within ``heartbeat_s`` marks the worker dead (hung, or gone
        with no exit status to read)."""
        try:
            await _bridge(rpc.rpc_async(wire(worker), _ping, timeout=self.heartbeat_s))
        except Exception:
            await asyncio.sleep(2 * _WATCHDOG_PERIOD_S)  # an exit status explains it better
            self._reap()
            if self._state == "running" and worker not in self._dead:
                self._mark_dead(
                    worker, WorkerDied(worker, self._pids.get(worker), None, self.heartbeat_s)
                )

    def _mark_dead(self, worker: str, died: WorkerDied) -> None:
        self._record(worker, died)
        for fut in self._pending[worker]:
            if not fut.done():
                fut.set_exception(died.again())

    async def lost_behind(
        self, error: BaseException, skip: Collection[str] = ()
    ) -> WorkerDied | None:
        """The lost worker that explains ``error``, if there is one, else None; workers in
        ``skip`` (losses a run already went on without) explain nothing.

        A worker killed while another worker is calling it (a trainer fetching from a
        generator's store, a generator pulling weights) first shows up as that other worker's
        transport error, naming nobody; the watchdog may not have seen the loss yet. So a
        transport error, wherever raised, gets every worker checked as :meth:`_death_of`
        checks one (exit status, or with external launch a probe), and the first worker
        found lost is the answer. Other errors are only explained by a loss already seen.
        """
        news = [died for name, died in self._dead.items() if name not in skip]
        if not news and self._state == "running" and _is_transport_error(error):
            live = [w.name for w in self.workers if w.name not in self._dead]
            await asyncio.gather(*(self._death_of(name) for name in live))
            news = [died for name, died in self._dead.items() if name not in skip]
        return news[0] if news else None

    async def _death_of(self, worker: str) -> WorkerDied | None:
        """A transport error just arrived: wait briefly for the exit status that explains it,
        or, with external launch (no process to poll), probe the worker."""
        if self.launch is not None or worker not in self._procs:  # none to poll: ask it
            if worker not in self._dead:
                probe = self._probes.get(worker)
                if probe is None:
                    probe = asyncio.create_task(self._probe(worker), name=f"digen-probe-{worker}")
                    self._probes[worker] = probe
                await asyncio.wait({probe})  # shared by every call that failed meanwhile
            return self._dead.get(worker)
        proc = self._procs.get(worker)
        deadline = time.monotonic() + _DEATH_GRACE_S
        while proc is not None and time.monotonic() < deadline:
            self._reap()
            if worker in self._dead:
                break
            await asyncio.sleep(0.02)
        return self._dead.get(worker)

    async def _probe(self, worker: str) -> None:
        """External launch: a worker that cannot answer a ping after a transport error is dead."""
        try:
            await _bridge(rpc.rpc_async(wire(worker), _ping, timeout=_PROBE_TIMEOUT_S))
        except Exception:
            if self._state == "running" and worker not in self._dead:
                self._mark_dead(worker, WorkerDied(worker, None, None))
        finally:
            self._probes.pop(worker, None)

    # ---- calls ----------------------------------------------------------------------

    def _check(self, worker: str) -> None:
        if self._state != "running":
            raise ActorSystemClosed(f"the actor system is {self._state}; cannot reach {worker!r}.")
        if worker in self._dead:
            raise self._dead[worker].again()
        if worker not in self._pending:
            raise KeyError(f"no worker named {worker!r}; workers: {sorted(self._pending)}.")

    def _post(self, worker: str, fn: Callable[..., Any], payload: tuple) -> torch.futures.Future:
        self._check(worker)
        self._calls += 1
        fut = rpc.rpc_async(wire(worker), fn, args=payload)
        self._count_sent(payload)  # once on its way, so that accounting never delays it
        return fut

    async def _call(self, handle: ActorHandle, method: str, args: tuple, kwargs: dict) -> Any:
        worker, actor_id = handle.worker, handle.actor_id
        seq = self._seq.get(actor_id, 0)
        torch_fut = self._post(worker, _invoke, (actor_id, seq, method, args, kwargs))
        self._seq[actor_id] = seq + 1  # only once sent: a call that failed to pickle has no turn
        try:
            value = await self._await(worker, torch_fut)
        except (WorkerDied, ActorSystemClosed):
            raise
        except Exception:
            # Failed in transit (e.g. an argument the worker cannot unpickle), so it may
            # never take its turn: let the calls behind it go. Ignored if it did start.
            with contextlib.suppress(Exception):
                rpc.rpc_async(wire(worker), _skip, args=(actor_id, seq))
            raise
        return _unwrap(value)

    async def _await(self, worker: str, torch_fut: torch.futures.Future) -> Any:
        """The raw result of an RPC to ``worker``; death and stop become digen errors."""
        self._check(worker)
        fut = _bridge(torch_fut)
        pending = self._pending[worker]
        pending.add(fut)
        try:
            value = await fut
        except (WorkerDied, ActorSystemClosed):
            raise
        except Exception as exc:
            # Failures torch caught in Python code (an argument the worker cannot import, a
            # result that cannot be pickled) are the caller's to see; a transport error
            # usually means the worker just died, and its exit status follows within ms.
            if not _REMOTE_MARK.search(str(exc)):
                died = await self._death_of(worker)
                if died is not None:
                    raise died.again() from exc
            raise
        finally:
            pending.discard(fut)
        self._count_received(value)
        return value

    def actor(self, worker: str, cls: type | str, /, *args: Any, **kwargs: Any) -> ActorHandle:
        """Construct ``cls(*args, **kwargs)`` inside ``worker``; return a handle at once.

        The object is built in the background on the actor's own thread, which then runs
        all its calls; a constructor error (or a class the worker cannot import) is raised
        by every call. ``cls`` and the arguments are pickled here; ``cls`` given as
        ``"package.module:Class"`` is imported by the worker only (this process need not
        import what the actor's module imports).
        """
        blob = pickle.dumps((cls, args, kwargs))
        actor_id = next(self._ids)
        self._post(worker, _construct, (actor_id, blob))
        name = (
            cls.rpartition(":")[2]
            if isinstance(cls, str)
            else getattr(cls, "__qualname__", repr(cls))
        )
        return ActorHandle(worker, actor_id, name, self)

    async def run(self, worker: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run module-level ``fn(*args, **kwargs)`` in ``worker`` (no actor, no lock)."""
        fut = self._post(worker, _run_function, (fn, args, kwargs))
        return _unwrap(await self._await(worker, fut))

    # ---- payload accounting ---------------------------------------------------------

    def _count_sent(self, message: tuple) -> None:
        tensor_bytes, other_bytes = payload_bytes(message)
        self._payload += Payload(sent_tensor_bytes=tensor_bytes, sent_other_bytes=other_bytes)

    def _count_received(self, value: Any) -> None:
        tensor_bytes, other_bytes = payload_bytes(value)
        self._payload += Payload(
            received_tensor_bytes=tensor_bytes, received_other_bytes=other_bytes
        )

    @property
    def payload(self) -> Payload:
        """Bytes of payload this system's calls moved through the driver since it was built:
        every construction, method call and :meth:`run` sent, every result received."""
        return self._payload

    # ---- introspection --------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        """Process id of every worker, by name (also after it died or was stopped)."""
        return dict(self._pids)

    def dead(self) -> dict[str, WorkerDied]:
        """Workers whose process has exited, with the error their calls raise."""
        return dict(self._dead)

    def statistics(self) -> dict[str, Any]:
        """Counters for logs and tests: state, calls sent, calls in flight, dead workers,
        payload moved."""
        return {
            "state": self._state,
            "workers": len(self.workers),
            "calls": self._calls,
            "pending": {name: len(futs) for name, futs in self._pending.items()},
            "dead": sorted(self._dead),
            "startup_s": self.startup_s,
            "payload": self._payload,
        }


atexit.register(_kill_at_exit)  # runs before multiprocessing's join of non-daemonic children
