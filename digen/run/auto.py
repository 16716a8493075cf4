"""``digen run --mode auto``: time the run's tasks, ask the planner, run its choice.

1. **Probe.** A short disaggregated run of the same config (one generator, one trainer,
   :data:`PROBE_STEPS` steps, one trainer-assisted generation a step so generation on a
   trainer is timed too) in a temporary directory. Its trace gives each task's seconds per
   micro-batch (the median over the steps after the first, which warms up), and its metrics
   the calls' own overhead per kind (RPC, pickling, the driver's loop), added to the
   disaggregated tasks as ``digen bench`` adds it to its predictions.
2. **Plan.** :func:`digen.sched.planner.plan` ranks colocated over the devices and every
   generator / trainer split with every TAG policy. Only layouts that train the same thing
   are candidates: TCSS (which trains on samples one version old) is considered only when
   the config already allows staleness (``runtime.max_staleness >= 1``), and the TSP degree
   is the config's.
3. **Run.** The first candidate the config accepts becomes the run's settings
   (``runtime.mode`` and its pool, TAG policy and micro-batch size), said in one line,
   written to ``config.yaml`` like any setting, and recorded with the whole ranking in
   ``plan.json``.

Every split uses the probe's micro-batch size (``runtime.samples_per_microbatch``), so the
costs the planner was given are the costs the chosen run pays.
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from digen.config import DigenConfig, config_to_dict, load_config, schedule_plan
from digen.errors import ConfigError, DigenError
from digen.sched.costs import Costs, OnlineProfiler
from digen.sched.names import TaskKind
from digen.sched.planner import COLOCATED, Candidate, Workload, explain, plan
from digen.sched.trace import Trace, TraceEvent

__all__ = [
    "PROBE_STEPS",
    "AutoChoice",
    "apply_layout",
    "call_overhead",
    "choose_layout",
    "devices_given",
    "measured_costs",
    "probe_config",
]

PROBE_STEPS = 3
"""Steps of the probe run: the first warms up, the others are timed."""


def devices_given(cfg: DigenConfig) -> int:
    """The devices a run may lay out: the visible GPUs when the model runs on CUDA, else
    the CPU cores over ``runtime.threads_per_worker`` (at least two: one of each pool)."""
    if cfg.model.device.startswith("cuda"):
        import torch

        return max(2, torch.cuda.device_count())
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, (cores or 1) // cfg.runtime.threads_per_worker)


def call_overhead(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Seconds a call adds to its task, per cost (median over the steps' metrics rows)."""
    over = {
        kind: statistics.median(r.get(f"overhead_ms/{kind}", 0.0) for r in rows) / 1e3
        if rows
        else 0.0
        for kind in (TaskKind.GENERATE, TaskKind.SCORE, TaskKind.UPDATE)
    }
    gen = over[TaskKind.GENERATE]
    return {
        "gen": gen,
        "gen_tag": gen,
        "score": over[TaskKind.SCORE],
        "update": over[TaskKind.UPDATE],
    }


def probe_config(cfg: DigenConfig) -> DigenConfig:
    """The probe: ``cfg`` disaggregated over one generator and one trainer, for a few steps,
    with one trainer-assisted generation a step and nothing a probe needs not do."""
    d = config_to_dict(cfg)
    d["runtime"].update(
        mode="disaggregated",
        generators=1,
        trainers=1,
        trainer_parallel="replicate",
        tag="static",
        tag_k=1,
        max_staleness=0,
        accept_generators=False,
        respawn_generators=False,
        port=None,
    )
    d.update(steps=PROBE_STEPS, save_every=0, logger=[])
    d["eval"]["every"] = 0
    return load_config(base=d)


def measured_costs(events: Sequence[TraceEvent], rows: Sequence[dict[str, Any]]) -> Costs:
    """Median seconds of each task in the steps after the first, plus the calls' overhead."""
    prof = OnlineProfiler(method="median", window=1_000_000)
    prof.observe_all(e for e in events if e.step >= 1 and e.worker != "driver")
    if not prof.ready():
        raise DigenError("the probe run timed no generation or update; --mode auto cannot plan")
    costs = prof.costs().to_dict()
    for name, extra in call_overhead(rows[1:] or rows).items():
        costs[name] += extra
    return Costs(**costs)


