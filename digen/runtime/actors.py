"""A small actor layer: named worker processes holding objects the driver calls by method name.

The rest of digen sees only :class:`ActorSystem`, :class:`ActorHandle`, :class:`WorkerSpec`
and the errors here; the transport underneath is ``torch.distributed.rpc`` (TensorPipe) and
could be swapped without touching callers. The driver process is rank 0 (``"driver"``) and
runs an asyncio loop; each :class:`WorkerSpec` becomes one spawned process, or, under an
external launcher such as ``torchrun`` (:class:`ExternalLaunch`), one process that someone
else started and that calls :func:`serve_worker`.

What this layer guarantees, so actor classes need not care:

- one method call at a time per actor, on that actor's own thread, and the driver's calls
  to an actor start in the order they were made (RPC serves requests on a thread pool, so
  calls sent in order would otherwise run concurrently and in any order);
- an exception raised by an actor method reaches the caller as the same object type, with
  the remote traceback attached as a note;
- a dead worker turns every pending and later call to it into :class:`WorkerDied` within
  about a second, and :meth:`ActorSystem.stop` never hangs (RPC's graceful shutdown is a
  barrier that waits forever for a dead peer, so it is not used); with external launch the
  driver has no process to poll, so a transport error followed by an unanswered probe is
  what marks a worker dead, and a worker whose driver stops answering exits by itself;
- only the loopback interface listens when the address is a loopback one.

Worker-to-worker calls: an :class:`ActorHandle` pickles to a plain ``(worker, id)`` pair, so
the driver can pass it to an actor, whose method then uses :meth:`ActorHandle.call_sync`;
:func:`run_sync` runs a module-level function in another worker. A chain of synchronous
calls must not lead back to an actor already in it: that actor's thread is the one
waiting, so it would deadlock.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import ipaddress
import itertools
import multiprocessing
import multiprocessing.util  # its atexit join must be registered before ours
import os
import pickle
import re
import signal
import socket
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

__all__ = [
    "ActorHandle",
    "ActorSystem",
    "ActorSystemClosed",
    "ExternalLaunch",
    "WorkerDied",
    "WorkerSpec",
    "external_launch",
    "run_sync",
    "serve_worker",
]

DRIVER = "driver"
_SCHEME = "digen-tcp"
_NAME_RE = re.compile(r"[A-Za-z0-9_:\-]{1,127}")
_WATCHDOG_PERIOD_S = 0.1
_DEATH_GRACE_S = 0.5
"""How long a failed RPC waits for its worker's exit status before calling it a live error."""
_EXIT_RPC_TIMEOUT_S = 2.0
_SHUTDOWN_TIMEOUT_S = 10.0
_EXIT_FLUSH_S = 0.1
_PROBE_TIMEOUT_S = 5.0
"""External launch: how long a liveness probe (driver -> worker, worker -> driver) may take."""
_DRIVER_PING_PERIOD_S = 1.0
_DRIVER_MISSES = 3
"""External launch: a worker exits after this many failed pings of the driver in a row."""
_REMOTE_MARK = re.compile(r"^On WorkerInfo\(|^Error on Node |\n\nAt:\n")
"""Torch's wording for failures it caught in Python code (remote or local), as opposed to
the transport's ("EOF: end of file (this error originated at tensorpipe/...)")."""


