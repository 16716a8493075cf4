"""What a worker made and still holds: the data plane of a disaggregated run.

A generated micro-batch stays in the process that made it — its rollout (the window's
latents and log-probs) and its prompt's embedding until a trainer has trained it, its
decoded pixels until they are scored — keyed by ``(step, micro-batch)``. Other workers read it directly, actor to actor,
with :func:`~digen.runtime.transport.actors.run_sync` on the module-level functions below. Those run
on RPC threads, not on the holder's actor thread, so a worker busy with a long generation
still serves its data at once; the store therefore has its own lock. The driver only ever
sees keys.

Trainer 0 also serves its weights from here, bucket by bucket from its live parameters, so
generators pull new weights from it directly (:func:`fetch_weights`), not through the driver.
Whatever leaves is staged on the CPU unless both ends are GPUs joined by a device map.

One store per process (:func:`open_store`): a generator and its scoring actor share it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from digen.algos.rollout import Rollout

__all__ = [
    "Store",
    "fetch_pixels",
    "fetch_rollout",
    "fetch_weights",
    "local_store",
    "open_store",
    "release",
]

Key = tuple[int, int]
"""``(step, micro-batch)``."""


@dataclass(slots=True)
class _Held:
    rollout: Rollout | None
    pixels: torch.Tensor | None
    conditioning: Any = None
    """The prompt's embedding (a reference to the maker's cache), for the trainer."""
    taken: int = 0
    """Trainers that took their rows of the rollout so far (sharded trainers each take some)."""


class Store:
    """A bounded map ``(step, mb) -> (rollout, pixels)``, plus trainer 0's weights source."""

    def __init__(self, capacity: int = 1 << 30) -> None:
        self.capacity = capacity
        self._items: dict[Key, _Held] = {}
        self._weights: Callable[[int, int, str | None], dict[str, torch.Tensor]] | None = None
        self._lent: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()

    def put(
        self, key: Key, rollout: Rollout, pixels: torch.Tensor | None, conditioning: Any = None
    ) -> None:
        """Hold a micro-batch; ``pixels`` None when someone else scores it (a sharded
        trainer other than the first keeps only its copy of the rollout)."""
        with self._lock:
            if key in self._items:
                raise KeyError(f"micro-batch {key} is already held here")
            if len(self._items) >= self.capacity:
                raise RuntimeError(
                    f"this worker already holds {len(self._items)} micro-batches, its limit "
                    "(runtime.schedule.max_inflight bounds what is generated and not yet trained)"
                )
            self._items[key] = _Held(rollout, pixels, conditioning)

    def put_pixels(self, key: Key, pixels: torch.Tensor) -> None:
        """Hold images with no rollout (an evaluation's), until scoring takes them; outside
        the bound on micro-batches, which counts only what training will take."""
        with self._lock:
            if key in self._items:
                raise KeyError(f"images {key} are already held here")
            self._items[key] = _Held(None, pixels)

    def take_pixels(self, key: Key) -> torch.Tensor:
        """The decoded samples of ``key``; they are dropped here (scoring reads them once)."""
        with self._lock:
            held = self._get(key)
            pixels, held.pixels = held.pixels, None
            self._forget_if_empty(key, held)
        if pixels is None:
            raise KeyError(f"the pixels of micro-batch {key} were already taken")
        return pixels

    def take_rollout(self, key: Key, rows: list[int] | None = None) -> Rollout:
        """The trajectories of ``key`` (only ``rows`` when given); they are dropped here."""
        return self.take_training(key, rows)[0]

    def take_training(
        self, key: Key, rows: list[int] | None = None, takers: int = 1
    ) -> tuple[Rollout, Any]:
        """What a trainer needs of ``key``: its trajectories (``rows``) and its prompt's
        embedding; dropped here once ``takers`` trainers (sharded ones: each its rows) took
        theirs."""
        with self._lock:
            held = self._get(key)
            rollout = held.rollout
            held.taken += 1
            if held.taken >= takers:
                held.rollout = None
            conditioning = held.conditioning
            self._forget_if_empty(key, held)
        if rollout is None:
            raise KeyError(f"the rollout of micro-batch {key} was already taken")
        if rows is not None:
            rollout = rollout.select(torch.tensor(rows, dtype=torch.long))
        return rollout, conditioning

    def release(self, key: Key) -> None:
        """Drop whatever is held for ``key`` (nothing of it will be trained)."""
        with self._lock:
            self._items.pop(key, None)

    def serve_weights(
        self, source: Callable[[int, int, str | None], dict[str, torch.Tensor]]
    ) -> None:
        """Serve weights from ``source(version, bucket, wire)`` (trainer 0's live weights)."""
        with self._lock:
            self._weights = source

    def lend(self, bucket: int = 0, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Serve ``tensors`` as bucket ``bucket`` of trainer 0's moving average (lent a bucket
        at a time, for an evaluation) until something else is lent; None: serve none."""
        with self._lock:
            self._lent = None if tensors is None else (bucket, tensors)

    def lent(self, bucket: int) -> dict[str, torch.Tensor]:
        with self._lock:
            lent = self._lent
        if lent is None:
            raise RuntimeError("this worker lends no moving average now (trainer 0 does)")
        if lent[0] != bucket:
            raise RuntimeError(f"bucket {bucket} of the moving average is not lent now")
        return lent[1]

    def weights(self, version: int, bucket: int = 0, wire: str | None = None) -> dict[str, Any]:
        """Bucket ``bucket`` of the weights of ``version``, on ``wire`` (None: where they are)."""
        with self._lock:
            source = self._weights
        if source is None:
            raise RuntimeError("this worker serves no weights (only trainer 0 does)")
        return source(version, bucket, wire)

    def statistics(self) -> dict[str, int]:
        """Micro-batches held and their bytes, for logs and tests."""
        with self._lock:
            items = list(self._items.values())
        nbytes = sum(
            (h.rollout.nbytes if h.rollout is not None else 0)
            + (h.pixels.nbytes if h.pixels is not None else 0)
            for h in items
        )
        return {"held": len(items), "bytes": nbytes}

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._weights = None

    def _get(self, key: Key) -> _Held:
        held = self._items.get(key)
        if held is None:
            raise KeyError(f"micro-batch {key} is not held by this worker")
        return held

    def _forget_if_empty(self, key: Key, held: _Held) -> None:
        if held.rollout is None and held.pixels is None:
            del self._items[key]


_OPENED: Store | None = None
_OPENING = threading.Lock()


def open_store(capacity: int | None = None) -> Store:
    """This process's store, for an actor being built here: the first one makes it, the
    others of the process (a generator's scoring actor) share it. ``capacity``: what the
    run lets be generated and not yet trained (its ``C_gen``); None keeps the store's own.

    Actors hand the store to whatever they do with it; the functions below, which peers run
    here over RPC, find it with :func:`local_store`.
    """
    global _OPENED
    with _OPENING:
        if _OPENED is None:
            _OPENED = Store()
        if capacity is not None:
            _OPENED.capacity = capacity
        return _OPENED


def local_store() -> Store:
    """The store an actor of this process opened (:func:`open_store`)."""
    if _OPENED is None:
        raise RuntimeError("no actor of this worker process holds data: its store is not open")
    return _OPENED


def fetch_pixels(key: Key, wire: str | None = None) -> torch.Tensor:
    """Run in the holder (actor to actor): take the decoded samples of ``key``; ``wire``:
    the device they leave on (``"cpu"`` stages them; None sends them as they are)."""
    return _on(local_store().take_pixels(key), wire)


def fetch_rollout(
    key: Key,
    rows: list[int] | None = None,
    conditioning: bool = False,
    wire: str | None = None,
    takers: int = 1,
):
    """Run in the holder (actor to actor): take the trajectories of ``key``; with
    ``conditioning``, also its prompt's embedding: ``(rollout, embedding or None)``.
    ``takers``: how many trainers take rows of it (:meth:`Store.take_training`)."""
    rollout, embeds = local_store().take_training(key, rows, takers)
    if not conditioning:
        embeds = None
    elif embeds is not None and wire is not None:
        embeds = embeds.to(wire)
    return (_on(rollout, wire), embeds)


def fetch_weights(version: int, bucket: int = 0, wire: str | None = None) -> dict[str, Any]:
    """Run in trainer 0: bucket ``bucket`` of its weights of ``version``, on ``wire``."""
    return local_store().weights(version, bucket, wire)


def fetch_lent(bucket: int) -> dict[str, torch.Tensor]:
    """Run in trainer 0: bucket ``bucket`` of the moving average it lends (host tensors)."""
    return local_store().lent(bucket)


def _on(value: Any, wire: str | None) -> Any:
    return value if wire is None else value.to(wire)


def release(keys: list[Key]) -> None:
    """Run in the holder: drop what is held for ``keys``."""
    store = local_store()
    for key in keys:
        store.release(key)
