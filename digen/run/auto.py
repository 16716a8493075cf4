"""``digen run --mode auto``: time the run's tasks, ask the planner, run its choice.

1. **Probe.** A short disaggregated run of the same config (one generator and the fewest
   trainers that hold the training state: one replicated trainer where a copy fits a
   device's memory, else that many FSDP trainers, by the planner's memory model
   (:func:`probe_trainers`); :data:`PROBE_STEPS` steps, one trainer-assisted generation a
   step so generation on a trainer is timed too) in a temporary directory. Its trace gives each task's seconds per
   micro-batch (the median over the steps after the first, which warms up), and its metrics
   the calls' own overhead per kind (RPC, pickling, the driver's loop), added to the
   disaggregated tasks as ``digen bench`` adds it to its predictions. A sharded probe's
   update and trainer-generation times are scaled to one device's (the planner deals them
   over the trainers itself).
2. **Plan.** :func:`digen.planning.layouts.plan` ranks colocated over the devices and every
   generator / trainer split with every TAG policy; with a memory model of the devices
   (:class:`RunMemory`: on GPUs, the GPU's memory and the backbone's published sizes) only
   layouts whose state fits are ranked, replicated or sharded as the planner found they fit. Only layouts that train the same thing
   are candidates: TCSS (which trains on samples one version old) is considered only when
   the config already allows staleness (``runtime.schedule.max_staleness >= 1``), and the TSP degree
   is the config's.
3. **Run.** The first candidate the config accepts becomes the run's settings
   (``runtime.mode`` and its pool, TAG policy and micro-batch size), said in one line,
   written to ``config.yaml`` like any setting, and recorded with the whole ranking in
   ``plan.json``.

Every split uses the probe's micro-batch size (``runtime.schedule.samples_per_microbatch``), so the
costs the planner was given are the costs the chosen run pays.
"""

from __future__ import annotations

import dataclasses
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
from digen.planning.hardware import (
    DEVICE_DEFAULTS,
    Hardware,
    ModelSize,
    load_hardware,
    sample_tokens,
    sampling_copy_bytes,
    train_state_bytes,
)
from digen.planning.layouts import COLOCATED, Candidate, Workload, explain, plan
from digen.sched.costs import Costs, OnlineProfiler
from digen.sched.names import TaskKind
from digen.sched.trace import Trace, TraceEvent

__all__ = [
    "PROBE_STEPS",
    "AutoChoice",
    "RunMemory",
    "apply_layout",
    "call_overhead",
    "choose_layout",
    "devices_given",
    "measured_costs",
    "probe_config",
    "probe_trainers",
    "rank_layouts",
    "run_memory",
]

PROBE_STEPS = 3
"""Steps of the probe run: the first warms up, the others are timed."""


