"""What a worker process is: its name, threads, environment and RPC settings
(:class:`WorkerSpec`), and where workers started by someone else meet the driver
(:class:`ExternalLaunch`). Plain data, read by both the driver's :class:`ActorSystem` and the
worker process (:mod:`._worker`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from digen.sched.names import DRIVER

__all__ = ["ExternalLaunch", "WorkerSpec"]

_NAME_RE = re.compile(r"[A-Za-z0-9_:\-]{1,127}")


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
    device_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    """Peer worker -> {own device: peer device}: CUDA tensors to those peers travel GPU to
    GPU (TensorPipe device maps). Empty: only CPU tensors may cross."""

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
