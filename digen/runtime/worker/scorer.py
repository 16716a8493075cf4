"""The scoring actor: the rewards of one generator's micro-batches, in its process, and the
:class:`Scoring` it and a generator that scores its own samples hold.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from digen.config import DigenConfig
from digen.rewards.judge import judge
from digen.rewards.loop import RewardLoop
from digen.rewards.scoring import build_reward
from digen.runtime.messages import (
    EvalRequest,
    EvalScores,
    ScoreRequest,
    Scores,
    TimedResult,
    thumbnails,
)
from digen.runtime.transport.actors import run_sync
from digen.runtime.worker.base import WorkerActor, pool_config
from digen.runtime.worker.store import fetch_pixels
from digen.sched.names import Pool, index_of, worker_name

__all__ = ["EVAL_STEP", "ScorerActor", "Scoring", "eval_scores", "reward_loop"]

EVAL_STEP = -1
"""The step of an evaluation's images in a store's keys ``(EVAL_STEP, batch)``: never a
train step's."""


def reward_loop(cfg: DigenConfig, rewards: Sequence[Any] | None) -> RewardLoop:
    """The run's rewards, set up here once, every score of the run on one event loop."""
    hooks = list(rewards) if rewards is not None else cfg.rewards
    return RewardLoop(build_reward(hooks, cfg.train.on_nonfinite), device=cfg.model.device)


def eval_scores(rewards: Any, pixels: Any, prompts: Sequence[str]) -> EvalScores:
    """Evaluation images scored: ``rewards`` (the run's rewards' result on ``pixels``) and,
    where the prompts have a rule, each image judged (:func:`digen.rewards.judge.judge`)."""
    judged = judge(pixels, prompts)
    return EvalScores(
        total=rewards.total.tolist(),
        components={name: v.tolist() for name, v in rewards.components.items()},
        passed=judged.passed if judged else None,
        groups=judged.groups if judged else None,
        thumbnails=thumbnails(pixels),
    )


class Scoring:
    """The run's rewards in a generator's process, and scoring a micro-batch with them.

    Held by the actor that scores there: the generator's :class:`ScorerActor`
    (``runtime.schedule.score_overlap``, the default) or else the generator itself.
    """

    def __init__(self, actor: WorkerActor, rewards: RewardLoop) -> None:
        self.actor, self.rewards = actor, rewards

    def close(self) -> None:
        """The worker is stopping: the hooks' ``close()``."""
        self.rewards.close()

    def score(self, request: ScoreRequest) -> TimedResult:
        """Rewards of micro-batch ``(step, mb)``, whose pixels ``request.holder`` keeps (here
        or not)."""
        actor, holder = self.actor, request.holder
        actor.jitter()
        t0 = time.time()
        key = (request.step, request.mb)
        if holder == actor.name:
            pixels = actor.store.take_pixels(key)
        else:
            pixels = run_sync(holder, fetch_pixels, key, actor.wire_from(holder))
        pixels = pixels.cpu()  # rewards take uint8 images on the CPU
        res = self.rewards.score(pixels, list(request.prompts), list(request.metadata))
        scores = Scores(
            total=res.total.tolist(),
            components={name: v.tolist() for name, v in res.components.items()},
            latency_s=res.latency_s,
            thumbnails=thumbnails(pixels) if request.thumbnails else None,
        )
        return actor.timed(scores, t0)

    def evaluate(self, request: EvalRequest) -> TimedResult:
        """Score an evaluation batch whose images this process's generator made
        (:meth:`~digen.runtime.worker.generator.GeneratorActor.evaluate`)."""
        t0 = time.time()
        pixels = self.actor.store.take_pixels((EVAL_STEP, request.batch)).cpu()
        prompts = list(request.prompts)
        res = self.rewards.score(pixels, prompts, list(request.metadata))
        return self.actor.timed(eval_scores(res, pixels, prompts), t0)


class ScorerActor(WorkerActor):
    """The rewards of one generator's micro-batches, in the generator's process.

    An actor of its own (its own thread), so scoring runs beside generation: a slow reward
    never holds up the generator's next micro-batch. It reads the pixels its generator left
    in this process's store, or fetches those a trainer made (TAG). The hooks' ``setup()``
    runs here once, every score of the run runs on the same event loop
    (:class:`~digen.rewards.loop.RewardLoop`), and ``close()`` at the stop.
    """

    def __init__(
        self,
        cfg: DigenConfig | dict[str, Any],
        rewards: Sequence[Any] | None = None,
        name: str = worker_name(Pool.GENERATOR, 0),
        devices: dict[str, str] | None = None,
        direct: bool = False,
        hosts: dict[str, str] | None = None,
    ) -> None:
        cfg = pool_config(cfg, Pool.GENERATOR, max(index_of(name), 0))
        super().__init__(cfg, name, devices, direct, hosts)  # the generator's name: its process
        self.scoring = Scoring(self, reward_loop(cfg, rewards))

    def score(self, request: ScoreRequest) -> TimedResult:
        """Rewards of a micro-batch (:meth:`Scoring.score`)."""
        return self.scoring.score(request)

    def score_eval(self, request: EvalRequest) -> TimedResult:
        """Rewards of an evaluation batch (:meth:`Scoring.evaluate`)."""
        return self.scoring.evaluate(request)

    def close(self) -> None:
        self.scoring.close()
