"""Evaluation on the generator pool, outside the schedule.

:func:`evaluate` sends batches of held-out prompts round the live generators, each batch
scored beside the generator that made it; with ``eval.ema`` the trainers' moving average is
lent to the generators first, a bucket at a time (it never passes through the driver, and
trainer 0 never holds a second full copy), and dropped after. No trace and no cost estimate
are kept, and the workers run it on streams of their own: training is the same with or
without it. A generator lost meanwhile is the driver's to handle (``lose``); its batch goes
to another.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial

from digen.runtime.driver.handles import GeneratorHandle, ScorerHandle, TrainerHandle
from digen.runtime.messages import EvalRequest, EvalScores
from digen.runtime.transport.actors import WorkerDied
from digen.sched.scheduler import Scheduler

__all__ = ["Members", "evaluate"]


@dataclass(frozen=True, slots=True)
class Members:
    """What an evaluation reaches: the pools' actors, who is alive, and what to do on a loss."""

    gens: Sequence[GeneratorHandle]
    scorers: Sequence[GeneratorHandle | ScorerHandle]
    """Where generator ``i``'s batches are scored (its scoring lane, or itself)."""
    lead: TrainerHandle
    """Trainer 0: the moving average is lent from it."""
    sched: Scheduler
    """Which generators are alive (:attr:`Scheduler.alive`)."""
    lose: Callable[[int, WorkerDied], Awaitable[None]]
    """The driver's answer to generator ``i`` lost."""


async def evaluate(
    members: Members,
    ema: bool,
    size: int | None,
    prompts: Sequence[str],
    metadata: Sequence[dict],
    samples: int,
) -> tuple[int, list[EvalScores]]:
    """Evaluate the generators' current weights (``ema``: the trainers' moving average) on
    ``prompts``, ``samples`` images each in key order ``(prompt, sample)``, in batches of
    ``size`` (a micro-batch's; None: one batch). Returns the version evaluated and the
    batches' scores in key order."""
    gens, sched = members.gens, members.sched
    keys = [(p, j) for p in range(len(prompts)) for j in range(samples)]
    size = size or len(keys)
    batches = [keys[i : i + size] for i in range(0, len(keys), size)]

    async def one(c: int, batch: list[tuple[int, int]]) -> tuple[int, EvalScores]:
        texts = tuple(prompts[p] for p, _ in batch)
        request = EvalRequest(c, tuple(batch), texts, tuple(metadata[p] for p, _ in batch))
        while True:  # a generator lost meanwhile: the batch goes to another
            alive = sched.alive
            i = alive[c % len(alive)]
            try:
                made = await gens[i].evaluate(request)
                scored = await members.scorers[i].score_eval(request)
                return made.value, scored.value
            except WorkerDied as died:
                if died.worker != gens[i].worker:
                    raise
                await members.lose(i, died)

    async def every_generator(call: Callable[[GeneratorHandle], Awaitable[None]]) -> None:
        """Call the generators that took part from the lend's first bucket on."""

        async def to(i: int) -> None:
            try:
                await call(gens[i])
            except WorkerDied as died:
                if died.worker != gens[i].worker:
                    raise
                await members.lose(i, died)

        await asyncio.gather(*(to(i) for i in sched.alive if i in pulling))

    lent, source, pulling = False, members.lead.worker, set(sched.alive)
    if ema:  # the trainers' moving average, lent to the generators
        try:  # a bucket at a time: trainer 0 never holds a second full copy
            bucket, buckets = 0, 1
            while bucket < buckets:
                buckets = await members.lead.lend_ema(bucket)  # sharded: all gather it
                if not buckets:  # 0: no average kept
                    break
                last = bucket == buckets - 1
                pull = partial(
                    GeneratorHandle.pull_eval_weights, source=source, bucket=bucket, last=last
                )
                await every_generator(pull)
                lent, bucket = last, bucket + 1
        finally:
            await members.lead.end_lend()
    try:
        done = await asyncio.gather(*(one(c, b) for c, b in enumerate(batches)))
    finally:
        if lent:
            await every_generator(lambda g: g.drop_eval_weights())
    versions = {v for v, _ in done}
    if len(versions) != 1:
        raise RuntimeError(f"an evaluation met several versions: {sorted(versions)}")
    return versions.pop(), [scores for _, scores in done]
