"""The generator and trainer actors: what runs inside the worker processes.

Each actor wraps a :class:`~digen.runtime.policy.Policy` on its pool's device and knows
nothing about RPC: the actor layer (:mod:`digen.runtime.actors`) calls its methods one at a
time. Methods report the wall-clock span of their own work (:class:`Timed`: ``t0``, ``t1``
from ``time.time()``, one clock for every process on a machine) so the driver can build the
trace.

The data plane (:mod:`digen.runtime.store`): ``generate`` keeps the micro-batch's rollout
and pixels in this process and returns only its version; ``score`` reads the pixels where
they are (here, or from the trainer that made them, actor to actor); ``update`` takes the
rollout from whichever worker holds it, directly. The driver passes keys, rewards and
advantages, never tensors. Weights reach the generators the same way: trainer 0 publishes
them after each optimizer step and every generator pulls them (``weight_sync: rpc``), or
all of them enter one broadcast (``weight_sync: broadcast``).

Trainers are data-parallel among themselves over a gloo (CPU) or NCCL (GPU) group built from
an explicit TCP store, so no process-global default group is needed; they sum gradients
with :class:`~digen.runtime.grads.GradAccumulator` (in micro-batch order by default).

Testing aid: with ``DIGEN_TEST_JITTER_S=x`` in a worker's environment, every generate,
score, update and step call first sleeps a random ``0..x`` seconds, so tests can shuffle
the timing of a run and check that its results do not move.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from digen.algos.rewards import build_reward
from digen.config import DigenConfig, load_config, max_inflight
from digen.runtime.actors import run_sync
from digen.runtime.grads import GradAccumulator
from digen.runtime.outputs import thumbnails
from digen.runtime.policy import LossStats, Policy, SampleKey, TrainItem
from digen.runtime.store import STORE, fetch_pixels, fetch_rollout, fetch_weights

__all__ = ["GeneratorActor", "Scores", "Timed", "TrainerActor", "make_group"]

_JITTER_ENV = "DIGEN_TEST_JITTER_S"


@dataclass(slots=True)
class Timed:
    """A result with the span of the work that made it."""

    value: Any
    t0: float
    t1: float


@dataclass(slots=True)
class Scores:
    """Rewards of one micro-batch's samples, in sample order (plain floats: a few bytes)."""

    total: list[float]
    components: dict[str, list[float]]
    thumbnails: torch.Tensor | None = None
    """Small copies of the samples for the run's sample grid, when asked for."""


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


class _Jitter:
    """Random sleeps before work when ``DIGEN_TEST_JITTER_S`` is set (module docstring)."""

    def __init__(self) -> None:
        self.max_s = float(os.environ.get(_JITTER_ENV, "0") or 0)
        self.rng = random.Random(os.urandom(8))

    def __call__(self) -> None:
        if self.max_s > 0:
            time.sleep(self.rng.uniform(0.0, self.max_s))


