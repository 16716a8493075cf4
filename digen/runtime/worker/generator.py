"""The generator actor: samples trajectories with its copy of the policy, keeps them in its
process's store, and scores them when no scoring actor beside it does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from digen.config import DigenConfig
from digen.runtime.messages import EvalRequest, ScoreRequest, TimedResult
from digen.runtime.transport.actors import run_sync
from digen.runtime.worker.base import PolicyActor, pool_config
from digen.runtime.worker.scorer import EVAL_STEP, Scoring, reward_loop
from digen.runtime.worker.store import fetch_lent
from digen.sched.names import Pool, index_of, worker_name

if TYPE_CHECKING:
    import torch

__all__ = ["GeneratorActor"]


class GeneratorActor(PolicyActor):
    """Samples trajectories; scores them too, unless its
    :class:`~digen.runtime.worker.scorer.ScorerActor` does
    (``runtime.schedule.score_overlap``, the default)."""

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
        super().__init__(cfg, name, trainable=False, devices=devices, direct=direct, hosts=hosts)
        self.scoring = None
        self._eval_pulled: dict[str, torch.Tensor] = {}  # the lent average's buckets so far
        self._eval_next = 0  # the bucket it pulls next
        if not cfg.runtime.schedule.score_overlap:
            self.scoring = Scoring(self, reward_loop(cfg, rewards))

    def score(self, request: ScoreRequest) -> TimedResult:
        """Rewards of a micro-batch (:meth:`~digen.runtime.worker.scorer.Scoring.score`), when
        this generator scores its own."""
        return self._scoring().score(request)

    def evaluate(self, request: EvalRequest) -> TimedResult:
        """Make an evaluation batch (:meth:`~digen.runtime.worker.policy.Policy.evaluate`)
        with the current weights and keep its images here for scoring."""
        t0 = time.time()
        pixels = self.policy.evaluate(list(request.keys), list(request.prompts))
        self.store.put_pixels((EVAL_STEP, request.batch), pixels)
        return self.timed(self.policy.version, t0)

    def pull_eval_weights(self, source: str, bucket: int, last: bool) -> None:
        """Pull bucket ``bucket`` of the moving average ``source`` (trainer 0) lends
        (``eval.ema``: it lends one at a time) and keep it on the host; after the ``last``
        one, evaluate with it until :meth:`drop_eval_weights`."""
        if bucket == 0:
            self._eval_pulled, self._eval_next = {}, 0
        if bucket != self._eval_next:
            raise RuntimeError(
                f"{self.name} was lent bucket {bucket} of the moving average without the "
                "ones before it"
            )
        self._eval_pulled.update(run_sync(source, fetch_lent, bucket))
        self._eval_next += 1
        if last:
            state, self._eval_pulled = self._eval_pulled, {}
            self.policy.set_eval_weights(state)

    def drop_eval_weights(self) -> None:
        """Evaluate with the generator's own weights again."""
        self._eval_pulled = {}
        self.policy.set_eval_weights(None)

    def score_eval(self, request: EvalRequest) -> TimedResult:
        """Rewards of an evaluation batch (:meth:`~digen.runtime.worker.scorer.Scoring.evaluate`),
        when this generator scores its own."""
        return self._scoring().evaluate(request)

    def _scoring(self) -> Scoring:
        if self.scoring is None:
            raise RuntimeError(
                f"{self.name}: its scoring actor scores (runtime.schedule.score_overlap)"
            )
        return self.scoring

    def close(self) -> None:
        """The worker is stopping: the reward hooks' ``close()`` where they are here."""
        if self.scoring is not None:
            self.scoring.close()
