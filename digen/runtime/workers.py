"""The generator, scorer and trainer actors: what runs inside the worker processes.

Each actor wraps a :class:`~digen.runtime.policy.Policy` on its own device
(:mod:`digen.runtime.driver.placement`: ``torch.cuda.set_device`` on a GPU) and knows nothing about
RPC: the actor layer (:mod:`digen.runtime.actors`) calls its methods one at a time. Methods
report the wall-clock span of their own work and the process's peak memory so far
(:class:`TimedResult`) so the driver can build the trace and the metrics.

The data plane (:mod:`digen.runtime.store`): ``generate`` keeps the micro-batch's rollout
and pixels in this process and returns only its version; ``score`` (on the
:class:`ScorerActor` beside each generator, its own thread) reads the pixels where they are
(here, or from the trainer that made them, actor to actor); ``update`` takes the
rollout from whichever worker holds it, directly. Between two GPU workers tensors travel
GPU to GPU (device maps); otherwise the sender stages them on the CPU. Every method moves
what it receives onto its own device before using it. The driver passes keys, rewards and
advantages, never tensors.

Weights reach the generators in buckets of at most ``runtime.sync_bucket_mb``: each
generator pulls them from trainer 0 (``weight_sync: rpc``; trainer 0 serves them from its
live parameters, no full copy), or trainer 0 and the generators enter one broadcast per
bucket (``weight_sync: broadcast``; NCCL when every member is on a GPU, else gloo through
the CPU). Where the pools hold different dtypes, weights travel in fp32.

Trainers are data-parallel among themselves over a gloo (CPU) or NCCL (GPU) group built from
an explicit TCP store, so no process-global default group is needed; they sum gradients
with :class:`~digen.runtime.grads.GradAccumulator` (in micro-batch order by default).

Testing aid: with ``DIGEN_TEST_JITTER_S=x`` in a worker's environment, every generate,
score, update and step call first sleeps a random ``0..x`` seconds, so tests can shuffle
the timing of a run and check that its results do not move.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import torch
import torch.distributed as dist

from digen.config import DigenConfig, load_config, schedule_plan
from digen.rewards.loop import RewardLoop
from digen.rewards.scoring import build_reward
from digen.runtime.actors import run_sync
from digen.runtime.driver.placement import is_cuda, peak_memory_gb, worker_device
from digen.runtime.fsdp import full_tensors, is_sharded, lockstep_chunks, make_mesh
from digen.runtime.grads import GradAccumulator
from digen.runtime.groups import init_default_group, make_group, pinned_to_loopback, tcp_store
from digen.runtime.messages import (
    NOTES_ENV,
    LossStats,
    SampleKey,
    Scores,
    TimedResult,
    TrainItem,
    thumbnails,
)
from digen.runtime.policy import Policy
from digen.runtime.store import STORE, fetch_pixels, fetch_rollout, fetch_weights
from digen.sched.names import Pool, index_of, worker_name

__all__ = [
    "GeneratorActor",
    "TrainerActor",
    "weight_buckets",
]

_JITTER_ENV = "DIGEN_TEST_JITTER_S"


def weight_buckets(params: Sequence[torch.Tensor], max_numel: int) -> list[list[int]]:
    """Indices of ``params`` cut into consecutive buckets of at most ``max_numel`` elements
    (a larger tensor gets a bucket of its own). Every copy of the policy cuts the same."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i, p in enumerate(params):
        if buckets[-1] and size + p.numel() > max_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += p.numel()
    return buckets


def _pool_config(cfg: DigenConfig | dict[str, Any], pool: str, index: int = 0) -> DigenConfig:
    """The run's config with ``model.device`` / ``model.dtype`` set to this worker's own."""
    cfg = cfg if isinstance(cfg, DigenConfig) else load_config(base=cfg)
    device = worker_device(cfg, pool, index)
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


class _NotesToRunLog(logging.Handler):
    """digen's notes in a worker process (``logging.getLogger("digen")``: a prompt the text
    encoder truncates, ...) as lines of the run's log, in the driver's format, naming the
    worker; appended line by line, so workers and driver share the file."""

    def __init__(self, path: str, worker: str) -> None:
        super().__init__(logging.INFO)
        self.path, self.worker = path, worker

    def emit(self, record: logging.LogRecord) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        line = {"text": record.getMessage(), "source": record.name, "worker": self.worker}
        line |= {"event": "note", "level": "info", "timestamp": now}
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")
        except OSError:
            self.handleError(record)


