"""A run's rewards in a process that scores: set up once, every batch on one loop, then closed.

A hook's life is the run's: a hook object may define ``setup()`` and ``close()`` (plain or
``async``), which digen calls once per process that scores (each generator, or each
colocated worker) before the first batch and after the last, on the one event loop that
runs every call of that process (:class:`RewardLoop` where the caller has none). That is
where a hook opens an HTTP session or loads a model. A model reward's ``device: worker``
option is the device of the worker it scores for (:func:`worker_device`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from digen.errors import RewardError
from digen.rewards.scoring import CompositeReward, RewardResult

__all__ = ["RewardLoop", "scoring_on", "worker_device"]


_SCORING = threading.local()
_RUN_DEVICE: list[str] = []
"""The device a colocated worker scores on while its run lasts (:func:`scoring_on`)."""


def worker_device() -> str:
    """The device of the worker the calling thread scores for: what a model reward's
    ``device: worker`` option means. The device of the :class:`RewardLoop` whose thread this
    is (its loop's or its executor's), else of the colocated run under way in this process
    (:func:`scoring_on`), else ``cpu``."""
    return getattr(_SCORING, "device", None) or (_RUN_DEVICE[-1] if _RUN_DEVICE else "cpu")


def _enter_device(device: str) -> None:
    """This thread scores for a worker on ``device``; on a GPU it is the thread's current
    CUDA device too (each thread has its own, ``cuda:0`` until set)."""
    _SCORING.device = device
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(torch.device(device))


@contextlib.contextmanager
def scoring_on(device: str) -> Iterator[None]:
    """Rewards scored in this process inside the block, on any thread, score for a worker
    on ``device`` (a colocated worker scores in its own process, on its own loop)."""
    _RUN_DEVICE.append(device)
    try:
        yield
    finally:
        _RUN_DEVICE.pop()


class RewardLoop:
    """A :class:`CompositeReward` living on an event loop of its own, in a thread, for a
    whole run: for scoring from threads that have no loop (an actor's).

    The hooks' ``setup()`` runs once when it is made, every :meth:`score` runs on that one
    loop (so a session or model a hook opened stays usable), and :meth:`close` runs their
    ``close()`` and ends the thread. Every thread it runs hooks on (the loop's and its
    executor's, where plain hooks run) is on ``device``, the worker's (:func:`worker_device`).
    """

    def __init__(self, reward: CompositeReward, device: str = "cpu") -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.reward = reward
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(
            ThreadPoolExecutor(
                thread_name_prefix="digen-reward", initializer=_enter_device, initargs=(device,)
            )
        )

        def run() -> None:
            _enter_device(device)
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="digen-rewards", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._run(reward.setup())
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def score(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """``await reward(...)`` on the loop, waited for here."""
        if self._closed:
            raise RewardError("the rewards were closed; no more batches can be scored.")
        return self._run(self.reward(samples, prompts, metadata))

    def close(self) -> None:
        """The hooks' ``close()``, then the loop and its thread end (once; later calls do
        nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.reward.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
