"""Actor classes and functions for test_actors.py and test_elastic.py; a plain module so
spawned workers import it."""

from __future__ import annotations

import os
import threading
import time

import torch

from digen.runtime.transport.actors import ActorHandle, run_sync

_HOLDING = threading.Event()
"""Set while an actor of this process is in :meth:`Accumulator.hold`."""
_GATE = threading.Event()
"""What :meth:`Accumulator.hold` waits for: :meth:`Accumulator.release`, from any actor."""


class Accumulator:
    """Holds a tensor; ``bump`` reads, sleeps, then writes, so unserialised calls lose updates."""

    def __init__(self, size: int, start: float = 0.0) -> None:
        self.total = torch.full((size,), start)
        self.count = 0
        self.log: list[int] = []

    def ping(self) -> None:
        return None

    def add(self, x: torch.Tensor) -> torch.Tensor:
        self.total += x
        return self.total.clone()

    def bump(self) -> int:
        seen = self.count
        time.sleep(0.05)
        self.count = seen + 1
        return self.count

    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def hold(self, timeout: float) -> bool:
        """Keep this actor's thread until an actor of the process calls :meth:`release`
        (True), or ``timeout`` seconds pass (False)."""
        _HOLDING.set()
        released = _GATE.wait(timeout)
        _GATE.clear()
        _HOLDING.clear()
        return released

    def holding(self, timeout: float) -> bool:
        """Whether an actor of the process is in :meth:`hold` (waiting up to ``timeout``)."""
        return _HOLDING.wait(timeout)

    def release(self) -> None:
        _GATE.set()

    def meet(self, mine: str, theirs: str, timeout: float) -> bool:
        """Leave file ``mine``, then wait up to ``timeout`` seconds for file ``theirs``: True
        when the other side arrived (it ran at the same time as this call)."""
        open(mine, "w").close()
        deadline = time.monotonic() + timeout
        while not os.path.exists(theirs):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def fail(self, message: str) -> None:
        raise ValueError(message)

    def record(self, item: int) -> None:
        time.sleep(0.002)  # long enough for the next calls to pile up at the lock
        self.log.append(item)

    def records(self) -> list[int]:
        return self.log

    def exit_now(self, code: int) -> None:
        os._exit(code)

    def pid(self) -> int:
        return os.getpid()

    def threads(self) -> tuple[int, str | None]:
        return torch.get_num_threads(), os.environ.get("DIGEN_TEST_MARK")

    def ask_peer(self, peer: ActorHandle, x: torch.Tensor) -> torch.Tensor:
        """Worker-to-worker: call an actor in another worker from inside this one."""
        return peer.call_sync("add", x)

    def ask_peer_to(self, peer: ActorHandle, method: str, *args: object) -> object:
        """Worker-to-worker: any method of an actor in another worker."""
        return peer.call_sync(method, *args)

    def run_on(self, worker: str, a: int, b: int) -> tuple[int, int]:
        """Worker-to-worker: run a module-level function in another worker."""
        return run_sync(worker, where_am_i, a, b)


class Broken:
    def __init__(self) -> None:
        raise KeyError("no such thing")


def where_am_i(a: int, b: int) -> tuple[int, int]:
    return os.getpid(), a * b


def echo(x: object) -> object:
    return x


def knows(wire_as: str) -> bool:
    """Whether this process's RPC agent has tables for the member named ``wire_as``."""
    import torch.distributed.rpc as rpc

    try:
        rpc.get_worker_info(wire_as)
    except RuntimeError:
        return False
    return True


def pid_of(worker: str) -> int:
    """Worker-to-worker: the process id of ``worker`` as this process reaches it by name."""
    return run_sync(worker, os.getpid)
