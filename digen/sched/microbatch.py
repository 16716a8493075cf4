"""Forming a train step's generation micro-batches (GAP) — pure, torch-free.

A train step makes ``B`` prompts x ``n`` samples. Two ways to cut that into micro-batches:

- **generation axis** (GAP, the default): a micro-batch is a slice of *one* prompt's ``n``
  samples, ``samples_per_microbatch`` of them (default ``ceil(n / G)`` for ``G`` generators),
  so the ``G`` generators make one group together and it completes — and can be trained —
  as early as possible;
- **prompt axis** (the baseline): a micro-batch is one whole group; each generator makes
  whole groups of different prompts, and no group is done before a generator has made all
  ``n`` of its samples.

Micro-batches are listed prompt by prompt, so groups complete in prompt order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MicroBatch", "form_microbatches", "samples_per_microbatch"]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One unit of generation work: some samples of one prompt of one train step."""

    step: int
    mb: int
    """Index of the micro-batch within its step."""
    prompt: int
    """Prompt position within the step (``0 .. B-1``)."""
    samples: tuple[int, ...]
    """Sample indices within the prompt's group (``0 .. n-1``)."""


def samples_per_microbatch(n: int, generators: int, axis: str, requested: int | None) -> int:
    """Samples per micro-batch: ``requested``, or the axis default (clamped to ``[1, n]``)."""
    if requested is not None:
        return max(1, min(requested, n))
    if axis == "generation":
        return max(1, math.ceil(n / generators))
    if axis == "prompt":
        return n
    raise ValueError(f"unknown micro-batch axis {axis!r}; expected 'generation' or 'prompt'")


def form_microbatches(
    step: int,
    prompts: int,
    n: int,
    *,
    generators: int = 1,
    axis: str = "generation",
    samples: int | None = None,
) -> list[MicroBatch]:
    """The micro-batches of train step ``step``, in the order they should be handed out."""
    size = samples_per_microbatch(n, generators, axis, samples)
    out: list[MicroBatch] = []
    for p in range(prompts):
        for start in range(0, n, size):
            out.append(MicroBatch(step, len(out), p, tuple(range(start, min(start + size, n)))))
    return out
