"""The trainer actor: accumulates gradients over update micro-batches and steps once per
mini-batch (once per train step without mini-batches), data-parallel or sharded (FSDP /
HSDP) with the other trainers; after a train step's last optimizer step trainer 0 serves the
new weights.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from digen.algos.rollout import Rollout
from digen.config import DigenConfig, ShardDeal
from digen.runtime.messages import (
    LossStats,
    SampleKey,
    StepRequest,
    TimedResult,
    TrainItem,
    UpdateRequest,
)
from digen.runtime.placement import is_cuda
from digen.runtime.transport.actors import run_sync
from digen.runtime.transport.groups import (
    init_default_group,
    make_group,
    pinned_to_loopback,
    tcp_store,
)
from digen.runtime.worker.base import PolicyActor, pool_config
from digen.runtime.worker.fsdp import (
    full_tensors,
    gather_dealt,
    lockstep_chunks,
    lockstep_terms,
    make_mesh,
)
from digen.runtime.worker.grads import GradAccumulator
from digen.runtime.worker.policy import Generated
from digen.runtime.worker.store import fetch_rollout
from digen.sched.names import Pool, worker_name

__all__ = ["TrainerActor"]


class TrainerActor(PolicyActor):
    """Accumulates gradients over update micro-batches; steps once per mini-batch."""

    def __init__(
        self,
        cfg: DigenConfig | dict[str, Any],
        rank: int,
        world: int,
        dp_port: int,
        dp_host: str | None = None,
        name: str | None = None,
        devices: dict[str, str] | None = None,
        direct: bool = False,
        hosts: dict[str, str] | None = None,
    ) -> None:
        """``dp_host``: where trainer 0 serves the data-parallel group's store
        (``runtime.transport.address`` when None).

        With ``runtime.placement.trainer_parallel`` fsdp or hsdp (and ``world > 1``) the
        trainers shard the transformer over a device mesh and act as one
        (:mod:`digen.runtime.worker.fsdp`): each takes its share of every update's rows, and
        trainer 0 keeps a full copy of the trained weights, gathered after each step, to
        serve, save and return.
        """
        cfg = pool_config(cfg, Pool.TRAINER, rank)
        rt = cfg.runtime
        self.rank, self.world = rank, world
        self.sharded = world > 1 and rt.placement.sharded
        names = [w for w in devices or {} if w.startswith(Pool.TRAINER.value)]
        trainers = [(devices or {})[w] for w in names] or [cfg.model.device]
        machines = [(hosts or {}).get(w, "") for w in names] if hosts and names else None
        host = dp_host or rt.transport.address
        mesh = store = None
        if world > 1:
            timeout = timedelta(seconds=rt.transport.rpc_timeout_s)
            store = tcp_store(host, dp_port, world, lead=rank == 0, timeout=timeout)
        if self.sharded:
            if is_cuda(cfg.model.device):
                torch.cuda.set_device(torch.device(cfg.model.device))
            mesh = _trainer_mesh(cfg, store, rank, world, trainers, host, machines)
        super().__init__(
            cfg,
            name or worker_name(Pool.TRAINER, rank),
            trainable=True,
            devices=devices,
            direct=direct,
            mesh=mesh,
            hosts=hosts,
        )
        self.dp_group = None
        if world > 1 and not self.sharded:
            with pinned_to_loopback(host):
                self.dp_group = make_group(
                    store, rank, world, trainers, rt.transport.rpc_timeout_s, machines
                )
        self.grads = GradAccumulator(self.policy.params, ordered=cfg.train.ordered_grads)
        self._full: dict[str, torch.Tensor] = {}
        """Sharded: trainer 0's full copy of the trained weights (the others hold none)."""
        self._full_old: dict[str, torch.Tensor] = {}
        """Sharded, where the algorithm keeps an old policy: trainer 0's full copy of it
        (what the generators sample with)."""
        self._serving = threading.Lock()
        """Held while the weights trainer 0 serves change (a step) and while a bucket of
        them is copied out: pulls are served on RPC threads, beside the step's."""
        self._changed: torch.cuda.Event | None = None
        """On a GPU: recorded after the served weights last changed; a pull's copy, on the
        stream of its own RPC thread, waits for it."""
        if self.sharded:
            self._gather_full()
        if rank == 0:
            self.store.serve_weights(self._weights_bucket)

    @property
    def _scored_here(self) -> bool:
        return not self.sharded or self.rank == 0

    def _sample(self, keys: list[SampleKey], prompt: str) -> Generated:
        """Sharded (TAG): every member samples every row with its share of the tokens
        (``trainer_sampling`` or ``shard_deal`` ``sequence``); else the rows are dealt over
        the members as an update's are, each sampling every ``T``-th key (a member short of keys samples one only to keep in
        step), then put back together: every member keeps the whole rollout (each trains
        its own rows of it), trainer 0 the pixels too. Each key's noise is its own, so a
        row is the sample one copy of the policy would draw for it."""
        if not self.sharded:
            return super()._sample(keys, prompt)
        sp = self.policy.sequence
        if sp is not None:  # every member samples every row, with its share of the tokens
            was, sp.active = sp.active, True
            try:
                made = super()._sample(keys, prompt)
            finally:
                sp.active = was
            return made if self.rank == 0 else dataclasses.replace(made, pixels=None)
        (rows,) = lockstep_chunks(len(keys), self.world, self.rank, len(keys))
        made = super()._sample([keys[i] for i in rows or [0]], prompt)
        n = len(keys)
        part = made.rollout.for_training(final=self.policy.algorithm.trains_on == "final")
        rollout = part.map(lambda t: gather_dealt(t, n))
        pixels = gather_dealt(made.pixels, n, lead_only=True)
        return dataclasses.replace(made, keys=keys, rollout=rollout, pixels=pixels)

    def _holds(self, holder: str) -> bool:
        """Whether ``holder``'s micro-batch is in this process (sharded trainers all made
        their own copy of what trainer 0, the pool as one, generated)."""
        return holder == self.name or (self.sharded and holder == worker_name(Pool.TRAINER, 0))

    def _gather_full(self) -> None:
        """Sharded: every trainer gathers, one tensor at a time, the weights generators
        sample with (the trained ones, or the old policy where the algorithm keeps one);
        trainer 0 keeps them (on the CPU: a full copy need not fit next to the shards). It
        holds one full copy: trained weights kept beside an old policy are gathered only
        when saved (:meth:`_trained_full`)."""
        lead = self.rank == 0
        if self.policy.old is None:
            named = self.policy.synced_parameters()
            self._full = full_tensors(named, keep=lead, into=self._full)
        else:  # kept in fp32, served in the dtype it travels in: kept in that one
            named_old = self.policy.sampling_parameters()
            self._full_old = full_tensors(
                named_old, keep=lead, into=self._full_old, dtypes=self._wire_dtypes
            )

    def _trained_full(self) -> dict[str, torch.Tensor]:
        """Sharded: the trained weights in full on trainer 0 (every trainer calls at once)."""
        if self.policy.old is None:
            return self._full
        return full_tensors(self.policy.synced_parameters(), keep=self.rank == 0)

    def _synced(self) -> list[tuple[str, torch.Tensor]]:
        if self.sharded:
            full = self._full if self.policy.old is None else self._full_old
            return list(full.items())
        return super()._synced()

    def lend_ema(self, bucket: int) -> int:
        """Lend bucket ``bucket`` of the moving average evaluation samples with
        (``eval.ema``) to the generators, which pull it from trainer 0
        (:func:`~digen.runtime.worker.store.fetch_lent`; it never passes through the
        driver), one bucket after another: trainer 0 holds one bucket of it on the host at a
        time, beside the full copy it serves, until :meth:`end_lend`. Sharded trainers all
        call at once, gathering the bucket. It is lent in the dtypes weights travel in (kept
        in fp32, it lands in a bf16 model's weights as bf16: lent so, the same bits at half
        the bytes). Returns the bucket count (0: no average kept here)."""
        state = self.policy.ema_state()
        if state is None:
            return 0
        named = list(state.items())  # the synced parameters' names, in their order
        buckets = self._buckets_of([t for _, t in named])  # by the whole tensors' sizes
        picked = buckets[bucket]
        dtypes = [self._wire_dtypes[i] for i in picked]
        if self.sharded:
            lent = full_tensors([named[i] for i in picked], keep=self.rank == 0, dtypes=dtypes)
            if self.rank != 0:
                return len(buckets)
        else:
            lent = {
                named[i][0]: named[i][1].detach().to("cpu", d, copy=True)
                for i, d in zip(picked, dtypes, strict=True)
            }
        self.store.lend(bucket, lent)
        return len(buckets)

    def end_lend(self) -> None:
        """The evaluation is over: drop the lent copy."""
        self.store.lend()

    def statistics(self) -> dict[str, Any]:
        """The worker's (:meth:`PolicyActor.statistics`), how many full copies of the model
        it keeps between steps (sharded: trainer 0's gathered one, what it serves), and the
        share of the tokens it held (below 1 with sequence parallelism)."""
        sp = self.policy.sequence
        return {
            **super().statistics(),
            "full_copies": sum(map(bool, (self._full, self._full_old))),
            # sequence parallel: the share of the spanning attentions' tokens this member held
            "token_share": sp.tokens_here / sp.tokens if sp is not None and sp.tokens else 1.0,
        }

    def trainable_state(self) -> dict[str, torch.Tensor] | None:
        """Name -> CPU copy of the trained weights: trainer 0's (sharded trainers all call
        at once, gathering them; the others return None)."""
        if not self.sharded:
            return super().trainable_state()
        state = self._trained_full()
        if self.rank != 0:
            return None
        return {k: v.clone() for k, v in state.items()} if state is self._full else state

    def _weights_bucket(self, version: int, bucket: int, wire: str | None) -> dict[str, Any]:
        """A copy of bucket ``bucket`` of the weights of ``version`` (served on an RPC
        thread: the weights change only at :meth:`step`, and no pull overlaps a step; a copy
        all the same, so what is sent cannot change while it is in flight)."""
        with self._serving:
            if self.policy.version != version:
                raise RuntimeError(
                    f"weights of version {version} were asked for; trainer 0 holds "
                    f"{self.policy.version}"
                )
            if self._changed is not None:
                torch.cuda.current_stream().wait_event(self._changed)
            named, dtypes = self._synced(), self._wire_dtypes
            return {
                named[i][0]: named[i][1].detach().to(wire or self.device, dtypes[i], copy=True)
                for i in self._buckets()[bucket]
            }

    def update(self, request: UpdateRequest) -> TimedResult:
        """Forward/backward the samples of a micro-batch
        (:class:`~digen.runtime.messages.UpdateRequest`), in TSP chunks of
        ``runtime.schedule.tsp_degree`` timesteps; returns their ``LossStats``. Sharded
        trainers deal it over their members by samples, or by (sample, timestep) terms
        (``runtime.placement.shard_deal``)."""
        return self.update_group((request,))

    def update_group(self, requests: Sequence[UpdateRequest]) -> TimedResult:
        """Forward/backward several micro-batches of one prompt group, made by one version,
        as one update (``runtime.schedule.group_updates``): their rows are dealt over the
        members together, so each pass is fuller and the gathers fewer; their gradient is
        the first micro-batch's in the ordered sum. One request is :meth:`update`."""
        self.jitter()
        t0 = time.time()
        first = requests[0]
        if any(
            (r.step, r.prompt, r.made_by, r.loss_scale)
            != (first.step, first.prompt, first.made_by, first.loss_scale)
            for r in requests
        ):
            raise ValueError("an update group's micro-batches share a step, prompt and version")
        keys = [k for r in requests for k in r.keys]
        # the group's rows, each as (request, row of its micro-batch)
        where = [(q, row) for q, r in enumerate(requests) for row in r.rows]
        size = self.cfg.train.micro_batch_size
        tsp = self.cfg.runtime.schedule.tsp_degree
        members, me = (self.world, self.rank) if self.sharded else (1, 0)
        if self._by_sequence:  # the members act as one, each with its share of the tokens
            members, me = 1, 0
        by_terms = members > 1 and self.cfg.runtime.placement.shard_deal == ShardDeal.TERMS
        if by_terms:
            k = len(
                self.policy.algorithm.trained_positions(self.cfg, *dataclasses.astuple(keys[0]))
            )
            chunks: list[Any] = lockstep_terms(len(keys), k, members, me, size * tsp)
            mine = sorted({i for c in chunks if c is not None for i, _ in c})
        else:
            chunks = lockstep_chunks(len(keys), members, me, size)
            mine = [i for c in chunks if c is not None for i in c]
        mine = mine or [0]  # the group's rows this member fetches (one to keep in step)
        rollout = self._fetch(requests, [where[i] for i in mine])
        at = {i: j for j, i in enumerate(mine)}  # group's row -> row of ``rollout``
        adv = torch.tensor(
            [a for r in requests for a in r.advantages], dtype=torch.float32, device=self.device
        )
        loss_scale, version = first.loss_scale, first.made_by
        stats = LossStats()
        with self.grads.micro_batch(first.mb):
            if by_terms:  # every pass trains terms of the rows this member fetched
                part = TrainItem(
                    keys=[keys[i] for i in mine],
                    prompts=[first.prompt] * len(mine),
                    rollout=rollout,
                    advantages=adv[mine],
                    version=version,
                )
            for chunk in chunks:
                # a chunk this member runs only to keep in step adds nothing (scale 0)
                scale = loss_scale if chunk is not None else 0.0
                if by_terms:
                    terms = [(at[i], j) for i, j in chunk] if chunk is not None else [(0, 0)]
                    got = self.policy.accumulate(part, scale, terms=terms)
                else:
                    idx = chunk if chunk is not None else mine[:1]
                    part = TrainItem(
                        keys=[keys[i] for i in idx],
                        prompts=[first.prompt] * len(idx),
                        rollout=rollout.select(torch.tensor([at[i] for i in idx])),
                        advantages=adv[idx],
                        version=version,
                    )
                    got = self.policy.accumulate(part, scale, tsp)
                if chunk is not None:
                    stats.add(got)
        if self._by_sequence and self.rank != 0:
            stats = LossStats()  # the group's stats are member 0's (each member has them all)
        return self.timed(stats, t0)

    @property
    def _by_sequence(self) -> bool:
        """Sharded trainers that split each sample's tokens over the members
        (``runtime.placement.shard_deal: sequence``)."""
        return self.sharded and self.cfg.runtime.placement.shard_deal == ShardDeal.SEQUENCE

    def _fetch(self, requests: Sequence[UpdateRequest], rows: Sequence[tuple[int, int]]) -> Any:
        """The rollout rows ``(request, row of its micro-batch)`` of an update, in that order
        (grouped by request), on this trainer's device: taken where each micro-batch is held
        (this process, or its holder, with the prompt's embedding the first time). A sharded
        member takes a row of each micro-batch it needs none of, so that the holder, which
        counts its takers, lets go of it; that row is not kept."""
        parts = []
        for q, r in enumerate(requests):
            picked = [row for i, row in rows if i == q]
            key, holder = (r.step, r.mb), r.holder
            take = picked or [r.rows[0]]
            if self._holds(holder):
                got = self.store.take_rollout(key, take)
            else:
                takers = self.world if self.sharded else 1
                need = self.policy.cached_conditioning(r.prompt) is None
                wire = self.wire_from(holder)
                got, embeds = run_sync(holder, fetch_rollout, key, take, need, wire, takers)
                if embeds is not None:
                    self.policy.add_conditioning(r.prompt, embeds)
            if picked:
                parts.append(got)
        rollout = parts[0] if len(parts) == 1 else Rollout.cat(parts)
        return rollout.to(self.device)

    def write_checkpoint(self, directory: str) -> None:
        """Write the weights and optimizer state into a checkpoint directory: trainer 0
        (replicated trainers hold the same), or every sharded trainer its shards."""
        self.policy.write_checkpoint(directory, lead=self.rank == 0)

    def restore(self, directory: str, version: int) -> None:
        """Continue from the checkpoint in ``directory`` (every trainer loads it; sharded
        ones their shards, whatever the trainer count that wrote it)."""
        self.policy.load_checkpoint(directory, version)
        if self.sharded:
            self._gather_full()

    def save_weights(self, out_dir: str) -> str | None:
        """Save the trained weights into ``out_dir``: trainer 0 (sharded trainers all call
        at once, gathering them; the others return None)."""
        if not self.sharded:
            return str(self.policy.save_weights(out_dir))
        state = self._trained_full()
        return str(self.policy.save_weights(out_dir, state)) if self.rank == 0 else None

    def step(self, request: StepRequest) -> TimedResult:
        """Sum the gradients of ``request.microbatches`` (the train step's, or one
        mini-batch's) over the trainers, clip, step; ``request.last``: the train step's last
        optimizer step, which bumps the version. Returns ``(version, grad norm)``; after the
        last, trainer 0 serves the new weights."""
        self.jitter()
        t0 = time.time()
        last = request.last
        self.policy.set_step_lr(self.policy.version)  # version == the train step here
        self.grads.reduce(request.microbatches, self.dp_group)
        with self._serving:  # no pull reads the weights, or the old policy, half-changed
            norm = self.policy.optimizer_step()
            if last:
                self.policy.finish_step()
                if self.sharded:
                    self._gather_full()
            if is_cuda(self.device):
                self._changed = torch.cuda.Event()
                self._changed.record()
        return self.timed((self.policy.version, norm), t0)


def _trainer_mesh(
    cfg: DigenConfig,
    store: Any,
    rank: int,
    world: int,
    devices: Sequence[str],
    host: str,
    machines: Sequence[str] | None = None,
) -> Any:
    """The sharded trainers' device mesh, over a default process group of the trainers
    (they are the only members of this process's default group)."""
    kinds = {"cuda" if is_cuda(d) else "cpu" for d in devices}
    if len(kinds) > 1:
        raise ValueError(
            f"runtime.placement.trainer_parallel={cfg.runtime.placement.trainer_parallel} needs "
            f"every trainer on the same kind of device, not {sorted(kinds)}"
        )
    with pinned_to_loopback(host):
        init_default_group(
            store, rank, world, devices, cfg.runtime.transport.rpc_timeout_s, machines
        )
    return make_mesh(
        cfg.runtime.placement.trainer_parallel, world, kinds.pop(), cfg.runtime.placement.shard_size
    )
