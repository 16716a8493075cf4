"""Summing a train step's gradients, on one worker and across data-parallel workers.

Float addition is not associative: the same gradients summed in another order differ in
the last bits, and a few hundred optimizer steps at a high learning rate turn that into
visibly different runs. Which trainer updates which micro-batch, and when, depends on timing
in a disaggregated run, so :class:`GradAccumulator` offers two ways to sum:

- **ordered** (``train.grad_order: fixed``, the default with LoRA): each micro-batch's
  gradient is kept apart (its backward passes run alone on zeroed ``.grad``), and at the
  optimizer step the step's micro-batches are added in micro-batch order, ``0, 1, ..., B-1``.
  Across ``T`` trainers, each fills the rows of the micro-batches it trained in a
  ``[B, P]`` buffer of zeros and the buffers are all-reduced — exact, since every entry
  has one non-zero contributor — and every trainer then adds the rows in order. The result
  depends only on the micro-batches, not on where or when they ran. Cost: one fp32 copy of
  the trainable parameters per micro-batch a trainer holds until the step (LoRA: small),
  and with several trainers ``B`` times the all-reduce traffic, in chunks of at most
  :data:`CHUNK_BYTES`.
- **arrival** (``train.grad_order: arrival``, the default for full fine-tuning): backward
  passes add into ``.grad`` in place as they come, and trainers all-reduce one flat
  buffer. One gradient buffer, no copies; the last bits depend on the order.

The colocated trainer uses the same class (its order is fixed by construction). With sharded
trainers (FSDP, :mod:`digen.runtime.worker.fsdp`) each works on its own shards of the gradients,
already summed over the members by FSDP's reduce-scatter: ``reduce`` is called without a
group, and the ordered sum adds the shards' micro-batches in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from digen.runtime.worker.fsdp import local

__all__ = ["CHUNK_BYTES", "GradAccumulator", "all_reduce_"]

CHUNK_BYTES = 64 << 20
"""Largest buffer the ordered all-reduce sends at once."""


def all_reduce_(tensor: torch.Tensor, group: Any) -> None:
    """Sum ``tensor`` in place over ``group`` (a ProcessGroup, e.g. ``dist.group.WORLD``)."""
    group.allreduce([tensor]).wait()


class GradAccumulator:
    """A train step's gradients of ``params``, summed ``ordered`` or in arrival order."""

    def __init__(self, params: Sequence[torch.nn.Parameter], *, ordered: bool) -> None:
        self.params = list(params)
        self.ordered = ordered
        self.numel = sum(local(p).numel() for p in self.params)
        self._slots: dict[int, torch.Tensor] = {}

    @property
    def held_bytes(self) -> int:
        """Memory of the per-micro-batch gradients kept until the step."""
        return sum(s.nbytes for s in self._slots.values())

    @contextlib.contextmanager
    def micro_batch(self, index: int) -> Iterator[None]:
        """The backward passes in this block are micro-batch ``index``'s gradient."""
        if not self.ordered:
            yield
            return
        if index in self._slots:
            raise ValueError(f"micro-batch {index} was already trained in this step")
        if any(p.grad is not None for p in self.params):
            raise RuntimeError("ordered gradients need .grad cleared between micro-batches")
        try:
            yield
            self._slots[index] = self._flat(self.params)
        finally:
            for p in self.params:
                p.grad = None

    def reset(self) -> None:
        """Forget a step left part way (a stop at a micro-batch boundary)."""
        self._slots.clear()
        for p in self.params:
            p.grad = None

    def reduce(self, microbatches: int | range, group: Any = None) -> None:
        """Set every parameter's ``.grad`` to the summed gradient of an optimizer step.

        ``microbatches``: the step's micro-batch ids (a count: ``0 .. microbatches-1``; a
        range: one mini-batch's), the same on every trainer; ``group``: the trainers'
        process group, or None alone.
        """
        if isinstance(microbatches, int):
            microbatches = range(microbatches)
        if self.ordered:
            total = self._ordered_sum(microbatches, group)
            self._slots.clear()
        elif group is not None:
            total = self._flat(self.params)
            all_reduce_(total, group)
        else:
            return  # one worker, in place: .grad already holds the sum
        self._unflatten(total)

    def _ordered_sum(self, microbatches: range, group: Any) -> torch.Tensor:
        mine = self._slots
        outside = sorted(set(mine) - set(microbatches))
        if outside:
            raise ValueError(
                f"micro-batch {outside[0]} is outside this optimizer step's "
                f"{microbatches.start}..{microbatches.stop - 1}"
            )
        device = self.params[0].device if self.params else torch.device("cpu")
        total = torch.zeros(self.numel, dtype=torch.float32, device=device)
        if group is None:  # rows this worker lacks are zero: skipping them adds nothing
            for i in sorted(mine):
                total += mine[i]
            return total
        rows = max(1, CHUNK_BYTES // max(4 * self.numel, 1))
        for lo in range(microbatches.start, microbatches.stop, rows):
            ids = range(lo, min(lo + rows, microbatches.stop))
            buf = torch.zeros(len(ids), self.numel, dtype=torch.float32, device=device)
            for r, i in enumerate(ids):
                if i in mine:
                    buf[r] = mine[i]
            all_reduce_(buf, group)  # one non-zero contributor per entry: exact
            for r in range(len(ids)):
                total += buf[r]
        return total

    @staticmethod
    def _flat(params: Sequence[torch.nn.Parameter]) -> torch.Tensor:
        """This worker's gradients as one fp32 vector (its shards, with sharded trainers)."""
        return torch.cat(
            [
                (local(p.grad) if p.grad is not None else torch.zeros_like(local(p)))
                .reshape(-1)
                .float()
                for p in params
            ]
        )

    def _unflatten(self, flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                grad = torch.zeros_like(p)  # sharded like ``p`` where it is
                mine = local(grad)
                n = mine.numel()
                mine.copy_(flat[offset : offset + n].view_as(mine))
                p.grad = grad
                offset += n