_NOTES_LOCK = threading.Lock()
"""The generator's and its scorer's actors are built on threads of their own, at once."""


def _notes_to_run_log(worker: str) -> None:
    """Once per process: send digen's notes to the run's log when the driver named one."""
    path = os.environ.get(NOTES_ENV)
    notes = logging.getLogger("digen")
    with _NOTES_LOCK:
        if path and not any(isinstance(h, _NotesToRunLog) for h in notes.handlers):
            notes.addHandler(_NotesToRunLog(path, worker))


class _Placed:
    """What every actor of a worker process has: its worker's name and device, how peers
    send it tensors, and its replies' timing.

    ``devices``: every worker's device by name, and ``direct``: whether GPU workers exchange
    tensors GPU to GPU (the actor layer was given device maps); both from the cluster.
    """

    def __init__(
        self, cfg: DigenConfig, name: str, devices: dict[str, str] | None, direct: bool
    ) -> None:
        _notes_to_run_log(name)
        self.name = name
        self.device = cfg.model.device
        if is_cuda(self.device):  # this actor's thread (the current CUDA device is per thread)
            torch.cuda.set_device(torch.device(self.device))
        self.devices = devices or {}
        self.direct = direct
        self._jitter = _Jitter()

    def ping(self) -> int:
        return os.getpid()

    def _timed(self, value: Any, t0: float) -> TimedResult:
        return TimedResult(value, t0, time.time(), peak_memory_gb(self.device))

    def _wire_from(self, peer: str) -> str | None:
        """How ``peer`` must send tensors to this worker: as they are, or staged on the CPU."""
        direct = self.direct and is_cuda(self.device) and is_cuda(self.devices.get(peer, "cpu"))
        return None if direct else "cpu"


