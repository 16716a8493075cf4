"""The worker process: join the world under its name, serve calls until told to stop.

A spawned worker (:func:`_worker_main`) exits with its parent; one started by an external
launcher (:func:`serve_worker`) pings the driver and stops when it stops answering.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed.rpc as rpc

from digen.runtime.transport.actors import _remote
from digen.runtime.transport.actors._join import HELLO_KEY, JoinRefused, ask_to_join
from digen.runtime.transport.actors._remote import (
    _EXIT,
    _PROBE_TIMEOUT_S,
    DRIVER,
    _arrive,
    _ping,
    _request_exit,
    _wait_closed,
)
from digen.runtime.transport.actors._spec import WorkerSpec
from digen.runtime.transport.actors._transport import (
    _assign_wire,
    _backend_options,
    _client_store,
    _quiet_rpc_init_warning,
    _rendezvous_url,
    _set_dynamic,
)
from digen.runtime.transport.sockets import interface_env

_EXIT_FLUSH_S = 0.1
_CLOSE_TIMEOUT_S = 10.0
"""At a stop, how long the worker waits for its actors' ``close()`` (an actor still inside a
call is not waited for longer)."""
_DRIVER_PING_PERIOD_S = 1.0
_DRIVER_MISSES = 3
"""External launch: a worker exits after this many failed pings of the driver in a row."""


def _worker_main(
    spec: WorkerSpec, rank: int, world: int | None, url: str, rpc_timeout_s: float, wire_as: str
) -> None:
    """A started worker: serve as ``wire_as`` until the driver says stop, or exit with the
    driver."""
    exit_with_parent()  # an orphaned worker must not outlive a killed driver
    _serve(spec, wire_as, rank, world, url, rpc_timeout_s, watch_driver=False)
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
    time must come from the launcher. Its listeners bind to the interface that reaches
    ``address`` (loopback on a loopback address), unless ``TP_SOCKET_IFNAME`` /
    ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name one.
    """
    if not 0 < rank < world:
        raise ValueError(f"worker rank {rank} is outside 1..{world - 1} (rank 0 is the driver).")
    os.environ.update(spec.env)
    _bind_to_interface_toward(address)
    url = _rendezvous_url(address, port, start_timeout_s)
    _serve(spec, spec.name, rank, world, url, rpc_timeout_s, watch_driver=True)
    _said_driver_lost(spec.name, address, port)


def join_world(
    address: str,
    port: int,
    *,
    secret: str,
    threads: int | None = None,
    wait_s: float = 60.0,
    on_joined: Callable[[str], None] | None = None,
) -> str:
    """Make this process a worker of the running dynamic world whose driver serves its
    rendezvous store at ``address:port``, and serve actor calls until the driver stops it.

    The driver offers a pool to join (``ActorSystem(joiners=...)``) to processes that know
    its join ``secret``: this process proves it does, checks that the driver does too
    (before anything from it is unpickled), gets the next free name of that pool
    (``generator-2``, ...) and the next free rank, joins the world, and tells the driver,
    which builds its actors (the handshake: :mod:`._join`). ``threads`` overrides the
    offer's CPU threads. Waits up to ``wait_s`` for a run there to offer joins;
    ``on_joined(name)`` is called once the driver took it. Returns the name it served
    under, when the driver's stop handshake arrives or the driver stops answering. Ctrl-C
    and SIGTERM end it at once (the run makes again what it held).
    Raises :class:`JoinRefused` (one sentence) when no run there takes it, the run refuses
    the secret, or the process there cannot prove it knows the secret. Once per process.
    """
    where = f"{address}:{port}"
    deadline = time.monotonic() + wait_s
    while not _answers(address, port):  # asked here: torch's own failure is pages long
        if time.monotonic() > deadline:
            raise JoinRefused(f"no run is listening at {where} (waited {wait_s:g} s).")
        time.sleep(0.2)
    store = _client_store(address, port, max(wait_s, 10.0))
    while not store.check([HELLO_KEY]):
        if time.monotonic() > deadline:
            raise JoinRefused(
                f"the run at {where} takes no joining workers (it must be started "
                f"with runtime.elastic.accept_generators=true), or it is still starting: waited "
                f"{wait_s:g} s."
            )
        time.sleep(0.2)
    answer_by = time.monotonic() + max(wait_s, 30.0)
    slot = ask_to_join(store, secret, where, socket.gethostname(), os.getpid(), answer_by)
    offer = slot.offer
    env = dict(offer["env"])
    for key in offer.get("local_paths", ()):  # paths of the driver's machine: kept if here
        if key in env and not os.path.isdir(os.path.dirname(env[key])):
            del env[key]
    spec = WorkerSpec(
        slot.name,
        threads=threads or offer["threads"],
        env=env,
        rpc_threads=offer["rpc_threads"],
    )
    os.environ.update(spec.env)
    _bind_to_interface_toward(address)
    url = _rendezvous_url(address, port, wait_s)

    def announce() -> None:
        me = (spec.name, socket.gethostname(), os.getpid(), slot.arrival_proof)
        refused = rpc.rpc_sync(DRIVER, _arrive, args=me)
        if refused is not None:
            _REFUSED.append(refused)
            _request_exit()
        elif on_joined is not None:
            on_joined(spec.name)

    timeout_s = offer["rpc_timeout_s"]
    _serve(
        spec,
        slot.wire,
        slot.rank,
        None,
        url,
        timeout_s,
        watch_driver=True,
        joined=announce,
        own_signals=True,
    )
    if _REFUSED:
        raise JoinRefused(f"the run at {where} did not take {spec.name}: {_REFUSED[0]}.")
    _said_driver_lost(spec.name, address, port)
    return spec.name


