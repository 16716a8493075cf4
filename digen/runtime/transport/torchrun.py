"""Runs started by ``torchrun``: every rank runs ``digen run``; which role each takes, and
where digen's RPC world meets, from the variables torchrun sets.

Rank 0 is the driver, ranks ``1..G`` the generators (``G x`` the processes of one where a
generator runs on several devices), then the trainers
(:func:`role_for_rank`); the world must be exactly that size. The rendezvous is at
``MASTER_ADDR`` on ``MASTER_PORT + 1`` (torchrun's own store holds ``MASTER_PORT``), or on
:data:`RPC_PORT_ENV` when set (docs/RUNTIME.md, "Multi-node with torchrun").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from digen.errors import DigenError
from digen.sched.names import DRIVER, Pool, member_name, worker_name

if TYPE_CHECKING:
    from digen.config import DigenConfig

__all__ = ["RPC_PORT_ENV", "role_for_rank", "torchrun_world", "under_torchrun"]

RPC_PORT_ENV = "DIGEN_RPC_PORT"
"""Under torchrun: the port of digen's RPC rendezvous; default ``MASTER_PORT + 1``."""


def role_for_rank(rank: int, generators: int, trainers: int, group: int = 1) -> str:
    """The role of a torchrun rank: 0 is the driver, then the generators' processes
    (``group`` each: a generator of several devices, its members in turn), then the trainers.

    ``role_for_rank(2, 2, 1) == "generator-1"``; ``role_for_rank(3, 2, 1) == "trainer-0"``;
    ``role_for_rank(2, 1, 1, group=2) == "generator-0:1"``.
    """
    processes = generators * group
    if rank == 0:
        return DRIVER
    if 1 <= rank <= processes:
        i, m = divmod(rank - 1, group)
        return member_name(worker_name(Pool.GENERATOR, i), m)
    if processes < rank <= processes + trainers:
        return worker_name(Pool.TRAINER, rank - 1 - processes)
    raise ValueError(
        f"rank {rank} has no role: ranks run from 0 to {processes + trainers} with "
        f"{processes} generator processes and {trainers} trainers."
    )


def under_torchrun(env: Mapping[str, str]) -> bool:
    """Whether this process is a rank torchrun started (it sets ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in env and "WORLD_SIZE" in env


def torchrun_world(env: Mapping[str, str], cfg: DigenConfig) -> tuple[int, int, str, int]:
    """``(rank, world, address, port)`` of digen's RPC rendezvous from torchrun's variables."""

    def number(key: str, default: str | None = None) -> int:
        value = env.get(key, default)
        try:
            return int(value)
        except (TypeError, ValueError):
            raise DigenError(
                f"environment variable {key}={value!r} must be an integer (torchrun sets it)."
            ) from None

    rank, world = number("RANK"), number("WORLD_SIZE")
    rt = cfg.runtime
    if rt.mode != "disaggregated":
        raise DigenError(
            f"a torchrun launch runs the disaggregated runtime; runtime.mode is '{rt.mode}', "
            "so add --mode disaggregated."
        )
    group = rt.placement.generator_group
    need = 1 + rt.generators * group + rt.trainers
    if world != need:
        each = f"{group} per generator" if group > 1 else "one per generator"
        raise DigenError(
            f"torchrun started WORLD_SIZE={world} processes but runtime.generators="
            f"{rt.generators} and runtime.trainers={rt.trainers} need 1 + "
            f"{rt.generators * group} + {rt.trainers} = {need} (one driver, {each}, one per "
            "trainer)."
        )
    if not 0 <= rank < world:
        raise DigenError(f"RANK={rank} is outside 0..{world - 1}.")
    address = env.get("MASTER_ADDR", "127.0.0.1")
    if address == "localhost":  # what --standalone sets; one address family for every rank
        address = "127.0.0.1"
    if RPC_PORT_ENV in env:
        port = number(RPC_PORT_ENV)
    elif "MASTER_PORT" in env:
        port = number("MASTER_PORT") + 1  # MASTER_PORT itself is torchrun's own store
    else:
        raise DigenError(f"set MASTER_PORT (torchrun does) or {RPC_PORT_ENV}.")
    if not 0 < port < 65536:
        raise DigenError(f"the RPC rendezvous port {port} is outside 1..65535.")
    return rank, world, address, port
