"""Process groups and their stores, listening where the run says and nowhere else.

Every torch.distributed group of a run (the colocated workers', the trainers' data-parallel
group or device mesh, the weight-broadcast group) meets through a ``TCPStore`` whose lead
listens on a socket bound here, to the run's address only: torch's own ``TCPStore(host,
port, is_master=True)`` listens on every interface whatever ``host`` says. A store asked for
port 0 takes a free one at bind time, and :attr:`TCPStore.port` says which; :func:`listen`
binds one ahead of the store, for a port that must be known before the store exists (the
socket is held, so nothing can take the port meanwhile).

The group's backend follows :func:`digen.runtime.placement.group_backend`. On a loopback
address the transports' interfaces (gloo, NCCL's bootstrap) are pinned to loopback for the
group's creation only (:func:`loopback_env`): the caller's environment is left as it was.
Off loopback they bind to the interface of the run's address, which a run's workers have in
their environment from the start (:mod:`digen.runtime.transport.sockets`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from digen.runtime.placement import default_group_backend, group_backend
from digen.runtime.transport.sockets import (
    INTERFACE_VARIABLES,
    is_loopback,
    listening_socket,
    loopback_interface,
)

__all__ = ["listen", "loopback_env", "make_group", "pinned_to_loopback", "tcp_store"]

_LISTENING: dict[int, socket.socket] = {}
"""port -> a socket bound (and listening) by :func:`listen`, until a store adopts it."""


def loopback_env(address: str) -> dict[str, str]:
    """What keeps a process's gloo, NCCL and TensorPipe listeners on loopback when its run's
    address is one (nothing otherwise: a run's workers start with the interface of its
    address in their environment, :func:`~digen.runtime.transport.sockets.interface_env`)."""
    if not is_loopback(address):
        return {}
    return dict.fromkeys(INTERFACE_VARIABLES, loopback_interface())


@contextlib.contextmanager
def pinned_to_loopback(address: str) -> Iterator[None]:
    """:func:`loopback_env` in ``os.environ`` for the block, where the caller did not set the
    variable itself; restored after."""
    from digen.runtime.transport.forkserver import patched_env

    env = {k: v for k, v in loopback_env(address).items() if k not in os.environ}
    with patched_env(env):
        yield


def listen(host: str) -> int:
    """Bind a free port on ``host`` now, for a store this process will lead (:func:`tcp_store`
    with that port adopts the socket); the port."""
    sock = listening_socket(host, 0)
    port = sock.getsockname()[1]
    _LISTENING[port] = sock
    return port


def tcp_store(
    host: str, port: int, world: int, *, lead: bool, timeout: timedelta, wait: bool = False
) -> dist.TCPStore:
    """A store of ``world`` members at ``host:port``. The lead listens on ``host`` only (on the
    socket :func:`listen` bound for ``port``, or a new one; port 0 takes a free port, read back
    from ``store.port``); the others connect."""
    if not lead:
        return dist.TCPStore(host, port, world, False, timeout)
    sock = _LISTENING.pop(port, None) or listening_socket(host, port)
    bound = sock.getsockname()[1]
    fd = sock.detach()  # the store owns the socket from here
    return dist.TCPStore(
        host, bound, world, True, timeout, wait_for_workers=wait, master_listen_fd=fd
    )


def make_group(
    store: dist.Store,
    rank: int,
    size: int,
    devices: Sequence[str],
    timeout_s: float,
    hosts: Sequence[str] | None = None,
) -> dist.ProcessGroup:
    """A process group of ``size`` members over ``store`` (no default group), on the backend
    ``devices`` (its members' devices, on ``hosts`` where they span machines) call for."""
    timeout = timedelta(seconds=timeout_s)
    if group_backend(devices, hosts) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # NCCL's own default is ten minutes, not the run's bound
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def init_default_group(
    store: dist.Store,
    rank: int,
    world: int,
    devices: Sequence[str],
    timeout_s: float,
    hosts: Sequence[str] | None = None,
) -> None:
    """This process's default group over ``store``: gloo, or on GPUs NCCL with gloo beside it
    for the CPU tensors a run's control values travel in (``hosts``: the members' machines,
    where they span several)."""
    backend = default_group_backend(devices, hosts)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        # NCCL connects now, not at the first collective: inside the caller's loopback pin
        device_id=torch.device(devices[rank]) if "nccl" in backend else None,
    )


def destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