_REFUSED: list[str] = []


def _answers(address: str, port: int) -> bool:
    """Whether something accepts connections at ``address:port``."""
    try:
        socket.create_connection((address, port), timeout=1.0).close()
    except OSError:
        return False
    return True


def _bind_to_interface_toward(address: str) -> None:
    """Make this process's listeners bind to the interface that reaches the driver at
    ``address`` (loopback for a loopback address), where the environment names none."""
    for key, value in interface_env(address).items():
        os.environ.setdefault(key, value)


def _said_driver_lost(name: str, address: str, port: int) -> None:
    if _DRIVER_LOST.is_set():
        print(
            f"worker {name!r}: the driver stopped answering at {address}:{port}; exiting.",
            file=sys.stderr,
            flush=True,
        )


def _serve(
    spec: WorkerSpec,
    wire_as: str,
    rank: int,
    world: int | None,
    url: str,
    rpc_timeout_s: float,
    *,
    watch_driver: bool,
    joined: Callable[[], None] | None = None,
    own_signals: bool = False,
) -> None:
    """Join the world as ``spec.name`` (under the wire name ``wire_as``), serve until asked to exit, shut RPC down locally;
    ``joined``: run once the join is complete, before serving. ``own_signals``: Ctrl-C and
    SIGTERM end this process (a worker that joined by itself: its leaving is a loss the
    run goes on from), rather than being left to the driver."""
    _remote._WORKER_NAME = spec.name  # the name errors raised here carry
    _name_process(spec.name)
    if threading.current_thread() is threading.main_thread() and not own_signals:
        # Ctrl-C reaches the whole process group, and schedulers (Slurm, torchrun's agent)
        # send SIGTERM to every process: the driver decides how workers stop, after its
        # checkpoint. A worker still exits with its driver (parent or pings), and SIGKILL
        # stops it at once.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(spec.threads)
    _quiet_rpc_init_warning()
    _set_dynamic(world is None)
    if world is None:
        _assign_wire(spec.name, wire_as)
    rpc.init_rpc(
        wire_as,
        rank=rank,
        world_size=world,
        rpc_backend_options=_backend_options(
            url, rpc_timeout_s, spec.rpc_threads, spec.device_maps
        ),
    )
    _JOINED.set()  # in a dynamic world: every member has learnt of this one by now
    if joined is not None:
        joined()
    if watch_driver:  # no parent process to watch: the driver may be on another machine
        threading.Thread(target=_watch_driver, name="digen-driver-watch", daemon=True).start()
    _EXIT.wait()
    _wait_closed(_CLOSE_TIMEOUT_S)  # each actor's close() (a reward hook's sessions, files)
    time.sleep(_EXIT_FLUSH_S)  # let the answer to the exit request leave before the pipes close
    rpc.shutdown(graceful=False)


_DRIVER_LOST = threading.Event()

_JOINED = threading.Event()
"""This worker's ``init_rpc`` returned. In a dynamic world a joining member tells every
member of itself during its ``init_rpc``, one after the other, so the driver, told first,
may call it while another member cannot reach it yet."""


def _has_joined() -> bool:
    """Run in a worker (sent by the driver): whether its join of the world is complete."""
    return _JOINED.is_set()


def _name_process(name: str) -> None:
    """Show the worker's name as its process name (``ps -e``, ``top``, ``pgrep generator``;
    Linux keeps the first 15 characters)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_name = 15
        ctypes.CDLL(None).prctl(pr_set_name, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass  # a cosmetic: never a reason to fail


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


def exit_with_parent() -> None:
    """A spawned process ends (exit code 70) when the process that spawned it does, however
    that one ended; nothing to do in a process that was not spawned by multiprocessing."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(70)

    threading.Thread(target=watch, name="digen-parent-watch", daemon=True).start()
