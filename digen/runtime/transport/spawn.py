"""Data-parallel colocated runs: starting the rank processes and joining their group.

A colocated run with ``train.num_devices = W > 1`` runs ``W`` processes on this machine:
rank 0 is the process the user started, ranks ``1..W-1`` are forked from the fork server
(:mod:`.forkserver`). They meet through a TCP store on loopback (:data:`LOCAL_HOST`), each
reports in, and all join one default process group (gloo, or NCCL on GPUs), in which the
colocated trainer sums gradients. :func:`run_data_parallel` does all of it around the work of
each rank, which the caller supplies; no rank process outlives the run.

Signals to the whole process group (Ctrl-C, a scheduler's SIGTERM) are the lead's to act on:
a rank process ignores them, and the lead stops every rank at one micro-batch boundary (they
agree at each). A rank process also ends with the lead's, however the lead ended.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from digen.errors import DigenError
from digen.runtime.transport import forkserver

__all__ = ["LOCAL_HOST", "run_data_parallel"]

LOCAL_HOST = "127.0.0.1"
"""Where a colocated data-parallel run's workers meet: this machine, on loopback only."""

_JOIN_TIMEOUT_S = 60.0
"""After the run, how long the lead waits for a rank process to exit before killing it."""

T = TypeVar("T")


def run_data_parallel(
    devices: Sequence[str],
    timeout_s: float,
    lead: Callable[[], T],
    rank_main: Callable[[Any, int, int], Callable[[], Any]],
    state: Any,
) -> T:
    """Run ``lead()`` as rank 0 and the work of ranks ``1..W-1`` in one default process group;
    ``W = len(devices)``, rank ``r`` on ``devices[r]``.

    A rank process calls ``rank_main(state, rank, world)`` before it joins the group (so a
    failure there, a reward hook that does not load, is a failed start the lead names at
    once) and then, in the group, the function that returns. ``rank_main`` must be a
    module-level function (the rank processes import it by name) and ``state`` picklable. Returns what ``lead`` returns; raises :class:`DigenError` naming a
    rank that failed to start or exited with an error.
    """
    from digen.runtime.transport.groups import destroy_default_group, pinned_to_loopback, tcp_store

    world = len(devices)
    # the store takes a free port on loopback as it binds; the ranks are told which
    store = tcp_store(LOCAL_HOST, 0, world, lead=True, timeout=timedelta(seconds=timeout_s))
    args = (rank_main, state, list(devices), timeout_s, world, store.port)
    procs = [
        forkserver.process(_rank_entry, (*args, rank), daemon=True) for rank in range(1, world)
    ]
    for p in procs:
        forkserver.start(p)
    try:
        # NCCL may connect at its first collective: the pin lasts the run, then the
        # caller's environment is as it was
        with pinned_to_loopback(LOCAL_HOST):
            _join_group(0, store, devices, timeout_s, procs)
            try:
                result = lead()
            finally:
                destroy_default_group()
    finally:  # on a failure too: no rank outlives the run
        for p in procs:
            p.join(timeout=_JOIN_TIMEOUT_S)
            if p.is_alive():
                p.kill()
    bad = [(r, p.exitcode) for r, p in enumerate(procs, start=1) if p.exitcode != 0]
    if bad:
        rank, code = bad[0]
        raise DigenError(f"data-parallel worker {rank} exited with code {code}.")
    return result


def _rank_entry(
    rank_main: Callable[[Any, int, int], Callable[[], Any]],
    state: Any,
    devices: list[str],
    timeout_s: float,
    world: int,
    port: int,
    rank: int,
) -> None:
    """A rank process: prepare its work, join the group, run the work, leave the group."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the lead's to act on (module docstring)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from digen.runtime.transport.actors import exit_with_parent
    from digen.runtime.transport.groups import destroy_default_group, loopback_env, tcp_store

    exit_with_parent()  # a rank ends with the lead's process, however it ended
    for key, value in loopback_env(LOCAL_HOST).items():  # this process is the run's own
        os.environ.setdefault(key, value)
    work = rank_main(state, rank, world)
    store = tcp_store(LOCAL_HOST, port, world, lead=False, timeout=timedelta(seconds=timeout_s))
    _join_group(rank, store, devices, timeout_s)
    try:
        work()
    finally:
        destroy_default_group()


def _join_group(
    rank: int, store: Any, devices: Sequence[str], timeout_s: float, procs: Sequence[Any] = ()
) -> None:
    """The default group over ``store`` (gloo, or on GPUs NCCL with gloo beside it). The lead
    (rank 0, holding the rank processes ``procs``) waits until each has reported in, and
    fails at once, naming it, if one exits before (it would otherwise wait for half an hour)."""
    import torch.distributed as dist

    from digen.runtime.transport.groups import init_default_group

    world = len(devices)
    if rank:
        store.set(f"digen-up-{rank}", "1")
    while rank == 0:
        try:
            store.wait([f"digen-up-{r}" for r in range(1, world)], timedelta(seconds=0.5))
            break
        except (RuntimeError, dist.DistError):  # not all up yet
            for r, p in enumerate(procs, start=1):
                if p.exitcode is not None:
                    raise DigenError(
                        f"data-parallel worker {r} exited with code {p.exitcode} while "
                        "starting (its error is printed above)."
                    ) from None
    init_default_group(store, rank, world, devices, timeout_s)
