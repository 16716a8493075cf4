"""What every actor of a worker process has (:class:`WorkerActor`), and what the generator
and the trainer share (:class:`PolicyActor`: a policy copy on its device, generation into the
store, weight sync). The package docstring (:mod:`digen.runtime.worker`) tells the whole.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from digen.config import DigenConfig, load_config, schedule_plan
from digen.quiet import no_progress_bars, quiet_env
from digen.runtime.messages import GenerateRequest, SampleKey, TimedResult
from digen.runtime.notes import notes_to_run_log
from digen.runtime.placement import (
    DEVICE_ENV,
    is_cuda,
    peak_memory_gb,
    wire_device,
    worker_device,
)
from digen.runtime.transport.actors import run_sync
from digen.runtime.transport.groups import make_group, pinned_to_loopback, tcp_store
from digen.runtime.worker.policy import Generated, Policy
from digen.runtime.worker.store import fetch_weights, open_store
from digen.sched.names import Pool, worker_name

__all__ = [
    "Jitter",
    "PolicyActor",
    "WorkerActor",
    "pool_config",
    "set_threads",
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


def pool_config(cfg: DigenConfig | dict[str, Any], pool: str, index: int = 0) -> DigenConfig:
    """The run's config with ``model.device`` / ``model.dtype`` set to this worker's own, and
    both pools' dtypes spelt out (``runtime.placement.generator_dtype``,
    ``runtime.placement.trainer_dtype``)."""
    cfg = cfg if isinstance(cfg, DigenConfig) else load_config(base=cfg)
    device = os.environ.get(DEVICE_ENV) or worker_device(cfg, pool, index)
    own = cfg.runtime.placement
    placement = dataclasses.replace(
        own,
        generator_dtype=own.generator_dtype or cfg.model.dtype,
        trainer_dtype=own.trainer_dtype or cfg.model.dtype,
    )
    model = dataclasses.replace(cfg.model, device=device, dtype=getattr(placement, f"{pool}_dtype"))
    runtime = dataclasses.replace(cfg.runtime, placement=placement)
    return dataclasses.replace(cfg, model=model, runtime=runtime)


def set_threads(n: int) -> None:
    """A worker's torch threads, and no loading bars (they would interleave with the driver's)."""
    torch.set_num_threads(n)
    quiet_env()
    no_progress_bars()  # a worker's would interleave with the driver's progress bar


class Jitter:
    """Random sleeps before work when ``DIGEN_TEST_JITTER_S`` is set (:mod:`digen.runtime.worker`)."""

    def __init__(self) -> None:
        self.max_s = float(os.environ.get(_JITTER_ENV, "0") or 0)
        self.rng = random.Random(os.urandom(8))

    def __call__(self) -> None:
        if self.max_s > 0:
            time.sleep(self.rng.uniform(0.0, self.max_s))


class WorkerActor:
    """What every actor of a worker process has: its worker's name and device, how peers
    send it tensors, its store, and its replies' timing.

    ``devices``: every worker's device by name, ``hosts``: every worker's machine where
    they span several (a torchrun launch), and ``direct``: whether GPU workers exchange
    tensors GPU to GPU (the actor layer was given device maps); all from the cluster.
    """

    def __init__(
        self,
        cfg: DigenConfig,
        name: str,
        devices: dict[str, str] | None,
        direct: bool,
        hosts: dict[str, str] | None = None,
    ) -> None:
        notes_to_run_log(name)
        self.name = name
        self.device = cfg.model.device
        if is_cuda(self.device):  # this actor's thread (the current CUDA device is per thread)
            torch.cuda.set_device(torch.device(self.device))
        self.devices = devices or {}
        self.hosts = hosts or {}
        if name in self.devices and self.devices[name] != self.device:
            raise RuntimeError(
                f"{name} computes on {self.device} but the run placed it on {self.devices[name]}"
            )
        self.direct = direct
        self.jitter = Jitter()
        self.store = open_store(schedule_plan(cfg).admission.max_inflight)
        """This process's store (:mod:`.store`), shared with a generator's scoring actor."""

    def ping(self) -> int:
        return os.getpid()

    def timed(self, value: Any, t0: float) -> TimedResult:
        """``value`` with the span of the work that made it, from ``t0`` to now."""
        return TimedResult(value, t0, time.time(), peak_memory_gb(self.device))

    def wire_from(self, peer: str) -> str | None:
        """How ``peer`` must send tensors to this worker: as they are, or staged on the CPU."""
        return wire_device(self.device, self.devices.get(peer, "cpu"), self.direct)


class PolicyActor(WorkerActor):
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
        hosts: dict[str, str] | None = None,
    ) -> None:
        set_threads(cfg.runtime.placement.threads_per_worker)
        super().__init__(cfg, name, devices, direct, hosts)
        self.cfg = cfg
        self.policy = Policy(cfg, trainable=trainable, mesh=mesh)
        self.sync_group = None
        rt = cfg.runtime
        same = rt.placement.generator_dtype == rt.placement.trainer_dtype
        live = [p.dtype for _, p in self.policy.synced_parameters()]
        self._wire_dtypes = [d if same or not d.is_floating_point else torch.float32 for d in live]
        """The dtype each synced weight travels in: that of the parameter it lands in where
        both pools compute in one dtype (:func:`pool_config` spells both out), so an old
        policy or average kept in fp32 beside bf16 weights travels in bf16, rounded as the
        receiver would round it, at half the bytes; fp32 where the pools' dtypes differ
        (each side casts to its own). Read once: pulls are served on RPC threads."""

    def join_sync_group(self, port: int, rank: int, size: int, host: str | None = None) -> None:
        """Join the weight-broadcast group (trainer 0 is rank 0; its store at ``host``)."""
        names = [w for w in self.devices if w.startswith(Pool.GENERATOR.value)]
        names.append(worker_name(Pool.TRAINER, 0))
        members = [self.devices.get(w, self.device) for w in names]
        machines = [self.hosts.get(w, "") for w in names] if self.hosts else None
        host = host or self.cfg.runtime.transport.address
        timeout_s = self.cfg.runtime.transport.rpc_timeout_s
        store = tcp_store(host, port, size, lead=rank == 0, timeout=timedelta(seconds=timeout_s))
        with pinned_to_loopback(host):
            self.sync_group = make_group(store, rank, size, members, timeout_s, machines)

    def generate(self, request: GenerateRequest) -> TimedResult:
        """Sample and decode one trajectory per key with the current weights; keep them here
        (:class:`~digen.runtime.messages.GenerateRequest`; offloaded text encoders encode
        its ``ahead`` prompts in this visit:
        :meth:`~digen.runtime.worker.policy.Policy.encode_ahead`).

        Returns the policy version that made them.
        """
        self.jitter()
        t0 = time.time()
        prompt = request.prompt
        self.policy.encode_ahead(prompt, request.ahead)
        out = self._sample(list(request.keys), prompt)
        pixels = out.pixels if self._scored_here and request.keep_pixels else None
        kept = out.rollout.for_training(final=self.policy.algorithm.trains_on == "final")
        key = (request.step, request.mb)
        self.store.put(key, kept, pixels, self.policy.cached_conditioning(prompt))
        return self.timed(out.version, t0)

    def _sample(self, keys: list[SampleKey], prompt: str) -> Generated:
        """Sample and decode ``keys`` (all of ``prompt``) with the current weights."""
        return self.policy.generate(keys, [prompt] * len(keys))

    @property
    def _scored_here(self) -> bool:
        """Whether a generator fetches this worker's pixels (not so on sharded trainers
        other than the first: they keep only the rollout)."""
        return True

    def version(self) -> int:
        return self.policy.version

    def statistics(self) -> dict[str, Any]:
        """What this worker's store holds (micro-batches, bytes), how many prompts it
        encoded itself (and in how many visits of offloaded text encoders to the device),
        how many training samples it sampled, and its device and peak memory."""
        return {
            **self.store.statistics(),
            "encoded_prompts": self.policy.encoded,
            "text_encoder_visits": self.policy.adapter.encoder_visits,
            "sampled_rows": self.policy.sampled,
            "device": self.device,
            "memory_gb": peak_memory_gb(self.device),
        }

    def trained_names(self) -> list[str]:
        """The names of the trained weights, in the order weight syncs carry them."""
        return [n for n, _ in self.policy.synced_parameters()]

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Name -> CPU copy of the trained weights (it goes to the driver)."""
        return self.policy.trainable_state("cpu")

    # --- weights ---------------------------------------------------------------------------

    def _synced(self) -> list[tuple[str, torch.Tensor]]:
        """What weight syncs carry: the weights that sample (the old policy where the
        algorithm keeps one)."""
        return self.policy.sampling_parameters()

    def _buckets(self) -> list[list[int]]:
        return self._buckets_of([p for _, p in self._synced()])

    def _buckets_of(self, tensors: Sequence[torch.Tensor]) -> list[list[int]]:
        """Indices of ``tensors`` in buckets of at most ``runtime.transport.sync_bucket_mb``
        (fp32)."""
        return weight_buckets(
            tensors, max(1, int(self.cfg.runtime.transport.sync_bucket_mb * 1e6 / 4))
        )

    def broadcast_weights(self, version: int) -> TimedResult:
        """Enter the weight broadcast (every member at once, bucket by bucket): trainer 0
        sends, the others receive."""
        t0 = time.time()
        params = [p for _, p in self._synced()]
        dtypes = self._wire_dtypes
        on = "cuda" if is_cuda(self.device) and self._sync_backend() == "nccl" else "cpu"
        for bucket in self._buckets():
            flat = torch.cat([params[i].detach().reshape(-1).to(on, dtypes[i]) for i in bucket])
            self.sync_group.broadcast(flat, 0).wait()
            _unflatten_into([params[i] for i in bucket], flat)
        self.policy.version = version
        return self.timed(version, t0)

    def _sync_backend(self) -> str:
        return "nccl" if isinstance(self.sync_group, dist.ProcessGroupNCCL) else "gloo"

    def pull_weights(self, source: str, version: int) -> TimedResult:
        """Load the weights ``source`` (trainer 0) serves as ``version``, bucket by bucket."""
        t0 = time.time()
        named = self._synced()
        wire = self.wire_from(source)
        for b, bucket in enumerate(self._buckets()):
            part = run_sync(source, fetch_weights, version, b, wire)
            with torch.no_grad():
                for i in bucket:
                    name, p = named[i]
                    p.copy_(part[name].to(p.device, p.dtype))
        self.policy.version = version
        return self.timed(version, t0)


def _unflatten_into(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p).to(p.device, p.dtype))
            offset += n
