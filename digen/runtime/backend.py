"""What a run trains with: the :class:`TrainingBackend` both modes implement.

The runner (:mod:`digen.run.session`) drives one of them and nothing else:
:class:`~digen.runtime.colocated.ColocatedTrainer` (one process, or one rank of a
data-parallel group, samples and trains in turn) or :class:`~digen.runtime.driver.loop.Driver`
(generator and trainer processes, scheduled by the driver).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from digen.checkpoint import Checkpoint
    from digen.runtime.messages import EvalScores, StepResult

__all__ = ["PoolEvents", "TrainingBackend"]


class PoolEvents(Protocol):
    """What the runner sees of a generator pool: each change of its members."""

    on_change: Callable[[dict[str, Any]], Any] | None
    """Told (sync or async) of each generator lost, back or new (an event dict)."""


class TrainingBackend(Protocol):
    """A run's training loop and its weights, entered as an async context (workers up on
    entry, stopped on exit)."""

    rendezvous: str | None
    """``address:port`` where the run's workers (and generators joining it) find it; None
    when no process joins it."""
    pool: PoolEvents | None
    """The generator pool's membership (:class:`~digen.runtime.driver.pool.GeneratorPool`),
    whose ``on_change`` the runner sets; None when the run has no generator pool."""

    @property
    def version(self) -> int:
        """The policy version of the trained weights (the train steps completed)."""
        ...

    async def __aenter__(self) -> TrainingBackend: ...

    async def __aexit__(self, *exc: object) -> None: ...

    async def run(
        self,
        steps: range | int,
        on_step: Callable[[StepResult], Any] | None = None,
        *,
        samples_at: Callable[[int], bool] | None = None,
    ) -> list[StepResult]:
        """Train ``steps``; ``on_step`` (sync or async) sees each one and stops the run by
        returning False; ``samples_at(step)``: whether the step keeps a sample grid."""
        ...

    def request_stop(self) -> None:
        """Stop at the next micro-batch boundary (from any thread or a signal handler)."""
        ...

    async def evaluate(
        self, prompts: Sequence[str], metadata: Sequence[dict], samples: int
    ) -> tuple[int, list[EvalScores]]:
        """The current weights evaluated on ``prompts``: the version and the scored batches."""
        ...

    async def restore(self, ckpt: Checkpoint) -> None:
        """Continue from ``ckpt`` (before the first step)."""
        ...

    async def write_checkpoint(self, directory: str | os.PathLike) -> None:
        """Weights and optimizer state into a checkpoint directory."""
        ...

    async def save_weights(self, out_dir: str | os.PathLike) -> Path | None:
        """The trained weights (LoRA or full) into ``out_dir``; where they went."""
        ...

    async def trained_names(self) -> list[str]:
        """The trained weights' names."""
        ...

    async def final_state(self) -> dict[str, torch.Tensor]:
        """The trained weights, name -> tensor."""
        ...

    async def whereabouts(self) -> dict[str, dict[str, Any]]:
        """Host and pid of every worker process besides this one, by name."""
        ...
