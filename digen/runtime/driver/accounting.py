"""What the driver's calls cost, observed from outside the loops that make them.

Every actor call the driver makes is reported here once it returns (:meth:`CostLedger.record`):
it becomes a trace event (for ``trace.json`` and the timeline), feeds the online profiler the
TAG search plans with, and adds to its step's work and call overhead. At the end of a step,
:meth:`CostLedger.step_result` turns the step's book-keeping record into the metrics row and
the sample grid the runner writes, and closes the step in the trace: what the accounts hold
is the steps under way, whatever the length of the run.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from digen.checkpoint import PROFILER
from digen.config import DigenConfig
from digen.runtime.messages import LossStats, StepResult
from digen.runtime.metrics import OVERHEAD_KINDS, Overhead, step_metrics
from digen.sched.costs import OnlineProfiler
from digen.sched.names import TaskKind, pool_of
from digen.sched.scheduler import StepRecord
from digen.sched.trace import Trace, device_of

__all__ = ["CostLedger"]


@dataclass(slots=True)
class _Step:
    busy_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    overhead: Overhead = field(default_factory=Overhead)
    memory_gb: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    """Per pool, the largest peak memory a worker reported in the step."""
    reward_latency_s: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """Per reward, the seconds of each of its calls in the step."""


class CostLedger:
    """The trace, the profiler and per-step costs of one disaggregated run."""

    def __init__(
        self, cfg: DigenConfig, trace: Trace, workers: Sequence[str], resume: Path | None = None
    ) -> None:
        """``resume``: a checkpoint's folder; its cost estimates, where it kept them, are
        where the profiler starts (BTS then plans from the run's costs, not from nothing)."""
        self.cfg = cfg
        self.trace = trace
        self.workers = list(workers)
        kept = resume / PROFILER if resume is not None else None
        self.profiler = OnlineProfiler.load(kept) if kept and kept.is_file() else OnlineProfiler()
        self._steps: dict[int, _Step] = defaultdict(_Step)

    def record(
        self,
        kind: TaskKind,
        worker: str,
        step: int,
        mb: int,
        version: int,
        span_s: float,
        t0: float,
        t1: float,
        memory_gb: float = 0.0,
    ) -> None:
        """A call that took ``span_s`` at the driver and ``t0 .. t1`` of work in ``worker``,
        whose peak memory was then ``memory_gb``."""
        event = self.trace.record(kind.value, worker, step, mb, version, t0, t1)
        self.profiler.observe(event)
        acc = self._steps[step]
        pool = pool_of(device_of(worker))  # a scoring lane reports its generator's process
        acc.memory_gb[pool] = max(acc.memory_gb[pool], memory_gb)
        acc.busy_s[kind] += t1 - t0
        if kind in OVERHEAD_KINDS:
            acc.overhead.add(kind, span_s, t1 - t0)

    def scored(self, step: int, latency_s: dict[str, float]) -> None:
        """A score call of ``step`` returned: each reward's time in it."""
        for name, seconds in latency_s.items():
            self._steps[step].reward_latency_s[name].append(seconds)

    def step_result(
        self,
        rec: StepRecord,
        texts: Sequence[str],
        *,
        version: int,
        grad_norms: Sequence[float],
        step_time_s: float,
        optimizer_s: float,
        sync_s: float,
        driver_mb: float,
        generators_alive: int = 1,
    ) -> StepResult:
        """The metrics row and sample grid of a finished step."""
        cfg, s = self.cfg, rec.step
        b, n = cfg.data.train_batch_size, cfg.rollout.n
        rewards = torch.tensor([[rec.rewards[(p, j)] for j in range(n)] for p in range(b)])
        components = {
            name: sum(values[k] for k in sorted(values)) / len(values)
            for name, values in rec.components.items()
        }
        loss = LossStats()
        for stats in rec.stats_in_order():  # a fixed order: the metrics repeat bit for bit
            loss.add(stats)
        acc = self._steps.pop(s, _Step())
        usage = self.trace.step_stats(s, self.workers)
        self.trace.close_step(s)  # its events stay in the trace's file only
        metrics = step_metrics(
            step=s,
            rewards=rewards,
            components=components,
            loss=loss,
            grad_norms=grad_norms,
            version=version,
            trained_samples=b * (cfg.algo.best_of_n or n),
            step_time_s=step_time_s,
            busy_s=acc.busy_s,
            optimizer_s=optimizer_s,
            sync_s=sync_s,
            usage=usage,
            overhead=acc.overhead,
            driver_mb=driver_mb,
            stale=rec.stale,
            tags=rec.tags,
            memory_gb=dict(acc.memory_gb),
            reward_latency_s=acc.reward_latency_s,
            generators_alive=generators_alive,
            remade=(rec.remade, rec.remade_s),
            lost_microbatches=rec.orphaned,
        )
        pixels: Any = None
        captions: list[str] = []
        if rec.thumbnails:
            order = sorted(rec.thumbnails)
            pixels = torch.cat([rec.thumbnails[m] for m in order])
            captions = [texts[rec.mbs[m].prompt] for m in order for _ in rec.mbs[m].samples]
        return StepResult(metrics, pixels, captions)