class _PolicyActor(_Placed):
    """What both pools share: a policy copy on its device, generation into the store, weights."""

    def __init__(
        self,
        cfg: DigenConfig,
        name: str,
        *,
        trainable: bool,
        devices: dict[str, str] | None = None,
        direct: bool = False,
        mesh: Any = None,
    ) -> None:
        _set_threads(cfg.runtime.threads_per_worker)
        _Placed.__init__(self, cfg, name, devices, direct)
        self.cfg = cfg
        self.policy = Policy(cfg, trainable=trainable, mesh=mesh)
        self.sync_group = None
        # what the driver lets be generated and not yet trained (C_gen)
        STORE.capacity = schedule_plan(cfg).admission.max_inflight

    def join_sync_group(self, port: int, rank: int, size: int, host: str | None = None) -> None:
        """Join the weight-broadcast group (trainer 0 is rank 0; its store at ``host``)."""
        members = [d for w, d in self.devices.items() if w.startswith("generator")]
        members.append(self.devices.get("trainer-0", self.device))
        host = host or self.cfg.runtime.address
        timeout_s = self.cfg.runtime.rpc_timeout_s
        store = tcp_store(host, port, size, lead=rank == 0, timeout=timedelta(seconds=timeout_s))
        with pinned_to_loopback(host):
            self.sync_group = make_group(store, rank, size, members or [self.device], timeout_s)

    def generate(self, step: int, mb: int, keys: Sequence[SampleKey], prompt: str) -> TimedResult:
        """Sample and decode one trajectory per key with the current weights; keep them here.

        Returns the policy version that made them.
        """
        self._jitter()
        t0 = time.time()
        out = self.policy.generate(keys, [prompt] * len(keys))
        pixels = out.pixels if self._scored_here else None
        STORE.put((step, mb), out.rollout, pixels, self.policy.cached_conditioning(prompt))
        return self._timed(out.version, t0)

    @property
    def _scored_here(self) -> bool:
        """Whether a generator fetches this worker's pixels (not so on sharded trainers
        other than the first: they make the same samples, and keep only their rollout)."""
        return True

    def version(self) -> int:
        return self.policy.version

    def statistics(self) -> dict[str, Any]:
        """What this worker's store holds (micro-batches, bytes), how many prompts it
        encoded itself, and its device and peak memory."""
        return {
            **STORE.statistics(),
            "encoded_prompts": self.policy.encoded,
            "device": self.device,
            "memory_gb": peak_memory_gb(self.device),
        }

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Name -> CPU copy of the trained weights (it goes to the driver)."""
        return {k: v.cpu() for k, v in self.policy.trainable_state().items()}

    # --- weights ---------------------------------------------------------------------------

    def _synced(self) -> list[tuple[str, torch.nn.Parameter]]:
        return self.policy.synced_parameters()

    def _buckets(self) -> list[list[int]]:
        max_numel = max(1, int(self.cfg.runtime.sync_bucket_mb * 1e6 / 4))
        return weight_buckets([p for _, p in self._synced()], max_numel)

    def _sync_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype weights travel in: their own, or fp32 where the pools' dtypes differ."""
        rt = self.cfg.runtime
        gen, trainer = rt.generator_dtype, rt.trainer_dtype
        return p.dtype if gen == trainer else torch.float32

    def broadcast_weights(self, version: int) -> TimedResult:
        """Enter the weight broadcast (every member at once, bucket by bucket): trainer 0
        sends, the others receive."""
        t0 = time.time()
        params = [p for _, p in self._synced()]
        on = "cuda" if is_cuda(self.device) and self._sync_backend() == "nccl" else "cpu"
        for bucket in self._buckets():
            flat = torch.cat(
                [params[i].detach().reshape(-1).to(on, self._sync_dtype(params[i])) for i in bucket]
            )
            self.sync_group.broadcast(flat, 0).wait()
            _unflatten_into([params[i] for i in bucket], flat)
        self.policy.version = version
        return self._timed(version, t0)

    def _sync_backend(self) -> str:
        return "nccl" if isinstance(self.sync_group, dist.ProcessGroupNCCL) else "gloo"

    def pull_weights(self, source: str, version: int) -> TimedResult:
        """Load the weights ``source`` (trainer 0) serves as ``version``, bucket by bucket."""
        t0 = time.time()
        named = self._synced()
        wire = self._wire_from(source)
        for b, bucket in enumerate(self._buckets()):
            part = run_sync(source, fetch_weights, version, b, wire)
            with torch.no_grad():
                for i in bucket:
                    name, p = named[i]
                    p.copy_(part[name].to(p.device, p.dtype))
        self.policy.version = version
        return self._timed(version, t0)


def _unflatten_into(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p).to(p.device, p.dtype))
            offset += n


def _reward_loop(cfg: DigenConfig, rewards: Sequence[Any] | None) -> RewardLoop:
    """The run's rewards, set up here once, every score of the run on one event loop."""
    hooks = list(rewards) if rewards is not None else cfg.rewards
    return RewardLoop(build_reward(hooks, cfg.train.on_nonfinite), device=cfg.model.device)


class _Scoring(_Placed):
    """``score`` and ``close``, for whichever actor of a generator's process holds the rewards."""

    rewards: RewardLoop | None

    def close(self) -> None:
        """The worker is stopping: the hooks' ``close()``."""
        if self.rewards is not None:
            self.rewards.close()

    def score(
        self,
        step: int,
        mb: int,
        holder: str,
        prompts: Sequence[str],
        metadata: Sequence[dict],
        with_thumbnails: bool = False,
    ) -> TimedResult:
        """Rewards of micro-batch ``(step, mb)``, whose pixels ``holder`` keeps (here or not)."""
        if self.rewards is None:
            raise RuntimeError(f"{self.name}: its scoring actor scores (runtime.score_overlap)")
        self._jitter()
        t0 = time.time()
        key = (step, mb)
        if holder == self.name:
            pixels = STORE.take_pixels(key)
        else:
            pixels = run_sync(holder, fetch_pixels, key, self._wire_from(holder))
        pixels = pixels.cpu()  # rewards take uint8 images on the CPU
        res = self.rewards.score(pixels, prompts, metadata)
        scores = Scores(
            total=res.total.tolist(),
            components={name: v.tolist() for name, v in res.components.items()},
            latency_s=res.latency_s,
            thumbnails=thumbnails(pixels) if with_thumbnails else None,
        )
        return self._timed(scores, t0)