def _quiet_rpc_init_warning() -> None:
    # init_rpc itself trips a torch deprecation warning (it gathers over a bare gloo
    # backend); it says nothing a digen user can act on.
    warnings.filterwarnings(
        "ignore", message=r"You are using a Backend .* as a ProcessGroup", category=UserWarning
    )


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process of an :class:`ActorSystem`."""

    name: str
    """RPC name, unique in the system, e.g. ``"generator-0"``; ``"driver"`` is taken."""
    threads: int = 1
    """``torch.set_num_threads`` (and ``OMP_NUM_THREADS``) in that process."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables, set before the process imports anything."""
    rpc_threads: int = 16
    """RPC server threads: they queue actor calls (each actor runs on its own thread) and
    run module-level functions sent with ``run``."""

    def __post_init__(self) -> None:
        if not _NAME_RE.fullmatch(self.name) or self.name == DRIVER:
            raise ValueError(
                f"worker name {self.name!r} is not allowed: use 1-127 letters, digits, '_', "
                f"':' or '-', and not {DRIVER!r}."
            )
        if self.threads < 1:
            raise ValueError(f"worker {self.name!r}: threads={self.threads} must be >= 1.")
        if self.rpc_threads < 2:
            raise ValueError(f"worker {self.name!r}: rpc_threads={self.rpc_threads} must be >= 2.")
        bad = [k for k, v in self.env.items() if not (isinstance(k, str) and isinstance(v, str))]
        if bad:
            raise ValueError(f"worker {self.name!r}: env entries must be str -> str, got {bad}.")


@dataclass(frozen=True)
class ExternalLaunch:
    """Workers started by someone else (e.g. ``torchrun``): where and how big their world is.

    The driver is rank 0 and serves the rendezvous store at ``address:port``; it must be an
    address of the driver's own machine that every worker's machine can reach (loopback
    keeps a one-machine world on loopback). Workers join with :func:`serve_worker`.
    """

    address: str
    port: int
    world: int
    """Processes in the world, the driver included."""

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("external launch: the rendezvous address is empty.")
        if not 0 < self.port < 65536:
            raise ValueError(f"external launch: port {self.port} is outside 1..65535.")
        if self.world < 1:
            raise ValueError(f"external launch: world size {self.world} must be >= 1.")


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


class WorkerDied(RuntimeError):
    """A worker process exited or was killed; the RPC world cannot take it back."""

    def __init__(self, worker: str, pid: int | None, exitcode: int | None) -> None:
        self.worker, self.pid, self.exitcode = worker, pid, exitcode
        where = "pid unknown: started by an external launcher" if pid is None else f"pid {pid}"
        super().__init__(f"worker {worker!r} ({where}) {_describe_exit(exitcode)}.")

    def __reduce__(self) -> tuple[Any, ...]:
        return (WorkerDied, (self.worker, self.pid, self.exitcode))

    def again(self) -> WorkerDied:
        """A fresh copy to raise (re-raising one instance keeps growing its traceback)."""
        return WorkerDied(self.worker, self.pid, self.exitcode)


class ActorSystemClosed(RuntimeError):
    """The actor system was stopped (or never started) when a call was made."""


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "stopped answering"
    if exitcode < 0:
        try:
            return f"was killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"died with exit code {exitcode}"


# --------------------------------------------------------------------------------------
# Remote side: runs in every process of the world (workers and driver alike).
# --------------------------------------------------------------------------------------


@dataclass(slots=True)
class _RemoteError:
    """An exception shipped back as a normal return value, so that transport failures
    (which arrive as exceptions of the torch future) are never confused with it."""

    error: BaseException
    worker: str
    traceback: str

    @classmethod
    def capture(cls, exc: BaseException) -> _RemoteError:
        text = "".join(traceback.format_exception(exc))
        try:
            pickle.loads(pickle.dumps(exc))
            error = exc
        except Exception:  # an exception that cannot travel still has to be reported
            error = RuntimeError(f"{type(exc).__name__}: {exc}")
        error.__traceback__ = None
        return cls(error, _WORKER_NAME, text)

    def rebuild(self) -> BaseException:
        self.error.add_note(f"Raised in worker {self.worker!r}:\n{self.traceback.rstrip()}")
        return self.error