class _PolicyActor:
    """What both pools share: a policy copy, generation into the store, weight loading."""

    def __init__(self, cfg: DigenConfig, name: str, *, trainable: bool) -> None:
        _set_threads(cfg.runtime.threads_per_worker)
        self.cfg = cfg
        self.name = name
        self.policy = Policy(cfg, trainable=trainable)
        self.sync_group = None
        self._jitter = _Jitter()
        STORE.capacity = max_inflight(cfg)  # what the driver lets be generated, untrained

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

    def generate(self, step: int, mb: int, keys: Sequence[SampleKey], prompt: str) -> Timed:
        """Sample and decode one trajectory per key with the current weights; keep them here.

        Returns the policy version that made them.
        """
        self._jitter()
        t0 = time.time()
        out = self.policy.generate(keys, [prompt] * len(keys))
        STORE.put((step, mb), out.rollout, out.pixels, self.policy.cached_conditioning(prompt))
        return Timed(out.version, t0, time.time())

    def version(self) -> int:
        return self.policy.version

    def statistics(self) -> dict[str, int]:
        """What this worker's store holds (micro-batches, bytes) and how many prompts it
        encoded itself."""
        return {**STORE.statistics(), "encoded_prompts": self.policy.encoded}

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

    def pull_weights(self, source: str, version: int) -> Timed:
        """Load the weights ``source`` (trainer 0) published as ``version``, actor to actor."""
        t0 = time.time()
        if source == self.name:
            state = STORE.weights(version)
        else:
            state = run_sync(source, fetch_weights, version)
        self._load(state, version)
        return Timed(version, t0, time.time())

    def load_weights(self, state: dict[str, torch.Tensor], version: int) -> Timed:
        """Copy ``state`` (name -> tensor, as :meth:`trainable_state` gives) into the policy."""
        t0 = time.time()
        self._load(state, version)
        return Timed(version, t0, time.time())

    def _load(self, state: dict[str, torch.Tensor], version: int) -> None:
        named = dict(self.policy.adapter.transformer.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                named[name].copy_(value.to(named[name].device, named[name].dtype))
        self.policy.version = version

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

    def __init__(
        self,
        cfg: DigenConfig | dict[str, Any],
        rewards: Sequence[Any] | None = None,
        name: str = "generator-0",
    ) -> None:
        cfg = _pool_config(cfg, "generator")
        super().__init__(cfg, name, trainable=False)
        self.reward = build_reward(list(rewards) if rewards is not None else cfg.rewards)

    def score(
        self,
        step: int,
        mb: int,
        holder: str,
        prompts: Sequence[str],
        metadata: Sequence[dict],
        with_thumbnails: bool = False,
    ) -> Timed:
        """Rewards of micro-batch ``(step, mb)``, whose pixels ``holder`` keeps (here or not)."""
        self._jitter()
        t0 = time.time()
        key = (step, mb)
        if holder == self.name:
            pixels = STORE.take_pixels(key)
        else:
            pixels = run_sync(holder, fetch_pixels, key)
        res = self.reward.score_sync(pixels, prompts, metadata)
        scores = Scores(
            total=res.total.tolist(),
            components={name: v.tolist() for name, v in res.components.items()},
            thumbnails=thumbnails(pixels) if with_thumbnails else None,
        )
        return Timed(scores, t0, time.time())


class TrainerActor(_PolicyActor):
    """Accumulates gradients over update micro-batches; steps once per train step."""

    def __init__(
        self,
        cfg: DigenConfig | dict[str, Any],
        rank: int,
        world: int,
        dp_port: int,
        dp_host: str | None = None,
        name: str | None = None,
    ) -> None:
        """``dp_host``: where trainer 0 serves the data-parallel group's store
        (``runtime.address`` when None)."""
        cfg = _pool_config(cfg, "trainer")
        super().__init__(cfg, name or f"trainer-{rank}", trainable=True)
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
        self.grads = GradAccumulator(self.policy.params, ordered=cfg.train.ordered_grads)
        if rank == 0:
            STORE.publish(self.policy.version, self.policy.trainable_state())

    def update(
        self,
        step: int,
        mb: int,
        holder: str,
        keys: Sequence[SampleKey],
        rows: Sequence[int],
        prompt: str,
        advantages: Sequence[float],
        loss_scale: float,
    ) -> Timed:
        """Forward/backward the samples ``keys`` of micro-batch ``(step, mb)``.

        ``rows``: their positions in the micro-batch, whose rollout ``holder`` keeps;
        ``advantages``: one per key. TSP chunks of ``runtime.tsp_degree`` timesteps.
        """
        self._jitter()
        t0 = time.time()
        key, rows = (step, mb), list(rows)
        if holder == self.name:
            rollout = STORE.take_rollout(key, rows)
        else:  # the prompt's embedding comes along the first time (cheaper than encoding)
            need = self.policy.cached_conditioning(prompt) is None
            rollout, embeds = run_sync(holder, fetch_rollout, key, rows, need)
            if embeds is not None:
                self.policy.add_conditioning(prompt, embeds)
        keys = list(keys)
        adv = torch.tensor(list(advantages), dtype=torch.float32)
        size = self.cfg.train.micro_batch_size
        stats = LossStats()
        with self.grads.micro_batch(mb):
            for i in range(0, len(keys), size):
                part = TrainItem(
                    keys=keys[i : i + size],
                    prompts=[prompt] * len(keys[i : i + size]),
                    rollout=rollout.select(slice(i, i + size)),
                    advantages=adv[i : i + size],
                )
                stats.add(self.policy.accumulate(part, loss_scale, self.cfg.runtime.tsp_degree))
        return Timed(stats, t0, time.time())

    def save_weights(self, out_dir: str) -> str:
        return str(self.policy.save_weights(out_dir))

    def step(self, microbatches: int) -> Timed:
        """Sum the step's gradients over the trainers, clip, step; trainer 0 publishes the
        new weights. Returns ``(version, grad norm)``."""
        self._jitter()
        t0 = time.time()
        self.grads.reduce(microbatches, self.dp_group)
        norm = self.policy.optimizer_step()
        if self.rank == 0:
            STORE.publish(self.policy.version, self.policy.trainable_state())
        return Timed((self.policy.version, norm), t0, time.time())
