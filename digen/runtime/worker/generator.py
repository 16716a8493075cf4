"""The generator actor: samples trajectories with its copy of the policy, keeps them in its
process's store, and scores them when no scoring actor beside it does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from digen.config import DigenConfig
from digen.runtime.messages import TimedResult
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
    (``runtime.score_overlap``, the default)."""

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
        if not cfg.runtime.score_overlap:
            self.scoring = Scoring(self, reward_loop(cfg, rewards))

    def score(self, *args: Any) -> TimedResult:
        """Rewards of a micro-batch (:meth:`~digen.runtime.worker.scorer.Scoring.score`), when
        this generator scores its own."""
        return self._scoring().score(*args)

    def evaluate(
        self, batch: int, keys: Sequence[tuple[int, int]], prompts: Sequence[str]
    ) -> TimedResult:
        """Make evaluation batch ``batch`` (:meth:`~digen.runtime.worker.policy.Policy.evaluate`)
        with the current weights and keep its images here for scoring."""
        t0 = time.time()
        self.store.put_pixels((EVAL_STEP, batch), self.policy.evaluate(keys, prompts))
        return self.timed(self.policy.version, t0)

    def pull_eval_weights(self, source: str, buckets: int) -> None:
        """Evaluate with the moving average ``source`` (trainer 0) lends (``eval.ema``),
        pulled in its ``buckets`` and kept on the host, until called with 0 buckets."""
        if not buckets:
            self.policy.set_eval_weights(None)
            return
        state: dict[str, torch.Tensor] = {}
        for b in range(buckets):
            state.update(run_sync(source, fetch_lent, b))
        self.policy.set_eval_weights(state)

    def score_eval(self, *args: Any) -> TimedResult:
        """Rewards of an evaluation batch (:meth:`~digen.runtime.worker.scorer.Scoring.evaluate`),
        when this generator scores its own."""
        return self._scoring().evaluate(*args)

    def _scoring(self) -> Scoring:
        if self.scoring is None:
            raise RuntimeError(f"{self.name}: its scoring actor scores (runtime.score_overlap)")
        return self.scoring

    def close(self) -> None:
        """The worker is stopping: the reward hooks' ``close()`` where they are here."""
        if self.scoring is not None:
            self.scoring.close()