class _Mailbox:
    """One actor living in this process, with its own thread.

    The thread builds the object, then runs its calls one at a time: the driver's in the
    order it made them (it numbers them, ``seq``), calls from other workers as they come.
    RPC threads only drop calls in here, so a busy actor never ties up the threads that
    serve other actors, stop requests, or other workers.
    """

    def __init__(self, actor_id: int) -> None:
        self.cv = threading.Condition()
        self.blob: bytes | None = None  # the pickled (cls, args, kwargs)
        self.ordered: dict[int, _Call] = {}
        self.unordered: collections.deque[_Call] = collections.deque()
        self.next_seq = 0
        self.skipped: set[int] = set()
        self.obj: Any = None
        self.error: _RemoteError | None = None
        threading.Thread(target=self._run, name=f"digen-actor-{actor_id}", daemon=True).start()

    def build(self, blob: bytes) -> None:
        with self.cv:
            self.blob = blob
            self.cv.notify()

    def put(self, seq: int | None, call: _Call) -> None:
        with self.cv:
            late = seq is not None and (seq < self.next_seq or seq in self.skipped)
            if seq is None:
                self.unordered.append(call)
            elif not late:
                self.ordered[seq] = call
            self.cv.notify()
        if late:  # the driver gave up on it before it arrived
            call.fut.set_result(_given_up())

    def skip(self, seq: int) -> None:
        """The driver gave up on call ``seq`` (it failed in transit); ignored once started."""
        with self.cv:
            if seq < self.next_seq:
                return
            self.skipped.add(seq)
            dropped = self.ordered.pop(seq, None)
            self.cv.notify()
        if dropped is not None:
            dropped.fut.set_result(_given_up())

    def _next(self) -> _Call | None:
        with self.cv:
            while not _EXIT.is_set():
                while self.next_seq in self.skipped:
                    self.skipped.remove(self.next_seq)
                    self.next_seq += 1
                if self.next_seq in self.ordered:
                    self.next_seq += 1
                    return self.ordered.pop(self.next_seq - 1)
                if self.unordered:
                    return self.unordered.popleft()
                self.cv.wait()
            return None

    def _run(self) -> None:
        with self.cv:
            while self.blob is None and not _EXIT.is_set():
                self.cv.wait()
        if self.blob is not None:
            try:
                cls, args, kwargs = pickle.loads(self.blob)
                self.obj = cls(*args, **kwargs)
            except BaseException as exc:  # reported by every call; a call is how anyone asks
                self.error = _RemoteError.capture(exc)
        while (call := self._next()) is not None:
            if self.error is not None:
                call.fut.set_result(self.error)
                continue
            try:
                value = getattr(self.obj, call.method)(*call.args, **call.kwargs)
            except BaseException as exc:  # even SystemExit: this thread must keep serving
                value = _RemoteError.capture(exc)
            call.fut.set_result(value)  # torch reports a result it cannot pickle itself
        with self.cv:  # the worker is stopping: whatever still waits will not run
            left = [*self.ordered.values(), *self.unordered]
            self.ordered.clear()
            self.unordered.clear()
        for call in left:
            call.fut.set_result(_given_up())


class _Call(NamedTuple):
    method: str
    args: tuple
    kwargs: dict
    fut: torch.futures.Future


def _given_up() -> _RemoteError:
    return _RemoteError.capture(
        RuntimeError("the call never started: its caller gave up on it, or the worker is stopping")
    )


_WORKER_NAME = DRIVER
_MAILBOXES: dict[int, _Mailbox] = {}
_MAILBOXES_LOCK = threading.Lock()
_EXIT = threading.Event()


def _mailbox(actor_id: int) -> _Mailbox:
    # A call can overtake the construction message (they may come from different senders,
    # or be picked up by different RPC threads), so whichever arrives first makes the box.
    with _MAILBOXES_LOCK:
        box = _MAILBOXES.get(actor_id)
        if box is None:
            box = _MAILBOXES[actor_id] = _Mailbox(actor_id)
        return box


def _construct(actor_id: int, blob: bytes) -> None:
    # The class travels pickled and is unpickled on the actor's thread, so a class this
    # worker cannot import becomes the actor's error rather than a request torch rejects.
    _mailbox(actor_id).build(blob)


@rpc.functions.async_execution
def _invoke(
    actor_id: int, seq: int | None, method: str, args: tuple, kwargs: dict
) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    _mailbox(actor_id).put(seq, _Call(method, args, kwargs, fut))
    return fut


def _skip(actor_id: int, seq: int) -> None:
    _mailbox(actor_id).skip(seq)