def devices_given(cfg: DigenConfig) -> int:
    """The devices a run may lay out: the visible GPUs when the model runs on CUDA, else
    the CPU cores over ``runtime.placement.threads_per_worker`` (at least two: one of each pool)."""
    if cfg.model.device.startswith("cuda"):
        import torch

        return max(2, torch.cuda.device_count())
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(2, (cores or 1) // cfg.runtime.placement.threads_per_worker)


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


@dataclass(frozen=True, slots=True)
class RunMemory:
    """What ``--mode auto`` plans memory with: the devices and the model's sizes."""

    hardware: Hardware
    model: ModelSize


def run_memory(cfg: DigenConfig) -> RunMemory | None:
    """The memory model of a run on GPUs with real weights (``model.path``): its GPU kind's
    figures (the spec sheet's of the kind its name says, H100's otherwise) with the memory
    the GPU reports, and the backbone's published sizes at ``train.lora_rank``. None where
    there is nothing to fit (the CPU, or a random-init flavour)."""
    if not cfg.model.device.startswith("cuda") or cfg.model.path is None:
        return None
    import torch

    props = torch.cuda.get_device_properties(torch.device(cfg.model.device))
    name = props.name.lower()
    kinds = sorted(DEVICE_DEFAULTS, key=len, reverse=True)  # a100-40gb before a100
    kind = next((k for k in kinds if k.split("-")[0] in name), "h100")
    device = {"kind": kind, "memory_gb": props.total_memory / 1e9}
    m = cfg.model
    tokens = 0  # a size left to the model: its activations are left to the reserve
    if m.height and m.width:
        tokens = sample_tokens(m.height, m.width, m.num_frames, m.max_sequence_length or 0)
    model = ModelSize.of(m.name, lora_rank=cfg.train.lora_rank, tokens=tokens)
    return RunMemory(load_hardware({"device": device}), model)


def probe_trainers(devices: int, memory: RunMemory | None) -> int:
    """Trainers the probe needs: 1 (replicated) where a device holds the whole training
    state, else the fewest FSDP trainers whose shards each fit, beside one generator that
    holds a sampling copy. Raises :class:`DigenError` when no split of ``devices`` fits."""
    if memory is None:
        return 1
    hw, m = memory.hardware, memory.model
    if not hw.generator.fits(sampling_copy_bytes(m)):
        raise DigenError(
            f"--mode auto: a {hw.generator.kind} cannot hold a sampling copy of {m.name} "
            f"({sampling_copy_bytes(m) / 1e9:.0f} GB in bf16)"
        )
    for trainers in range(1, devices):
        if hw.trainer.fits(train_state_bytes(m, trainers)):
            return trainers
    raise DigenError(
        f"--mode auto: {devices - 1} {hw.trainer.kind} trainers cannot hold the training state "
        f"of {m.name} even sharded ({train_state_bytes(m) / 1e9:.0f} GB in all)"
    )


def probe_config(cfg: DigenConfig, trainers: int = 1) -> DigenConfig:
    """The probe: ``cfg`` disaggregated over one generator and ``trainers`` trainers (one
    replicated, or FSDP over several: :func:`probe_trainers`), for a few steps, with one
    trainer-assisted generation a step and nothing a probe needs not do."""
    d = config_to_dict(cfg)
    rt = d["runtime"]
    rt.update(mode="disaggregated", generators=1, trainers=trainers)
    rt["placement"]["trainer_parallel"] = "replicate" if trainers == 1 else "fsdp"
    rt["schedule"].update(tag="static", tag_k=1, max_staleness=0)
    rt["elastic"].update(accept_generators=False, respawn_generators=False)
    rt["transport"]["port"] = None
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
    """``cfg`` laid out as candidate ``c`` (raises :class:`ConfigError` if it does not fit):
    with a memory model, its trainers replicated, or sharded where the planner found only
    shards fit; without one, as the config says."""
    d = config_to_dict(cfg)
    rt = d["runtime"]
    if c.strategy:  # the planner weighed memory: replicated where a copy fits, else shards
        rt["placement"]["trainer_parallel"] = "replicate" if c.strategy == "replicated" else "fsdp"
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
        rt.update(mode="disaggregated", generators=c.generators, trainers=c.trainers)
        rt["schedule"].update(tag=policy, samples_per_microbatch=size, group_updates=c.grouped)
        if k:
            rt["schedule"]["tag_k"] = int(k)
        if not c.tcss:
            rt["schedule"]["max_staleness"] = 0
        rt["generators"] = c.generators // c.generator_group  # each of its devices
        rt["placement"].update(
            generator_sequence=c.generator_sequence, generator_cfg=c.generator_cfg
        )
        if c.shard_deal:
            rt["placement"].update(shard_deal=c.shard_deal, trainer_sampling=c.trainer_sampling)
        d["train"]["num_devices"] = 1
    return load_config(base=d)


def rank_layouts(
    cfg: DigenConfig, probe: DigenConfig, costs: Costs, devices: int, memory: RunMemory | None
) -> tuple[list[Candidate], int, list[str]]:
    """The planner's ranking of ``devices`` for ``cfg``, timed by ``probe`` (``costs``), the
    micro-batch size, and the layouts left out as not fitting ``memory``.

    A sharded probe timed each update over its ``T`` trainers, each its share of a
    micro-batch's terms (:meth:`Workload.trained_share`), and each trainer generation over
    them, ``ceil(n / T)`` of its ``n`` samples each: those costs are scaled back to one
    device's, which the planner deals over trainers itself."""
    from digen.algos.train_step import terms_per_sample

    sp = schedule_plan(probe)
    assert sp.layout is not None
    rt, timed = cfg.runtime, probe.runtime.trainers
    n = sp.layout.samples_per_microbatch
    r = probe.rollout
    work = Workload(
        costs=costs,
        microbatches=sp.microbatches,
        samples_per_microbatch=n,
        mbs_per_group=sp.update_group,
        tsp_degree=rt.schedule.tsp_degree,
        passes=r.num_inference_steps * (2 if r.guidance_scale > 1 else 1),
        timesteps=terms_per_sample(probe, 0),
        pass_samples=probe.train.micro_batch_size,
        shard_deal=str(rt.placement.shard_deal),
        guided=r.guidance_scale > 1,
        model=None if memory is None else memory.model,
    )
    if timed > 1:
        probed = dataclasses.replace(work, shard_deal=str(probe.runtime.placement.shard_deal))
        share, _ = probed.trained_share(timed, tsp=True)
        gen_share = -(-n // timed) / n
        costs = Costs(
            **{
                **costs.to_dict(),
                "update": costs.update / share,
                "gen_tag": costs.gen_tag / gen_share,
            }
        )
        work = dataclasses.replace(work, costs=costs)
    ranked, skipped = plan(
        work,
        devices,
        None if memory is None else memory.hardware,
        steps=4,
        max_staleness=rt.schedule.max_staleness,
        staleness_ratio=rt.schedule.staleness_ratio,
        tcss=rt.schedule.max_staleness >= 1,
    )
    return ranked, n, skipped


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
    cfg: DigenConfig,
    *,
    devices: int | None = None,
    progress: bool = True,
    memory: RunMemory | None = None,
) -> AutoChoice:
    """Probe ``cfg``, plan ``devices`` (default :func:`devices_given`), and lay it out as the
    fastest candidate its settings allow (see the module docstring). ``memory``: the
    devices' and model's sizes (default :func:`run_memory`)."""
    from digen.run.runner import DigenRunner

    n = devices_given(cfg) if devices is None else devices
    if n < 2:
        raise DigenError(f"--mode auto needs at least 2 devices to choose among, got {n}")
    memory = memory or run_memory(cfg)
    trainers = probe_trainers(n, memory)
    probe = probe_config(cfg, trainers)
    if progress:
        pool = "one trainer" if trainers == 1 else f"{trainers} FSDP trainers"
        print(
            f"mode auto: timing {PROBE_STEPS} steps on one generator and {pool}, "
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
    ranked, size, skipped = rank_layouts(cfg, probe, costs, n, memory)
    refused: list[str] = list(skipped)
    for i, c in enumerate(ranked):
        try:
            chosen = apply_layout(cfg, c, size)
        except ConfigError as exc:
            refused.append(f"{c.label}: {exc}")
            continue
        line = explain(ranked[i:])
        record = {
            "choice": c.to_dict(),
            "line": line,
            "devices": n,
            "costs": costs.to_dict(),
            "probe": {"steps": PROBE_STEPS, "generators": 1, "trainers": trainers},
            "candidates": [x.to_dict() for x in ranked],
            "refused": refused,
        }
        return AutoChoice(chosen, line, record)
    raise DigenError("--mode auto found no layout this config accepts: " + "; ".join(refused))
