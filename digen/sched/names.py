"""The schedule's words: task kinds, worker pools and worker names.

A worker's name is its pool and its index in it (``"generator-0"``, ``"trainer-3"``); the
driver is ``"driver"``. Traces, metrics, RPC and the simulator all use these names.
"""

from __future__ import annotations

import re
from enum import StrEnum

__all__ = [
    "DRIVER",
    "Pool",
    "TaskKind",
    "index_of",
    "member_name",
    "member_of",
    "pool_of",
    "worker_name",
    "worker_names",
]


class TaskKind(StrEnum):
    """What a worker can be doing. Values are the strings traces and metrics use."""

    GENERATE = "generate"
    """Sampling a micro-batch on a generator."""
    TAG = "tag"
    """Sampling a micro-batch on a trainer (trainer-assisted generation)."""
    SCORE = "score"
    """Rewards of a micro-batch, on a generator."""
    UPDATE = "update"
    """Forward/backward of a micro-batch on a trainer (gradients kept, no optimizer step)."""
    STEP = "step"
    """The optimizer step that ends a train step (every trainer together)."""
    SYNC = "sync"
    """New weights reaching the generators."""


class Pool(StrEnum):
    """The worker pools, and the scoring lanes (one per generator, in its process)."""

    GENERATOR = "generator"
    TRAINER = "trainer"
    SCORER = "scorer"
    """With ``runtime.schedule.score_overlap``: generator ``i``'s rewards run on ``scorer-i``,
    beside its generation (same process, own thread), so scoring never holds up the next
    micro-batch."""


DRIVER = "driver"
"""The driver's name in traces and in the RPC world."""


def worker_name(pool: Pool | str, index: int) -> str:
    """``"generator-0"``, ``"trainer-3"``: a pool's name and the worker's index in it."""
    return f"{pool}-{index}"


def worker_names(pool: Pool | str, count: int) -> tuple[str, ...]:
    return tuple(worker_name(pool, i) for i in range(count))


_NAME_RE = re.compile(r"^(.*?)-(\d+)$")


def pool_of(worker: str) -> str:
    """The pool a worker belongs to: its name without a trailing ``-<index>``.

    ``"generator-3" -> "generator"``, ``"trainer-h100-0" -> "trainer-h100"``, ``"driver" ->
    "driver"``: workers of one device type share a prefix, so heterogeneous pools keep
    separate estimates.
    """
    m = _NAME_RE.match(worker)
    return m[1] if m else worker


def index_of(worker: str) -> int:
    """The worker's index within its pool (``"trainer-2" -> 2``; -1 for ``"driver"``)."""
    m = _NAME_RE.match(worker)
    return int(m[2]) if m else -1


def member_name(worker: str, member: int) -> str:
    """The process of member ``member`` of a worker that runs on several devices (a
    generator of ``runtime.placement.generator_sequence`` devices): member 0 is the worker
    itself, the others ``"generator-0:1"``, ``"generator-0:2"``, ... A member is no worker of
    a pool (:func:`pool_of` and :func:`index_of` see no index in it): the schedule knows the
    worker only."""
    return worker if member == 0 else f"{worker}:{member}"


def member_of(name: str) -> tuple[str, int]:
    """``(worker, member)`` of a process's name: the inverse of :func:`member_name`."""
    worker, dot, member = name.rpartition(":")
    if dot and member.isdigit() and _NAME_RE.match(worker):
        return worker, int(member)
    return name, 0
