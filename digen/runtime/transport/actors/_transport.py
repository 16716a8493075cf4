"""The transport under the actor layer: ``torch.distributed.rpc`` over TensorPipe.

Rendezvous through a ``digen-tcp://`` store that listens on the given address only, the
backend's options, the bridge from
torch futures (completed on RPC threads) to asyncio, and :func:`payload_bytes`, which sizes
a message the way TensorPipe ships it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import pickle
import warnings
from collections.abc import Hashable, Iterator
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc

_SCHEME = "digen-tcp"


def _quiet_rpc_init_warning() -> None:
    # init_rpc itself trips a torch deprecation warning (it gathers over a bare gloo
    # backend); it says nothing a digen user can act on.
    warnings.filterwarnings(
        "ignore", message=r"You are using a Backend .* as a ProcessGroup", category=UserWarning
    )


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
        global _SERVED_STORE
        fd = _LISTEN_FDS.pop(port)
        store = _SERVED_STORE = dist.TCPStore(
            host, port, world, True, timeout, wait_for_workers=False, master_listen_fd=fd
        )
    else:
        store = dist.TCPStore(host, port, world, False, timeout)
    yield store, rank, world
    raise RuntimeError(f"{_SCHEME}:// cannot re-rendezvous")


with contextlib.suppress(RuntimeError):  # already registered (module reloaded)
    dist.register_rendezvous_handler(_SCHEME, _rendezvous)


_RANKS_KEY = "digen/last_rank"
"""The rendezvous store's counter of ranks in a dynamic world: the driver's workers take
1..n, and each restart or joiner the next one (the joiners' handshake: :mod:`._join`)."""


_SERVED_STORE: dist.Store | None = None
"""The rendezvous store this process serves (the driver's), as every client sees it (RPC
itself uses it under a prefix)."""


def _world_store() -> dist.Store:
    """The rendezvous store the driver serves (only the driver calls this)."""
    if _SERVED_STORE is None:
        raise RuntimeError("this process serves no rendezvous store (only the driver does).")
    return _SERVED_STORE


def _client_store(address: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the rendezvous store the driver serves at ``address:port``."""
    return dist.TCPStore(address, port, -1, False, timedelta(seconds=timeout_s))


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address


def _rendezvous_url(address: str, port: int, timeout_s: float) -> str:
    return f"{_SCHEME}://{_url_host(address)}:{port}?timeout_s={timeout_s:g}"


def _backend_options(
    url: str,
    rpc_timeout_s: float,
    threads: int,
    device_maps: dict[str, dict[str, str]] | None = None,
) -> rpc.RpcBackendOptions:
    """TensorPipe over uv; with ``device_maps`` (peer -> {own device: peer device}) CUDA
    tensors travel GPU to GPU to those peers (the CUDA channels are then allowed too)."""
    channels = ["basic"] if not device_maps else None  # None: TensorPipe picks, CUDA included
    options = rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=threads,
        rpc_timeout=rpc_timeout_s,
        init_method=url,
        _transports=["uv"],
        _channels=channels,
    )
    for peer, mapping in (device_maps or {}).items():
        options.set_device_map(peer, mapping)
    return options


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


_DYNAMIC = False
"""This process is in a dynamic RPC world (ranks join and leave: an elastic system)."""

_WIRES: dict[str, str] = {}
"""Worker name -> the wire name of the incarnation this process addresses under it: the
driver's map (it sets an entry for every process it starts or takes in), and in a worker its
own name."""

_NEWEST: dict[str, tuple[int, str]] = {}
"""Worker name -> (members this process knew, the newest incarnation among them): a cache."""


def wire_name(name: str, incarnation: int) -> str:
    """The RPC name of incarnation ``incarnation`` (0 for the first process) of worker
    ``name`` in a dynamic world: ``generator-1`` -> ``generator_1:0``, ``generator_1:1``, ...

    A dynamic world keeps its members as one string of ``name-rank,`` entries split at the
    dashes, so dashes travel as underscores; and torch's agents keep a member's tables as
    long as they run (they are never erased: see ``_system``), so a process that takes a
    lost worker's place needs a name no agent has seen."""
    return f"{name.replace('-', '_')}:{incarnation}"


def wire(name: str) -> str:
    """Worker ``name`` as the RPC world knows it now: in a static world the name itself; in
    a dynamic world the wire name of its incarnation this process addresses: the driver's
    map, else the newest incarnation this process has met (the driver starts using an
    incarnation only once every member has met it)."""
    if not _DYNAMIC:
        return name
    known = _WIRES.get(name)
    return known if known is not None else _newest_incarnation(name)


def _assign_wire(name: str, wire_as: str) -> None:
    """From now on, this process addresses worker ``name`` as ``wire_as``."""
    _WIRES[name] = wire_as


def _newest_incarnation(name: str) -> str:
    infos = rpc.api._get_current_rpc_agent().get_worker_infos()
    cached = _NEWEST.get(name)
    if cached is not None and cached[0] == len(infos):  # members are never taken out
        return cached[1]
    prefix = wire_name(name, 0)[:-1]
    found = [
        (int(info.name[len(prefix) :]), info.name)
        for info in infos
        if info.name.startswith(prefix) and info.name[len(prefix) :].isdigit()
    ]
    newest = max(found)[1] if found else name  # none: torch names the unknown worker
    _NEWEST[name] = (len(infos), newest)
    return newest


def _set_dynamic(on: bool) -> None:
    global _DYNAMIC
    _DYNAMIC = on
    _WIRES.clear()
    _NEWEST.clear()


_TOKEN_KEY = "RpcGroupManagementToken"
"""Torch's store key of a dynamic world's membership token: a process joins (and the driver
edits the list of members) only while it holds it."""


def _token(holder: str) -> str:
    """The token ``holder`` puts under :data:`_TOKEN_KEY` (torch's spelling, as its joins
    write it: ``holder`` is a joining process's wire name), and the key whose appearance
    tells those waiting for it that it was released."""
    return f"Token_for_{holder}_join"


@contextlib.contextmanager
def _membership_token(store: dist.Store, holder: str) -> Iterator[None]:
    """Hold the dynamic world's membership token as ``holder`` (torch's protocol, so joins
    wait for it and it waits for them) and release it however the block ends: torch's own
    context manager keeps it when its block raises, and every later join then waits for it
    forever."""
    mine = _token(holder)
    store.delete_key(mine)  # left "Done" by an earlier hold: waiters would not wait
    while True:
        held_by = store.compare_set(_TOKEN_KEY, "", mine).decode()
        if held_by == mine:
            break
        store.wait([held_by])  # the holder sets this key when it releases the token
    try:
        yield
    finally:
        store.set(_TOKEN_KEY, "")
        store.set(mine, "Done")


def _release_token_of(store: dist.Store, holder: str) -> bool:
    """Release the membership token if ``holder`` (a process known to be gone, killed in the
    middle of its join) holds it; whether it did."""
    theirs = _token(holder)
    if not store.check([_TOKEN_KEY]) or store.get(_TOKEN_KEY).decode() != theirs:
        return False
    store.compare_set(_TOKEN_KEY, theirs, "")  # a gone holder's: nobody else takes it meanwhile
    store.set(theirs, "Done")
    return True


def _joined(name: str) -> bool:
    try:
        rpc.get_worker_info(wire(name))
    except RuntimeError:
        return False
    return True


# --------------------------------------------------------------------------------------
# Payload sizing: what one message costs on the wire.
# --------------------------------------------------------------------------------------

_CLONE_MIN_BYTES = 8 * 1024
"""TensorPipe sends a copy of a tensor whose storage is at least this big and at least twice
the tensor's own bytes (torch's ``cloneSparseTensors``); any other tensor ships its whole
storage, once per message however many tensors view it."""


class _Sizer(pickle.Pickler):
    """Pickles a message but its tensors, and sizes each tensor as TensorPipe ships it."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file)  # the default protocol, as torch's RPC pickler uses
        self.shipped: dict[Hashable, int] = {}  # storage (or copied tensor) -> bytes
        self._seen: list[torch.Tensor] = []  # keeps ids unique while the pass runs

    def persistent_id(self, obj: Any) -> int | None:
        if not isinstance(obj, torch.Tensor):
            return None
        try:
            storage = obj.untyped_storage()
        except Exception:  # no plain storage (sparse, some subclasses): pickle its parts
            return None
        whole, own = storage.nbytes(), obj.numel() * obj.element_size()
        if whole >= _CLONE_MIN_BYTES and whole >= 2 * own:
            self.shipped[("copy", id(obj))] = own
        else:
            self.shipped[(storage.data_ptr(), storage.device)] = whole
        self._seen.append(obj)
        return len(self._seen)


def payload_bytes(obj: Any) -> tuple[int, int]:
    """``(tensor bytes, other bytes)`` of ``obj`` sent as one RPC message.

    Tensor bytes are what TensorPipe ships for the tensors reachable in ``obj`` (see
    ``_CLONE_MIN_BYTES``); other bytes are the pickled size of the rest. One pickling pass
    that never copies tensor data. Never raises: an object that cannot be pickled counts
    what was pickled before it failed.
    """
    buffer = io.BytesIO()
    sizer = _Sizer(buffer)
    with contextlib.suppress(Exception):  # accounting must never stop a message
        sizer.dump(obj)
    return sum(sizer.shipped.values()), buffer.tell()