class GeneratorActor(_Scoring, _PolicyActor):
    """Samples trajectories; scores them too, unless its :class:`ScorerActor` does
    (``runtime.score_overlap``, the default)."""

    def __init__(
        self,
        cfg: DigenConfig | dict[str, Any],
        rewards: Sequence[Any] | None = None,
        name: str = "generator-0",
        devices: dict[str, str] | None = None,
        direct: bool = False,
    ) -> None:
        cfg = _pool_config(cfg, "generator", max(index_of(name), 0))
        super().__init__(cfg, name, trainable=False, devices=devices, direct=direct)
        self.rewards = None if cfg.runtime.score_overlap else _reward_loop(cfg, rewards)


class ScorerActor(_Scoring):
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
        name: str = "generator-0",
        devices: dict[str, str] | None = None,
        direct: bool = False,
    ) -> None:
        cfg = _pool_config(cfg, "generator", max(index_of(name), 0))
        super().__init__(cfg, name, devices, direct)  # the generator's name: its process
        self.rewards = _reward_loop(cfg, rewards)


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
        devices: dict[str, str] | None = None,
        direct: bool = False,
    ) -> None:
        """``dp_host``: where trainer 0 serves the data-parallel group's store
        (``runtime.address`` when None).

        With ``runtime.trainer_parallel`` fsdp or hsdp (and ``world > 1``) the trainers shard
        the transformer over a device mesh and act as one (:mod:`digen.runtime.fsdp`): each
        takes its share of every update's rows, and trainer 0 keeps a full copy of the
        trained weights, gathered after each step, to serve, save and return.
        """
        cfg = _pool_config(cfg, "trainer", rank)
        rt = cfg.runtime
        self.rank, self.world = rank, world
        self.sharded = world > 1 and is_sharded(rt.trainer_parallel)
        trainers = [d for w, d in (devices or {}).items() if w.startswith("trainer")]
        trainers = trainers or [cfg.model.device]
        host = dp_host or rt.address
        mesh = store = None
        if world > 1:
            timeout = timedelta(seconds=rt.rpc_timeout_s)
            store = tcp_store(host, dp_port, world, lead=rank == 0, timeout=timeout)
        if self.sharded:
            if is_cuda(cfg.model.device):
                torch.cuda.set_device(torch.device(cfg.model.device))
            mesh = _trainer_mesh(cfg, store, rank, world, trainers, host)
        super().__init__(
            cfg,
            name or f"trainer-{rank}",
            trainable=True,
            devices=devices,
            direct=direct,
            mesh=mesh,
        )
        self.dp_group = None
        if world > 1 and not self.sharded:
            with pinned_to_loopback(host):
                self.dp_group = make_group(store, rank, world, trainers, rt.rpc_timeout_s)
        self.grads = GradAccumulator(self.policy.params, ordered=cfg.train.ordered_grads)
        self._full: dict[str, torch.Tensor] = {}
        """Sharded: trainer 0's full copy of the trained weights (the others hold none)."""
        if self.sharded:
            self._gather_full()
        if rank == 0:
            STORE.serve_weights(self._weights_bucket)

    @property
    def _scored_here(self) -> bool:
        return not self.sharded or self.rank == 0

    def _holds(self, holder: str) -> bool:
        """Whether ``holder``'s micro-batch is in this process (sharded trainers all made
        their own copy of what "trainer-0", the pool as one, generated)."""
        return holder == self.name or (self.sharded and holder == worker_name(Pool.TRAINER, 0))

    def _gather_full(self) -> None:
        """Sharded: every trainer gathers the trained weights in full, one tensor at a time;
        trainer 0 keeps them (on the CPU: a full copy need not fit next to the shards)."""
        named = self.policy.synced_parameters()
        self._full = full_tensors(named, keep=self.rank == 0)

    def _synced(self) -> list[tuple[str, torch.Tensor]]:
        if self.sharded:
            return list(self._full.items())
        return super()._synced()

    def trainable_state(self) -> dict[str, torch.Tensor]:
        if self.sharded:
            return {k: v.clone() for k, v in self._full.items()}
        return super().trainable_state()

    def _weights_bucket(self, version: int, bucket: int, wire: str | None) -> dict[str, Any]:
        """A copy of bucket ``bucket`` of the weights of ``version`` (served on an RPC
        thread: the weights change only at :meth:`step`, and no pull overlaps a step; a copy
        all the same, so what is sent cannot change while it is in flight)."""
        if self.policy.version != version:
            raise RuntimeError(
                f"weights of version {version} were asked for; trainer 0 holds "
                f"{self.policy.version}"
            )
        named = self._synced()
        return {
            named[i][0]: named[i][1]
            .detach()
            .to(wire or self.device, self._sync_dtype(named[i][1]), copy=True)
            for i in self._buckets()[bucket]
        }

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
    ) -> TimedResult:
        """Forward/backward the samples ``keys`` of micro-batch ``(step, mb)``.

        ``rows``: their positions in the micro-batch, whose rollout ``holder`` keeps;
        ``advantages``: one per key. TSP chunks of ``runtime.tsp_degree`` timesteps.
        """
        self._jitter()
        t0 = time.time()
        key, keys, rows = (step, mb), list(keys), list(rows)
        size = self.cfg.train.micro_batch_size
        members, me = (self.world, self.rank) if self.sharded else (1, 0)
        chunks = lockstep_chunks(len(keys), members, me, size)
        mine = [i for c in chunks if c is not None for i in c] or [0]  # call's row indices
        takers = members if not self._holds(holder) else 1
        if self._holds(holder):
            rollout = STORE.take_rollout(key, [rows[i] for i in mine])
        else:  # the prompt's embedding comes along the first time (cheaper than encoding)
            need = self.policy.cached_conditioning(prompt) is None
            wire = self._wire_from(holder)
            picked = [rows[i] for i in mine]
            rollout, embeds = run_sync(holder, fetch_rollout, key, picked, need, wire, takers)
            if embeds is not None:
                self.policy.add_conditioning(prompt, embeds)
        rollout = rollout.to(self.device)
        at = {i: j for j, i in enumerate(mine)}  # call's row -> row of ``rollout``
        adv = torch.tensor(list(advantages), dtype=torch.float32, device=self.device)
        stats = LossStats()
        with self.grads.micro_batch(mb):
            for chunk in chunks:
                # a chunk this member runs only to keep in step adds nothing (scale 0)
                idx, scale = (chunk, loss_scale) if chunk is not None else (mine[:1], 0.0)
                part = TrainItem(
                    keys=[keys[i] for i in idx],
                    prompts=[prompt] * len(idx),
                    rollout=rollout.select(torch.tensor([at[i] for i in idx])),
                    advantages=adv[idx],
                )
                got = self.policy.accumulate(part, scale, self.cfg.runtime.tsp_degree)
                if chunk is not None:
                    stats.add(got)
        return self._timed(stats, t0)

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

    def save_weights(self, out_dir: str) -> str:
        state = self._full if self.sharded else None
        return str(self.policy.save_weights(out_dir, state))

    def step(self, microbatches: int) -> TimedResult:
        """Sum the step's gradients over the trainers, clip, step. Returns ``(version, grad
        norm)``; trainer 0 then serves the new weights."""
        self._jitter()
        t0 = time.time()
        self.policy.set_step_lr(self.policy.version)  # version == the train step here
        self.grads.reduce(microbatches, self.dp_group)
        norm = self.policy.optimizer_step()
        if self.sharded:
            self._gather_full()
        return self._timed((self.policy.version, norm), t0)


def _trainer_mesh(
    cfg: DigenConfig, store: Any, rank: int, world: int, devices: Sequence[str], host: str
) -> Any:
    """The sharded trainers' device mesh, over a default process group of the trainers
    (they are the only members of this process's default group)."""
    kinds = {"cuda" if is_cuda(d) else "cpu" for d in devices}
    if len(kinds) > 1:
        raise ValueError(
            f"runtime.trainer_parallel={cfg.runtime.trainer_parallel} needs every trainer on "
            f"the same kind of device, not {sorted(kinds)}"
        )
    with pinned_to_loopback(host):
        init_default_group(store, rank, world, devices, cfg.runtime.rpc_timeout_s)
    return make_mesh(cfg.runtime.trainer_parallel, world, kinds.pop(), cfg.runtime.shard_size)