def apply_layout(cfg: DigenConfig, c: Candidate, size: int) -> DigenConfig:
    """``cfg`` laid out as candidate ``c`` (raises :class:`ConfigError` if it does not fit)."""
    d = config_to_dict(cfg)
    rt = d["runtime"]
    if c.layout == COLOCATED:
        rt["mode"] = "colocated"
        d["train"]["num_devices"] = c.trainers
        # each device trains its share of a mini-batch in micro-batches that divide it
        mini = cfg.train.mini_batch_size or cfg.data.train_batch_size
        share = mini * (cfg.algo.best_of_n or cfg.rollout.n) // c.trainers
        if share:
            d["train"]["micro_batch_size"] = math.gcd(cfg.train.micro_batch_size, share)
    else:
        policy, _, k = c.policy.partition("-")
        rt.update(
            mode="disaggregated",
            generators=c.generators,
            trainers=c.trainers,
            tag=policy,
            samples_per_microbatch=size,
        )
        if k:
            rt["tag_k"] = int(k)
        if not c.tcss:
            rt["max_staleness"] = 0
        d["train"]["num_devices"] = 1
    return load_config(base=d)


@dataclass(frozen=True, slots=True)
class AutoChoice:
    """What ``--mode auto`` found."""

    cfg: DigenConfig
    """The config laid out as the chosen candidate."""
    line: str
    """One line: the choice, its predicted step, and the best of the other layout."""
    record: dict[str, Any]
    """What ``plan.json`` keeps: the measured costs, every candidate, the choice."""


async def choose_layout(
    cfg: DigenConfig, *, devices: int | None = None, progress: bool = True
) -> AutoChoice:
    """Probe ``cfg``, plan ``devices`` (default :func:`devices_given`), and lay it out as the
    fastest candidate its settings allow (see the module docstring)."""
    from digen.run.runner import DigenRunner

    n = devices_given(cfg) if devices is None else devices
    if n < 2:
        raise DigenError(f"--mode auto needs at least 2 devices to choose among, got {n}")
    probe = probe_config(cfg)
    if progress:
        print(
            f"mode auto: timing {PROBE_STEPS} steps on one generator and one trainer, "
            f"then planning {n} devices",
            file=sys.stderr,
        )
    with tempfile.TemporaryDirectory(prefix="digen-probe-") as tmp:
        runner = DigenRunner(
            probe, out_dir=tmp, progress=False, sample_grids=False, save_weights=False
        )
        result = await runner.run()
        events = Trace.load_jsonl(Path(tmp) / "trace.jsonl").events
    costs = measured_costs(events, result.metrics)
    sp = schedule_plan(probe)
    assert sp.layout is not None
    rt = cfg.runtime
    work = Workload(
        costs=costs,
        microbatches=sp.microbatches,
        samples_per_microbatch=sp.layout.samples_per_microbatch,
        mbs_per_group=sp.update_group,
        tsp_degree=rt.tsp_degree,
    )
    ranked, _ = plan(
        work,
        n,
        steps=4,
        max_staleness=rt.max_staleness,
        staleness_ratio=rt.staleness_ratio,
        tcss=rt.max_staleness >= 1,
    )
    refused: list[str] = []
    for i, c in enumerate(ranked):
        try:
            chosen = apply_layout(cfg, c, sp.layout.samples_per_microbatch)
        except ConfigError as exc:
            refused.append(f"{c.label}: {exc}")
            continue
        line = explain(ranked[i:])
        record = {
            "choice": c.to_dict(),
            "line": line,
            "devices": n,
            "costs": costs.to_dict(),
            "probe": {"steps": PROBE_STEPS, "generators": 1, "trainers": 1},
            "candidates": [x.to_dict() for x in ranked],
            "refused": refused,
        }
        return AutoChoice(chosen, line, record)
    raise DigenError("--mode auto found no layout this config accepts: " + "; ".join(refused))
