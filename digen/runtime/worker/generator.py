"""The generator actor: samples trajectories with its copy of the policy, keeps them in its
process's store, and scores them when no scoring actor beside it does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from digen.config import DigenConfig, load_config
from digen.runtime.messages import EvalRequest, GenerateRequest, ScoreRequest, TimedResult
from digen.runtime.placement import pool_index
from digen.runtime.transport.actors import run_sync
from digen.runtime.transport.groups import make_group, pinned_to_loopback, tcp_store
from digen.runtime.worker.base import PolicyActor, pool_config
from digen.runtime.worker.scorer import EVAL_STEP, Scoring, reward_loop
from digen.runtime.worker.sequence import (
    SequenceParallel,
    apply_cfg_parallel,
    apply_sequence_parallel,
)
from digen.runtime.worker.store import fetch_lent
from digen.sched.names import Pool, member_name, member_of, worker_name

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
        cfg = cfg if isinstance(cfg, DigenConfig) else load_config(base=cfg)
        cfg = pool_config(cfg, *pool_index(cfg, name))
        super().__init__(cfg, name, trainable=False, devices=devices, direct=direct, hosts=hosts)
        self.member = member_of(name)[1]
        """This process's place in its generator (0: the generator itself, which keeps
        what they make; a generator of one device has only that)."""
        self.sequence: SequenceParallel | None = None
        self.scoring = None
        self._eval_pulled: dict[str, torch.Tensor] = {}  # the lent average's buckets so far
        self._eval_next = 0  # the bucket it pulls next
        if not cfg.runtime.schedule.score_overlap:
            self.scoring = Scoring(self, reward_loop(cfg, rewards))

    def join_generation_group(self, port: int, rank: int, host: str) -> None:
        """Join the other processes of this generator (member ``rank``; the first member's
        store at ``host:port``) and split the model over them: ``generator_sequence`` members
        per guidance branch share each sample's tokens (sequence parallelism) and, with
        ``generator_cfg``, member ``c * generator_sequence + s`` runs branch ``c``."""
        placement, rt = self.cfg.runtime.placement, self.cfg.runtime
        seq, size = placement.generator_sequence, placement.generator_group
        lead = member_of(self.name)[0]
        names = [member_name(lead, m) for m in range(size)]
        timeout_s = rt.transport.rpc_timeout_s
        store = tcp_store(host, port, size, lead=rank == 0, timeout=timedelta(seconds=timeout_s))
        branch, place = divmod(rank, seq)

        def group(prefix: str, members: list[int], me: int) -> Any:
            devices = [self.devices.get(names[m], self.device) for m in members]
            machines = [self.hosts.get(names[m], "") for m in members] if self.hosts else None
            sub = dist.PrefixStore(prefix, store)
            return make_group(sub, me, len(members), devices, timeout_s, machines)

        with pinned_to_loopback(host):
            if seq > 1:
                members = [branch * seq + s for s in range(seq)]
                sp_group = group(f"sequence-{branch}", members, place)
                self.sequence = apply_sequence_parallel(self.policy.adapter, sp_group)
            if placement.generator_cfg:
                cfg_group = group(f"cfg-{place}", [place, seq + place], branch)
                apply_cfg_parallel(self.policy.adapter, cfg_group)

    def generate(self, request: GenerateRequest) -> TimedResult:
        """Sample a micro-batch (:meth:`PolicyActor.generate`); a member of a generator of
        several devices computes its share, and the first member alone keeps the result."""
        if self.member == 0:
            return super().generate(request)
        self.jitter()
        t0 = time.time()
        self.policy.encode_ahead(request.prompt, request.ahead)
        out = self._sample(list(request.keys), request.prompt)
        return self.timed(out.version, t0)

    def statistics(self) -> dict[str, Any]:
        """The worker's (:meth:`PolicyActor.statistics`) and, on a generator of several
        devices, the share of the spanning attentions' tokens this process held and the
        guidance branch it runs (None: both)."""
        sp, branch = self.sequence, self.policy.adapter.guidance_branch
        share = sp.tokens_here / sp.tokens if sp is not None and sp.tokens else 1.0
        return {
            **super().statistics(),
            "token_share": share,
            "guidance_branch": None if branch is None else branch.index,
        }

    def score(self, request: ScoreRequest) -> TimedResult:
        """Rewards of a micro-batch (:meth:`~digen.runtime.worker.scorer.Scoring.score`), when
        this generator scores its own."""
        return self._scoring().score(request)

    def evaluate(self, request: EvalRequest) -> TimedResult:
        """Make an evaluation batch (:meth:`~digen.runtime.worker.policy.Policy.evaluate`)
        with the current weights and keep its images here for scoring."""
        t0 = time.time()
        pixels = self.policy.evaluate(list(request.keys), list(request.prompts))
        if self.member == 0:  # (the first of a generator's processes keeps them)
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
