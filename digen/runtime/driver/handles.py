"""The driver's side of every call that crosses a process: one handle per kind of actor,
whose methods are the only place a method of a worker is named.

A handle wraps an actor reference (:class:`~digen.runtime.transport.actors.ActorHandle`, the
:class:`~digen.runtime.driver.cluster.ShardedTrainers` that call sharded trainers as one, or
a test's fake) and gives each call its types: the calls that run the model carry one request
(:mod:`digen.runtime.messages`: ``GenerateRequest``, ``ScoreRequest``, ``UpdateRequest``,
``StepRequest``, ``EvalRequest``), the others a few plain values.
"""

from __future__ import annotations

from typing import Any

from digen.runtime.messages import (
    EvalRequest,
    GenerateRequest,
    ScoreRequest,
    StepRequest,
    TimedResult,
    UpdateRequest,
)

__all__ = ["GeneratorHandle", "ScorerHandle", "TrainerHandle"]


class _Handle:
    """An actor reference with typed calls."""

    __slots__ = ("actor",)

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    @property
    def worker(self) -> str:
        """The worker the actor lives in (for a sharded group, its first member)."""
        return self.actor.worker

    @property
    def members(self) -> list[str]:
        """The workers a call runs on: one, or every member of a sharded group."""
        return list(getattr(self.actor, "members", [self.actor.worker]))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.actor!r})"

    async def ping(self) -> int:
        """Returns once the actor is built and answers."""
        return await self.actor.call("ping")

    async def join_sync_group(self, port: int, rank: int, size: int, host: str) -> None:
        """Join the weight-broadcast group (trainer 0 is rank 0; its store at ``host:port``)."""
        await self.actor.call("join_sync_group", port, rank, size, host)

    async def broadcast_weights(self, version: int) -> TimedResult:
        """Take part in the broadcast of ``version`` (trainer 0 sends, generators receive)."""
        return await self.actor.call("broadcast_weights", version)


class ScorerHandle(_Handle):
    """The rewards beside one generator: its scoring actor, or the generator itself."""

    __slots__ = ()

    async def score(self, request: ScoreRequest) -> TimedResult:
        """The rewards of a micro-batch (``Scores``)."""
        return await self.actor.call("score", request)

    async def score_eval(self, request: EvalRequest) -> TimedResult:
        """The rewards of an evaluation batch its generator made (``EvalScores``)."""
        return await self.actor.call("score_eval", request)


class GeneratorHandle(ScorerHandle):
    """A generator (it scores its own micro-batches when no scoring actor is beside it)."""

    __slots__ = ()

    async def generate(self, request: GenerateRequest) -> TimedResult:
        """Make a micro-batch; the value is the policy version that made it."""
        return await self.actor.call("generate", request)

    async def evaluate(self, request: EvalRequest) -> TimedResult:
        """Make an evaluation batch and keep its images for scoring; the value is the
        version that made it."""
        return await self.actor.call("evaluate", request)

    async def pull_weights(self, source: str, version: int) -> TimedResult:
        """Pull ``version`` from ``source`` (trainer 0), behind what the generator runs."""
        return await self.actor.call("pull_weights", source, version)

    async def pull_eval_weights(self, source: str, bucket: int, last: bool) -> None:
        """Pull bucket ``bucket`` of the moving average ``source`` lends; evaluate with it
        after the ``last`` one."""
        await self.actor.call("pull_eval_weights", source, bucket, last)

    async def drop_eval_weights(self) -> None:
        """Evaluate with the generator's own weights again."""
        await self.actor.call("drop_eval_weights")


class TrainerHandle(_Handle):
    """A trainer, or sharded trainers called as one."""

    __slots__ = ()

    async def generate(self, request: GenerateRequest) -> TimedResult:
        """Make a micro-batch at a bubble (TAG); the value is the version that made it."""
        return await self.actor.call("generate", request)

    async def update(self, request: UpdateRequest) -> TimedResult:
        """Forward/backward a micro-batch's kept samples; the value is its ``LossStats``."""
        return await self.actor.call("update", request)

    async def update_group(self, requests: tuple[UpdateRequest, ...]) -> TimedResult:
        """Forward/backward several micro-batches of a group as one update; the value is
        their ``LossStats``."""
        return await self.actor.call("update_group", requests)

    async def step(self, request: StepRequest) -> TimedResult:
        """An optimizer step; the value is ``(version, grad norm)``."""
        return await self.actor.call("step", request)

    async def restore(self, directory: str, version: int) -> None:
        """Continue from the checkpoint in ``directory``."""
        await self.actor.call("restore", directory, version)

    async def write_checkpoint(self, directory: str) -> None:
        """Write the weights and optimizer state into a checkpoint directory."""
        await self.actor.call("write_checkpoint", directory)

    async def save_weights(self, out_dir: str) -> str | None:
        """Save the trained weights into ``out_dir``; where they went."""
        return await self.actor.call("save_weights", out_dir)

    async def trainable_state(self) -> Any:
        """The trained weights, or where trainer 0 saved them (a full fine-tune)."""
        return await self.actor.call("trainable_state")

    async def trained_names(self) -> list[str]:
        """The trained weights' names, in the order weight syncs carry them."""
        return await self.actor.call("trained_names")

    async def lend_ema(self, bucket: int) -> int:
        """Lend bucket ``bucket`` of the moving average; how many buckets it has (0: none)."""
        return await self.actor.call("lend_ema", bucket)

    async def end_lend(self) -> None:
        """The lend is over: free what it held."""
        await self.actor.call("end_lend")
