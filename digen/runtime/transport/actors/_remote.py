"""What runs inside every process of the world, workers and driver alike.

Each actor is a :class:`_Mailbox`: its own thread, which builds the object and runs its
calls one at a time, the driver's in the order it made them. The functions below are what
the driver and other workers send by reference over RPC (``_construct``, ``_invoke``,
``_skip``, ``_run_function``, ``_request_exit``, ``_ping``, ``_arrive``), so they must stay importable at
this path in every process. An exception travels back as a :class:`_RemoteError` return
value, never as the torch future's exception, which is kept for transport failures.
"""

from __future__ import annotations

import collections
import importlib
import os
import pickle
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed.rpc as rpc

from digen.sched.names import DRIVER

_PROBE_TIMEOUT_S = 5.0
"""External launch: how long a liveness probe (driver -> worker, worker -> driver) may take."""


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
        self.closed = threading.Event()
        """Set once the actor has served its last call and its ``close()`` has returned."""
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
                if isinstance(cls, str):  # "package.module:Class", imported here only
                    module, _, name = cls.partition(":")
                    cls = getattr(importlib.import_module(module), name)
                self.obj = cls(*args, **kwargs)
            except BaseException as exc:  # reported by every call; a call is how anyone asks
                self.error = _RemoteError.capture(exc)
        while (call := self._next()) is not None:
            if self.error is not None:
                call.fut.set_result(self.error)
                continue
            try:
                value = _finished(getattr(self.obj, call.method)(*call.args, **call.kwargs))
            except BaseException as exc:  # even SystemExit: this thread must keep serving
                value = _RemoteError.capture(exc)
            call.fut.set_result(value)  # torch reports a result it cannot pickle itself
        with self.cv:  # the worker is stopping: whatever still waits will not run
            left = [*self.ordered.values(), *self.unordered]
            self.ordered.clear()
            self.unordered.clear()
        for call in left:
            call.fut.set_result(_given_up())
        self._close()

    def _close(self) -> None:
        """The actor's ``close()``, if it has one, on its own thread after its last call."""
        close = getattr(self.obj, "close", None) if self.error is None else None
        try:
            if callable(close):
                close()
        except BaseException as exc:  # the worker is stopping anyway: say so, go on
            print(
                f"{_WORKER_NAME}: closing {type(self.obj).__name__} raised {exc!r}", file=sys.stderr
            )
        finally:
            self.closed.set()


class _Call(NamedTuple):
    method: str
    args: tuple
    kwargs: dict
    fut: torch.futures.Future


def _given_up() -> _RemoteError:
    return _RemoteError.capture(
        RuntimeError("the call never started: its caller gave up on it, or the worker is stopping")
    )


_WORKER_NAME = DRIVER  # a worker sets its own name here when it joins (`_worker._serve`)
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
        return _finished(fn(*args, **kwargs))
    except Exception as exc:
        return _RemoteError.capture(exc)


def _finished(value: Any) -> Any:
    """``value`` once every GPU tensor in it is computed. A reply leaves on an RPC thread,
    whose CUDA stream is not the one the tensors were made on: without this, TensorPipe
    could send a tensor its kernels have not finished writing. For each device the reply
    holds tensors of, waits for an event recorded on this thread's current stream there,
    the stream that made them (not for the whole device: other actors' streams run on);
    nothing to do with no GPU tensor."""
    if not torch.cuda.is_initialized():
        return value
    devices: set[torch.device] = set()
    _cuda_devices(value, devices, depth=4)
    for device in devices:
        made = torch.cuda.Event()
        made.record(torch.cuda.current_stream(device))
        made.synchronize()
    return value


def _cuda_devices(value: Any, out: set[torch.device], depth: int) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            out.add(value.device)
    elif depth <= 0:
        return
    elif isinstance(value, dict):
        for v in value.values():
            _cuda_devices(v, out, depth - 1)
    elif isinstance(value, list | tuple):
        for v in value:
            _cuda_devices(v, out, depth - 1)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            _cuda_devices(getattr(value, name, None), out, depth - 1)


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


def _wait_closed(timeout_s: float) -> None:
    """Wait, at most ``timeout_s`` in all, for every actor here to be closed."""
    deadline = time.monotonic() + timeout_s
    with _MAILBOXES_LOCK:
        boxes = list(_MAILBOXES.values())
    for box in boxes:
        box.closed.wait(max(0.0, deadline - time.monotonic()))


def _ping() -> None:
    """Liveness probe: answered by RPC threads, so a busy actor does not delay it."""


_ON_ARRIVAL: Callable[[str, str, int, str], str | None] | None = None
"""In the driver of a world that takes workers joining it: what to do with one that just
joined (set by the driver's system while it runs)."""


def _arrive(name: str, host: str, pid: int, proof: str) -> str | None:
    """Sent to the driver by a worker that joined a running world (its ``init_rpc`` done),
    with its proof that it is the joiner the name was given to: None when the driver takes
    it, else why not (then the worker leaves)."""
    on_arrival = _ON_ARRIVAL
    if on_arrival is None:
        return "the run is not taking workers (it is starting, stopping, or does not take joins)"
    return on_arrival(name, host, pid, proof)


def _unwrap(value: Any) -> Any:
    if isinstance(value, _RemoteError):
        raise value.rebuild()
    return value