def _run_function(fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    try:
        return fn(*args, **kwargs)
    except Exception as exc:
        return _RemoteError.capture(exc)


def _request_exit() -> int:
    """The stop handshake's message: the worker's main thread wakes up and shuts down.

    Actor threads finish the method they are running, and calls still queued give up.
    """
    _EXIT.set()
    with _MAILBOXES_LOCK:
        boxes = list(_MAILBOXES.values())
    for box in boxes:
        with box.cv:
            box.cv.notify()
    return os.getpid()


def _ping() -> None:
    """Liveness probe: answered by RPC threads, so a busy actor does not delay it."""


def _unwrap(value: Any) -> Any:
    if isinstance(value, _RemoteError):
        raise value.rebuild()
    return value


def run_sync(worker: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """Run module-level ``fn(*args, **kwargs)`` in ``worker`` and wait for its result.

    Meant for actor methods that need another worker (e.g. pulling weights from
    ``trainer-0``); it blocks the calling thread, so the driver uses
    :meth:`ActorSystem.run` instead.
    """
    return _unwrap(rpc.rpc_sync(worker, _run_function, args=(fn, args, kwargs)))


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
        return _unwrap(await _bridge(rpc.rpc_async(self.worker, _invoke, args=payload)))

    def call_sync(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        """Blocking call, for actor methods that call an actor in another worker.

        Serialised with the actor's other calls, but not ordered against the driver's.
        """
        payload = (self.actor_id, None, method, args, kwargs)
        return _unwrap(rpc.rpc_sync(self.worker, _invoke, args=payload))


def _rebuild_handle(worker: str, actor_id: int, cls_name: str) -> ActorHandle:
    # A handle coming back to the driver (e.g. returned by an actor) regains the watchdog.
    return ActorHandle(worker, actor_id, cls_name, ActorSystem._active)


def _bridge(fut: torch.futures.Future) -> asyncio.Future:
    """An asyncio future that completes with ``fut`` (which completes on an RPC thread)."""
    loop = asyncio.get_running_loop()
    out = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if out.done():  # cancelled by the caller, or failed early by the watchdog
            return
        if error is not None:
            out.set_exception(error)
        else:
            out.set_result(value)

    def done(f: torch.futures.Future) -> None:
        try:
            value, error = f.value(), None
        except BaseException as exc:  # handed over as an argument: `exc` dies with this block
            value, error = None, exc
        with contextlib.suppress(RuntimeError):  # the loop may already be closed
            loop.call_soon_threadsafe(settle, value, error)

    fut.add_done_callback(done)
    return out


# --------------------------------------------------------------------------------------
# Rendezvous: a TCPStore that listens on the given address only.
# --------------------------------------------------------------------------------------

_LISTEN_FDS: dict[int, int] = {}
"""port -> pre-bound listening socket, handed to the driver's TCPStore (which owns it after)."""


def _rendezvous(url: str, **_: Any) -> Iterator:
    # The stock tcp:// handler makes rank 0 listen on every interface; binding the socket
    # here and passing its fd keeps the store on the address we were given.
    parsed = urlparse(url)
    query = dict(pair.split("=") for pair in parsed.query.split("&") if pair)
    rank, world = int(query["rank"]), int(query["world_size"])
    timeout = timedelta(seconds=float(query["timeout_s"]))
    host, port = parsed.hostname, parsed.port
    assert host is not None and port is not None
    if rank == 0:
        fd = _LISTEN_FDS.pop(port)
        store = dist.TCPStore(
            host, port, world, True, timeout, wait_for_workers=False, master_listen_fd=fd
        )
    else:
        store = dist.TCPStore(host, port, world, False, timeout)
    yield store, rank, world
    raise RuntimeError(f"{_SCHEME}:// cannot re-rendezvous")


with contextlib.suppress(RuntimeError):  # already registered (module reloaded)
    dist.register_rendezvous_handler(_SCHEME, _rendezvous)


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return address == "localhost"


def _loopback_ifname() -> str:
    return "lo0" if sys.platform == "darwin" else "lo"


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _rendezvous_url(address: str, port: int, timeout_s: float) -> str:
    return f"{_SCHEME}://{_url_host(address)}:{port}?timeout_s={timeout_s:g}"


def _backend_options(url: str, rpc_timeout_s: float, threads: int) -> rpc.RpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=threads,
        rpc_timeout=rpc_timeout_s,
        init_method=url,
        _transports=["uv"],
        _channels=["basic"],
    )


@contextlib.contextmanager
def _patched_env(extra: dict[str, str]) -> Iterator[None]:
    """Spawned children copy ``os.environ`` when they start; this is the only handle on it."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --------------------------------------------------------------------------------------
# Worker process
# --------------------------------------------------------------------------------------


def _worker_main(spec: WorkerSpec, rank: int, world: int, url: str, rpc_timeout_s: float) -> None:
    """A spawned worker: serve until the driver says stop, or exit with the driver."""
    parent = multiprocessing.parent_process()
    if parent is not None:  # an orphaned worker must not outlive a killed driver
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    _serve(spec, rank, world, url, rpc_timeout_s, watch_driver=False)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: it adds time and can trip over RPC's native threads.
    os._exit(0)


def serve_worker(
    spec: WorkerSpec,
    rank: int,
    world: int,
    address: str,
    port: int,
    rpc_timeout_s: float = 600.0,
    start_timeout_s: float = 120.0,
) -> None:
    """Make this process worker ``spec`` of a world whose driver runs elsewhere.

    For processes started by an external launcher (one ``torchrun`` rank each): join the RPC
    world of ``world`` processes whose rendezvous store the driver (rank 0) serves at
    ``address:port``, under ``spec.name`` and ``rank``, and serve actor calls. Returns when
    the driver's stop handshake arrives, or when the driver has missed three pings a second
    apart (then with one line on stderr). RPC is shut down on return; exit soon after
    (``os._exit`` skips a teardown that can trip over RPC's native threads). Once per
    process. ``spec.env`` is applied to ``os.environ`` here, so variables read at import
    time must come from the launcher. On a loopback address every listener stays on
    loopback; otherwise set ``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME`` as the network needs.
    """
    if not 0 < rank < world:
        raise ValueError(f"worker rank {rank} is outside 1..{world - 1} (rank 0 is the driver).")
    os.environ.update(spec.env)
    if _is_loopback(address):
        for key in ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            os.environ.setdefault(key, _loopback_ifname())
    url = _rendezvous_url(address, port, start_timeout_s)
    _serve(spec, rank, world, url, rpc_timeout_s, watch_driver=True)
    if _DRIVER_LOST.is_set():
        print(
            f"worker {spec.name!r}: the driver stopped answering at {address}:{port}; exiting.",
            file=sys.stderr,
            flush=True,
        )


def _serve(
    spec: WorkerSpec, rank: int, world: int, url: str, rpc_timeout_s: float, *, watch_driver: bool
) -> None:
    """Join the world as ``spec.name``, serve until asked to exit, shut RPC down locally."""
    global _WORKER_NAME
    _WORKER_NAME = spec.name
    if threading.current_thread() is threading.main_thread():
        # Ctrl-C reaches the whole process group; the driver decides how workers stop.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)
    _quiet_rpc_init_warning()
    rpc.init_rpc(
        spec.name,
        rank=rank,
        world_size=world,
        rpc_backend_options=_backend_options(url, rpc_timeout_s, spec.rpc_threads),
    )
    if watch_driver:  # no parent process to watch: the driver may be on another machine
        threading.Thread(target=_watch_driver, name="digen-driver-watch", daemon=True).start()
    _EXIT.wait()
    time.sleep(_EXIT_FLUSH_S)  # let the answer to the exit request leave before the pipes close
    rpc.shutdown(graceful=False)


_DRIVER_LOST = threading.Event()


def _watch_driver() -> None:
    """Ping the driver; when it stops answering, stop this worker as its handshake would."""
    missed = 0
    while not _EXIT.wait(_DRIVER_PING_PERIOD_S):
        try:
            rpc.rpc_sync(DRIVER, _ping, timeout=_PROBE_TIMEOUT_S)
            missed = 0
        except Exception:
            missed += 1
            if missed >= _DRIVER_MISSES and not _EXIT.is_set():
                _DRIVER_LOST.set()
                _request_exit()
                return


def _forget_earlier_worlds() -> None:
    """Make this process's RPC module look freshly imported, like the workers' is.

    ``init_rpc`` counts its calls per process (a store-key prefix) and ``_all_gather``
    numbers its rounds per set of names; a driver on its second system would otherwise
    wait for keys and rounds that its fresh workers never produce. Both live in private
    globals, hence the guards.
    """
    if hasattr(rpc, "_init_counter"):
        rpc._init_counter = 0
    sequence = getattr(rpc.api, "_all_gather_sequence_id", None)
    if isinstance(sequence, dict):
        sequence.clear()


def _joined(name: str) -> bool:
    try:
        rpc.get_worker_info(name)
    except RuntimeError:
        return False
    return True


def _kill(procs: Any) -> None:
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()


def _kill_at_exit() -> None:
    """A driver leaving without stop() must not wait forever for its non-daemonic workers."""
    system = ActorSystem._active
    if system is not None:
        _kill(system._procs.values())


def _exit_with_parent(parent: Any) -> None:
    parent.join()
    os._exit(70)


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
    bounds each call (a hung, still-living worker is noticed only then), ``start_timeout_s``
    the forming of the world, ``stop_timeout_s`` how long stop() waits for workers to exit
    before killing them. Actors live until their worker exits. With external launch the
    rendezvous is ``launch.address:launch.port`` (``address``/``port`` are ignored), nothing
    is spawned or killed, and :meth:`pids` is empty.
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
        self.startup_s: float | None = None

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
        self._watchdog = asyncio.create_task(self._watch(), name="digen-actor-watchdog")

    async def _start(self) -> None:
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.address, self.port or 0))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            if self.launch is None:
                raise
            raise OSError(
                exc.errno,
                f"the driver cannot listen on {self.address}:{self.port} for the RPC "
                f"rendezvous ({exc.strerror}); it must be a free port on an address of the "
                "driver's own machine",
            ) from exc
        except BaseException:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        _LISTEN_FDS[self.port] = sock.detach()
        url = _rendezvous_url(self.address, self.port, self.start_timeout_s)
        world = len(self.workers) + 1

        env: dict[str, str] = {}
        if _is_loopback(self.address):
            env = {"TP_SOCKET_IFNAME": _loopback_ifname(), "GLOO_SOCKET_IFNAME": _loopback_ifname()}
        if self.launch is None:
            self._spawn(env, url, world)

        _forget_earlier_worlds()
        _quiet_rpc_init_warning()
        # The driver's TensorPipe listener reads the interface name from the environment.
        done = threading.Event()
        failure: list[BaseException] = []

        def join_world() -> None:
            try:
                with _patched_env(env):
                    rpc.init_rpc(
                        DRIVER,
                        rank=0,
                        world_size=world,
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
        if self.launch is not None:
            # The world is complete once init_rpc returns; check that it is the one we want.
            missing = [w.name for w in self.workers if not _joined(w.name)]
            if missing:
                self._state = "running"  # joined: stop() must still release the others
                raise RuntimeError(
                    f"workers {missing} are not in the RPC world at {url}: every rank must "
                    "run the same config, so that the ranks map to the same worker names."
                )

    def _spawn(self, env: dict[str, str], url: str, world: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        for rank, spec in enumerate(self.workers, start=1):
            child_env = {**env, "OMP_NUM_THREADS": str(spec.threads), **spec.env}
            proc = ctx.Process(
                target=_worker_main,
                args=(spec, rank, world, url, self.rpc_timeout_s),
                name=f"digen-{spec.name}",
                # Not daemonic: daemonic processes may not start children (DataLoader
                # workers, compile pools). Exit paths are covered by stop(), the atexit
                # hook below, and each worker's watch on its parent.
                daemon=False,
            )
            with _patched_env(child_env):
                proc.start()  # returns once the child is exec'd; imports run in parallel
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
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
        self._reap()
        for probe in list(self._probes.values()):
            probe.cancel()
        for futs in self._pending.values():
            for fut in futs:
                if not fut.done():
                    fut.set_exception(ActorSystemClosed("the actor system stopped mid-call."))
        if handshake and was_running:
            live = [w.name for w in self.workers if w.name not in self._dead]
            asks = [
                _bridge(rpc.rpc_async(n, _request_exit, timeout=_EXIT_RPC_TIMEOUT_S)) for n in live
            ]
            # Answers only tell us the message was delivered; a stuck worker is killed below.
            await asyncio.gather(*asks, return_exceptions=True)
        if was_running:
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
        if ActorSystem._active is self:
            ActorSystem._active = None

    @staticmethod
    async def _in_thread(fn: Callable[[], None], timeout_s: float, name: str) -> None:
        """Run ``fn`` on a daemon thread and stop waiting for it after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        out = loop.create_future()

        def run() -> None:
            with contextlib.suppress(BaseException):
                fn()
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: out.done() or out.set_result(None))

        threading.Thread(target=run, name=f"digen-{name}", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(out), timeout_s)

    # ---- watchdog -------------------------------------------------------------------

    def _reap(self) -> list[str]:
        """Record workers whose process has exited; return the newly dead ones."""
        newly = []
        for name, proc in self._procs.items():
            if name not in self._dead and proc.exitcode is not None:
                self._dead[name] = WorkerDied(name, proc.pid, proc.exitcode)
                newly.append(name)
        return newly

    async def _watch(self) -> None:
        while True:
            for name in self._reap():
                self._mark_dead(name, self._dead[name])
            await asyncio.sleep(_WATCHDOG_PERIOD_S)

    def _mark_dead(self, worker: str, died: WorkerDied) -> None:
        self._dead[worker] = died
        for fut in self._pending[worker]:
            if not fut.done():
                fut.set_exception(died.again())

    async def _death_of(self, worker: str) -> WorkerDied | None:
        """A transport error just arrived: wait briefly for the exit status that explains it,
        or, with external launch (no process to poll), probe the worker."""
        if self.launch is not None:
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
            await _bridge(rpc.rpc_async(worker, _ping, timeout=_PROBE_TIMEOUT_S))
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
        return rpc.rpc_async(worker, fn, args=payload)

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
                rpc.rpc_async(worker, _skip, args=(actor_id, seq))
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
        return value

    def actor(self, worker: str, cls: type, /, *args: Any, **kwargs: Any) -> ActorHandle:
        """Construct ``cls(*args, **kwargs)`` inside ``worker``; return a handle at once.

        The object is built in the background on the actor's own thread, which then runs
        all its calls; a constructor error (or a class the worker cannot import) is raised
        by every call. ``cls`` and the arguments are pickled here.
        """
        blob = pickle.dumps((cls, args, kwargs))
        actor_id = next(self._ids)
        self._post(worker, _construct, (actor_id, blob))
        return ActorHandle(worker, actor_id, getattr(cls, "__qualname__", repr(cls)), self)

    async def run(self, worker: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        """Run module-level ``fn(*args, **kwargs)`` in ``worker`` (no actor, no lock)."""
        fut = self._post(worker, _run_function, (fn, args, kwargs))
        return _unwrap(await self._await(worker, fut))

    # ---- introspection --------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        """Process id of every worker, by name (also after it died or was stopped)."""
        return dict(self._pids)

    def dead(self) -> dict[str, WorkerDied]:
        """Workers whose process has exited, with the error their calls raise."""
        return dict(self._dead)

    def statistics(self) -> dict[str, Any]:
        """Counters for logs and tests: state, calls sent, calls in flight, dead workers."""
        return {
            "state": self._state,
            "workers": len(self.workers),
            "calls": self._calls,
            "pending": {name: len(futs) for name, futs in self._pending.items()},
            "dead": sorted(self._dead),
            "startup_s": self.startup_s,
        }


atexit.register(_kill_at_exit)  # runs before multiprocessing's join of non-daemonic children
