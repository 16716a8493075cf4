"""The generator and trainer actors: what runs inside the worker processes.

Each actor wraps a :class:`~digen.runtime.policy.Policy` on its pool's device. Methods take
and return plain data (dataclasses of CPU tensors), report the wall-clock span of their own
work (``t0``, ``t1`` from ``time.time()``, one clock for every process on a machine) so the
driver can build the trace, and know nothing about RPC: the actor layer
(:mod:`digen.runtime.actors`) calls them and serialises calls to one actor.

Trainers are data-parallel among themselves over a gloo (CPU) or NCCL (GPU) group built from
an explicit TCP store, so no process-global default group is needed. The same kind of group
joins trainer 0 and the generators when weights are synced by broadcast.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from digen.algos.rewards import build_reward
from digen.config import DigenConfig, load_config
from digen.runtime.policy import Policy, SampleKey, StepStats, TrainItem

__all__ = ["GeneratorActor", "TrainerActor", "Timed", "make_group"]


@dataclass(slots=True)
class Timed:
    """A result with the span of the work that made it."""

    value: Any
    t0: float
    t1: float


def make_group(address: str, port: int, rank: int, size: int, device: str, timeout_s: float):
    """A process group of ``size`` members over its own TCP store (no default group)."""
    store = dist.TCPStore(
        address, port, size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s)
    )
    if device.startswith("cuda") and torch.cuda.is_available():
        opts = dist.ProcessGroupNCCL.Options()
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout_s))


def _pool_config(cfg: DigenConfig | dict[str, Any], pool: str) -> DigenConfig:
    """The run's config with ``model.device`` / ``model.dtype`` set to this pool's own."""
    cfg = cfg if isinstance(cfg, DigenConfig) else load_config(base=cfg)
    device = getattr(cfg.runtime, f"{pool}_device") or cfg.model.device
    dtype = getattr(cfg.runtime, f"{pool}_dtype") or cfg.model.dtype
    model = dataclasses.replace(cfg.model, device=device, dtype=dtype)
    return dataclasses.replace(cfg, model=model)


def _set_threads(n: int) -> None:
    torch.set_num_threads(n)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    # a worker's loading bars would interleave with the driver's progress bar
    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


class _PolicyActor:
    """What both pools share: a policy copy, weight loading, and the broadcast group."""

    def __init__(self, cfg: DigenConfig, *, trainable: bool) -> None:
        _set_threads(cfg.runtime.threads_per_worker)
        self.cfg = cfg
        self.policy = Policy(cfg, trainable=trainable)
        self.sync_group = None

    def ping(self) -> int:
        return os.getpid()

    def join_sync_group(self, port: int, rank: int, size: int, host: str | None = None) -> None:
        """Join the weight-broadcast group (trainer 0 is rank 0; its store at ``host``)."""
        self.sync_group = make_group(
            host or self.cfg.runtime.address,
            port,
            rank,
            size,
            self.cfg.model.device,
            self.cfg.runtime.rpc_timeout_s,
        )

    def generate(self, keys: Sequence[SampleKey], prompts: Sequence[str]) -> Timed:
        """Sample and decode one trajectory per key with the current weights."""
        t0 = time.time()
        out = self.policy.generate(keys, prompts)
        return Timed(out, t0, time.time())

    def version(self) -> int:
        return self.policy.version

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return self.policy.trainable_state()

    def broadcast_weights(self, version: int) -> Timed:
        """Enter the weight broadcast (every member at once): trainer 0 sends, others receive."""
        t0 = time.time()
        params = [p for _, p in self.policy.synced_parameters()]
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in params])
        self.sync_group.broadcast(flat, 0).wait()
        self._unflatten_into(params, flat)
        self.policy.version = version
        return Timed(version, t0, time.time())

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> Timed:
        """Copy ``state`` (name -> tensor, as :meth:`trainable_state` gives) into the policy."""
        t0 = time.time()
        named = dict(self.policy.adapter.transformer.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                named[name].copy_(value.to(named[name].device, named[name].dtype))
        self.policy.version = version
        return Timed(version, t0, time.time())

    @staticmethod
    def _unflatten_into(params: list[torch.nn.Parameter], flat: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in params:
                n = p.numel()
                p.copy_(flat[offset : offset + n].view_as(p).to(p.device, p.dtype))
                offset += n


class GeneratorActor(_PolicyActor):
    """Samples trajectories and scores them (rewards run on the generator pool)."""

    def __init__(self, cfg: DigenConfig | dict[str, Any], rewards: Sequence[Any] | None = None):
        cfg = _pool_config(cfg, "generator")
        super().__init__(cfg, trainable=False)
        self.reward = build_reward(list(rewards) if rewards is not None else cfg.rewards)

    def score(
        self, pixels: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict]
    ) -> Timed:
        """Rewards of decoded samples: ``(total [B], {component: [B]})``."""
        t0 = time.time()
        res = self.reward.score_sync(pixels, prompts, metadata)
        return Timed((res.total, res.components), t0, time.time())


class TrainerActor(_PolicyActor):
    """Accumulates gradients over update micro-batches; steps once per train step."""

    def __init__(
        self,
        cfg: DigenConfig | dict[str, Any],
        rank: int,
        world: int,
        dp_port: int,
        dp_host: str | None = None,
    ) -> None:
        """``dp_host``: where trainer 0 serves the data-parallel group's store
        (``runtime.address`` when None)."""
        cfg = _pool_config(cfg, "trainer")
        super().__init__(cfg, trainable=True)
        self.rank, self.world = rank, world
        self.dp_group = None
        if world > 1:
            self.dp_group = make_group(
                dp_host or cfg.runtime.address,
                dp_port,
                rank,
                world,
                cfg.model.device,
                cfg.runtime.rpc_timeout_s,
            )

    def update(self, item: TrainItem, loss_scale: float) -> Timed:
        """Forward/backward ``item`` (TSP chunks of ``runtime.tsp_degree`` timesteps)."""
        t0 = time.time()
        mb = self.cfg.train.micro_batch_size
        stats = StepStats()
        for i in range(0, len(item.keys), mb):
            rows = slice(i, i + mb)
            part = TrainItem(
                keys=item.keys[rows],
                prompts=item.prompts[rows],
                rollout=item.rollout.select(rows),
                advantages=item.advantages[rows],
            )
            stats.add(self.policy.accumulate(part, loss_scale, self.cfg.runtime.tsp_degree))
        return Timed(stats, t0, time.time())

    def save_weights(self, out_dir: str) -> str:
        return str(self.policy.save_weights(out_dir))

    def step(self) -> Timed:
        """All-reduce gradients over the trainers, clip, step. Returns ``(version, grad norm)``."""
        t0 = time.time()
        if self.dp_group is not None:
            grads = self.policy.grads()
            flat = torch.cat([g.reshape(-1).float() for g in grads])
            self.dp_group.allreduce([flat]).wait()
            self._unflatten_grads(flat)
        norm = self.policy.optimizer_step()
        return Timed((self.policy.version, norm), t0, time.time())

    def _unflatten_grads(self, flat: torch.Tensor) -> None:
        offset = 0
        for p in self.policy.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n
