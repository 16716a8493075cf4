"""``digen bench``: the runtime's ablation ladder, measured on this machine.

Every rung trains the same model, algorithm, batch and seed on the same number of worker
processes (``workers``, two by default), one step at a time:

1. **colocated**: the fastest of the colocated configurations a user would try on these
   resources (one process with every core's thread; ``workers`` data-parallel processes of
   ``cores / workers`` threads each); the others are reported beside it;
2. **naive disaggregated**: one pool generates the whole step, then the other trains on it;
3. **+ pipelining** (prompt axis): updates start as soon as a group is scored;
4. **+ GAP**: a group's samples are spread over the generators (the generation axis);
5. **+ TSP**: trainers batch two timesteps per forward/backward;
6. **+ TAG**: bubble-triggered search puts idle trainers to generating;
7. **+ TCSS**: up to half a step's micro-batches may be made one policy version early.

Repetitions are interleaved (every rung once, then every rung again), so a machine that
drifts (thermals, a neighbour's job) slows all rungs alike. Per rung, from the steps after
the first (the first pays for warm-up): median and spread of the step time, samples per
second, speed-ups, utilisation per pool from the run's trace, the bubble fraction, the
measured step over the ideal bound (``max(total work / workers, critical path)`` from the
run's own task costs) and the step time the simulator predicts from those same costs.

With ``sharded`` (``digen bench --sharded``) the bench measures sharded trainers instead:
one generator and ``workers - 1`` FSDP trainers with micro-batches of one sample, an update's
samples dealt over them against its (sample, timestep) terms dealt (:func:`sharded_rungs`),
and how well the planner's model predicts the second from the first
(:func:`summarise_sharded`).

The measuring (:func:`run_bench`) is separate from the reporting (:func:`format_table`,
:func:`plot_bench`), and :func:`summarise` is a pure function of the measured runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from digen.errors import stop_if_interrupted
from digen.sched.costs import COST_NAMES, EVENT_COST, Costs
from digen.sched.names import DRIVER, Pool, TaskKind, pool_of
from digen.sched.trace import KIND_COLOURS, KINDS, Trace, TraceEvent, device_of, union_length

__all__ = [
    "BenchSettings",
    "Rung",
    "RunMeasure",
    "colocated_variants",
    "format_table",
    "ladder",
    "plot_bench",
    "rungs",
    "sharded_rungs",
    "QUICK",
    "rung_configs",
    "run_bench",
    "summarise",
]

COLOCATED = "colocated"
NAIVE = "naive"


@dataclass(frozen=True, slots=True)
class Rung:
    """One configuration of the ladder."""

    key: str
    """Short id (``colocated``, ``naive``, ``pipeline``, ``gap``, ``tsp``, ``tag``, ``tcss``;
    a colocated variant: ``colocated-<processes>x<threads>``)."""
    name: str
    """What the table calls it."""
    mode: str
    """``colocated`` or ``disaggregated``."""
    overrides: tuple[str, ...]
    """Config overrides on top of the preset and the bench's shared settings."""
    threads: int | None = None
    """Colocated: torch threads of the lead process (this one) while the rung runs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class BenchSettings:
    """What every rung shares."""

    model: str = "flux"
    algo: str = "flowgrpo"
    size: int = 128
    """Image height and width in pixels."""
    steps: int = 8
    """Train steps per run; the first is warm-up and not counted."""
    repeats: int = 3
    """Runs of every rung, interleaved."""
    workers: int = 2
    """Worker processes in every rung (colocated: data-parallel processes at most;
    disaggregated: generators + trainers)."""
    cores: int = 2
    """CPU threads available in all (one process with all of them is a colocated variant)."""
    overrides: tuple[str, ...] = ()
    """The user's own config overrides, applied to every rung before the rung's own."""
    sharded: bool = False
    """Measure sharded trainers instead of the ladder (:func:`sharded_rungs`)."""

    @property
    def generators(self) -> int:
        return self.workers - self.workers // 2

    @property
    def trainers(self) -> int:
        return self.workers // 2

    @property
    def threads_per_worker(self) -> int:
        """Threads of each of ``workers`` processes: the cores shared out evenly."""
        return max(1, self.cores // self.workers)


QUICK: dict[str, int] = {"size": 64, "steps": 4, "repeats": 1}
"""``--quick``: a few minutes on a two-core laptop (tiny flavour, 64 px, 4 steps, once)."""


def colocated_variants(s: BenchSettings) -> list[Rung]:
    """The colocated configurations a user would try with ``s.cores`` threads and up to
    ``s.workers`` processes: one process with every thread, and ``workers`` data-parallel
    processes sharing the threads out (data-parallel workers after the first run with
    one thread each: :func:`digen.run.runner._dp_rank`)."""
    one = Rung(
        f"colocated-1x{s.cores}",
        f"colocated, 1 process x {s.cores} threads",
        COLOCATED,
        ("train.num_devices=1",),
        threads=s.cores,
    )
    out = [one]
    if s.workers > 1:
        out.append(
            Rung(
                f"colocated-{s.workers}x1",
                f"colocated, {s.workers} processes x 1 thread",
                COLOCATED,
                (f"train.num_devices={s.workers}",),
                threads=1,
            )
        )
    return out


def ladder(s: BenchSettings) -> list[Rung]:
    """Rungs 2-7: disaggregated, each adding one technique to the one before."""
    shared = (
        f"runtime.generators={s.generators}",
        f"runtime.trainers={s.trainers}",
        f"runtime.placement.threads_per_worker={s.threads_per_worker}",
    )
    steps = [
        (
            NAIVE,
            "naive disaggregated",
            (
                "runtime.schedule.pipeline=false",
                "runtime.schedule.tag=none",
                "runtime.schedule.microbatch_axis=prompt",
            ),
        ),
        (
            "pipeline",
            "+ pipelining (prompt axis)",
            (
                "runtime.schedule.pipeline=true",
                "runtime.schedule.tag=none",
                "runtime.schedule.microbatch_axis=prompt",
            ),
        ),
        (
            "gap",
            "+ GAP (generation axis)",
            ("runtime.schedule.tag=none", "runtime.schedule.microbatch_axis=generation"),
        ),
        (
            "tsp",
            "+ TSP (2 timesteps a pass)",
            ("runtime.schedule.tag=none", "runtime.schedule.tsp_degree=2"),
        ),
        ("tag", "+ TAG (BTS)", ("runtime.schedule.tag=bts",)),
        (
            "tcss",
            "+ TCSS (W=1, ratio 0.5)",
            ("runtime.schedule.max_staleness=1", "runtime.schedule.staleness_ratio=0.5"),
        ),
    ]
    rungs, acc = [], list(shared)
    for key, name, extra in steps:
        acc = _replace_keys(acc, extra)
        rungs.append(Rung(key, name, "disaggregated", tuple(acc)))
    return rungs


SAMPLES_DEALT, TERMS_DEALT, GROUPED = "sharded-samples", "sharded-terms", "sharded-grouped"


def sharded_rungs(s: BenchSettings) -> list[Rung]:
    """``--sharded``: one generator and ``workers - 1`` FSDP trainers, micro-batches of one
    sample (fewer than the trainers), no TAG, so the trainers train and nothing else: an
    update's samples dealt over them (one member trains, the others run padding passes),
    then its (sample, timestep) terms (every member trains its share), then a prompt
    group's micro-batches taken as one update, their terms dealt together."""
    shared = (
        "runtime.generators=1",
        f"runtime.trainers={s.workers - 1}",
        "runtime.placement.trainer_parallel=fsdp",
        f"runtime.placement.threads_per_worker={s.threads_per_worker}",
        "runtime.schedule.samples_per_microbatch=1",
        "runtime.schedule.tag=none",
    )
    terms = (*shared, "runtime.placement.shard_deal=terms")
    return [
        Rung(SAMPLES_DEALT, "sharded trainers, samples dealt", "disaggregated",
             (*shared, "runtime.placement.shard_deal=samples")),
        Rung(TERMS_DEALT, "sharded trainers, terms dealt", "disaggregated", terms),
        Rung(GROUPED, "sharded trainers, terms dealt, grouped updates", "disaggregated",
             (*terms, "runtime.schedule.group_updates=true")),
    ]  # fmt: skip


def rungs(s: BenchSettings) -> list[Rung]:
    """Every rung the bench runs, in order: the colocated variants and the ladder, or the
    sharded rungs."""
    if s.sharded:
        return sharded_rungs(s)
    return [*colocated_variants(s), *ladder(s)]


def _replace_keys(base: Sequence[str], extra: Sequence[str]) -> list[str]:
    """``base`` overrides with ``extra``'s keys set to ``extra``'s values."""
    keys = {e.split("=", 1)[0] for e in extra}
    return [b for b in base if b.split("=", 1)[0] not in keys] + list(extra)


def rung_configs(s: BenchSettings) -> dict[str, Any]:
    """Every rung's resolved config, key -> DigenConfig (a bad setting fails here, before
    anything runs, with the config's own one-sentence error)."""
    from digen.config import load_config
    from digen.presets import preset

    shared = [
        f"steps={s.steps}",
        "save_every=0",  # a checkpoint only at the end, outside every timed step
        f"model.height={s.size}",
        f"model.width={s.size}",
        "train.mini_batch_size=null",  # one optimizer step per train step in every rung
        *s.overrides,
    ]
    out = {}
    for rung in rungs(s):
        base = preset(s.model, s.algo, mode=rung.mode)
        out[rung.key] = load_config(base=base, overrides=[*shared, *rung.overrides])
    return out


# --- measuring ------------------------------------------------------------------------------


@dataclass(slots=True)
class RunMeasure:
    """What one run of one rung measured (steps after the first only)."""

    key: str
    repeat: int
    step_times_s: list[float]
    """From one step's end to the next (:func:`step_ends`)."""
    reported_step_times_s: list[float]
    """The metrics rows' ``step_time_s``."""
    samples_per_step: int
    utilization: dict[str, float]
    """Per pool: busy time / (the pool's workers x the window), over the steps after the first."""
    bubble_fraction: float
    """1 - busy time of every worker / (workers x the window)."""
    costs: dict[str, float]
    """Per-task costs measured in this run (seconds; per micro-batch, per step for step/sync)."""
    ideal_bound_s: float
    predicted_step_time_s: float
    wall_s: float
    """The whole run, processes' start-up included."""
    overhead_fraction: float = 0.0
    """Disaggregated: time calls spent outside the actors' own work (RPC, pickling, the
    driver's loop) over the work itself, the median of the counted steps' metrics; 0 for
    colocated runs, which make no calls."""
    call_overhead: dict[str, float] = field(default_factory=dict)
    """Disaggregated: seconds a call of each cost's kind spent outside the work
    (:func:`~digen.run.auto.call_overhead`), which the prediction adds."""
    events: list[TraceEvent] = field(default_factory=list, repr=False)


def measure_run(rung: Rung, cfg: Any, out_dir: Path, repeat: int) -> RunMeasure:
    """Run ``cfg`` into ``out_dir`` and measure it."""
    import torch

    from digen.run.runner import DigenRunner

    before = torch.get_num_threads()
    if rung.threads is not None:
        torch.set_num_threads(rung.threads)
    t0 = time.perf_counter()
    try:
        # the bench times steps, not sample grids
        runner = DigenRunner(
            cfg, out_dir=out_dir, progress=False, sample_grids=False, save_weights=False
        )
        result = asyncio.run(runner.run())
    finally:
        torch.set_num_threads(before)
    wall = time.perf_counter() - t0
    stop_if_interrupted(result)  # a signal stops the bench, not just this run
    rows = result.metrics
    trace = Trace.load_jsonl(out_dir / "trace.jsonl")
    return analyse(rung, cfg, rows, trace, repeat=repeat, wall_s=wall)


def analyse(
    rung: Rung, cfg: Any, rows: list[dict[str, Any]], trace: Trace, *, repeat: int, wall_s: float
) -> RunMeasure:
    """Measure a finished run from its metrics rows and trace (no processes)."""
    counted = rows[1:] or rows  # the first step pays for warm-up
    events = [e for e in trace.events if e.worker != DRIVER]
    first = counted[0]["step"]
    util, bubble = utilisation(events, first)
    costs, bound, predicted = _bound_and_prediction(rung, cfg, events, first, counted)
    ends = step_ends(events)
    # step time = from one step's end to the next in the trace, the same rule in every mode
    # (metrics' step_time_s starts a disaggregated step after the previous step's callbacks
    # while its workers keep going, a colocated step only when the next step starts)
    times = [ends[r["step"]] - ends[r["step"] - 1] for r in counted if r["step"] - 1 in ends]
    return RunMeasure(
        key=rung.key,
        repeat=repeat,
        step_times_s=times or [float(r["step_time_s"]) for r in counted],
        reported_step_times_s=[float(r["step_time_s"]) for r in counted],
        samples_per_step=int(counted[0]["samples"]),
        utilization=util,
        bubble_fraction=bubble,
        costs=costs,
        ideal_bound_s=bound,
        predicted_step_time_s=predicted,
        wall_s=wall_s,
        overhead_fraction=statistics.median(
            float(r.get("overhead_fraction", 0.0)) for r in counted
        ),
        call_overhead=_call_overhead(rung, counted),
        events=trace.events,
    )


def _call_overhead(rung: Rung, rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    from digen.run.auto import call_overhead

    return {} if rung.mode == COLOCATED else call_overhead(rows)


def step_ends(events: Sequence[TraceEvent]) -> dict[int, float]:
    """Per step, when it ended: its last optimizer step or weight sync, else its last task."""
    last: dict[int, float] = {}
    closing: dict[int, float] = {}
    for e in events:
        last[e.step] = max(last.get(e.step, e.t1), e.t1)
        if e.kind in (TaskKind.STEP, TaskKind.SYNC):
            closing[e.step] = max(closing.get(e.step, e.t1), e.t1)
    return {s: closing.get(s, last[s]) for s in sorted(last)}


def utilisation(events: Sequence[TraceEvent], first: int) -> tuple[dict[str, float], float]:
    """Per pool, busy time / (the pool's workers x wall), and the bubble fraction over every
    worker, in the window from the end of step ``first - 1`` to the end of the last step.

    Busy time is the union of a worker process's task intervals clipped to the window (its
    overlapping tasks count once, a scoring lane's with its generator's; work of a later step
    run early, as TCSS does, counts where it ran).
    """
    ends = step_ends(events)
    if not ends:
        return {}, float("nan")
    lo = ends.get(first - 1, min(e.t0 for e in events))
    hi = ends[max(ends)]
    wall = hi - lo
    by_worker: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        by_worker.setdefault(device_of(e.worker), [])
        a, b = max(e.t0, lo), min(e.t1, hi)
        if b > a:
            by_worker[device_of(e.worker)].append((a, b))
    busy = {w: union_length(iv) for w, iv in by_worker.items()}
    pools: dict[str, list[float]] = {}
    for w, b in busy.items():
        pools.setdefault(pool_of(w), []).append(b)
    if wall <= 0:
        return {p: 1.0 for p in pools}, 0.0
    util = {p: min(1.0, sum(b) / (len(b) * wall)) for p, b in pools.items()}
    total = min(1.0, sum(busy.values()) / (len(busy) * wall))
    return util, 1.0 - total


PREDICTION_DRAWS = 32
"""Simulations per prediction, each with task costs drawn from the run's own task times."""


def _measured(events: Sequence[TraceEvent]) -> dict[str, list[float]]:
    """Every task's seconds, by the cost its kind measures."""
    out: dict[str, list[float]] = {}
    for e in events:
        if e.kind in EVENT_COST:
            out.setdefault(EVENT_COST[e.kind], []).append(e.duration)
    return out


def _pick(rng: random.Random, measured: dict[str, list[float]], name: str, default: float) -> float:
    """One of the run's own times for cost ``name``; ``default`` when it timed none."""
    return rng.choice(measured[name]) if measured.get(name) else default


def _bound_and_prediction(
    rung: Rung,
    cfg: Any,
    events: Sequence[TraceEvent],
    first: int,
    rows: Sequence[dict[str, Any]] = (),
) -> tuple[dict[str, float], float, float]:
    """The run's measured costs (medians over the counted steps' tasks), the ideal bound of a
    step from them, and the predicted step time.

    Both replay the run in a model :data:`PREDICTION_DRAWS` times, each with every task's
    seconds drawn from the run's own task times (seeded), and take the median step over the
    draws. Disaggregated: :func:`~digen.sched.simulator.simulate_plan` runs the run's
    schedule plan, each task with the overhead the run measured for its kind
    (``overhead_ms/<kind>`` in ``rows``: RPC, pickling, the driver's loop), which a worker
    pays between tasks and the bound leaves out. Colocated:
    :func:`~digen.planning.layouts.simulate_colocated`, every worker generating and scoring its
    share of the step, then updating it, then the optimizer step, each phase as long as its
    slowest worker (the rewards' gather and the gradients' all-reduce are barriers).
    """
    from digen.config import schedule_plan
    from digen.planning.layouts import simulate_colocated
    from digen.run.auto import call_overhead
    from digen.sched.costs import OnlineProfiler
    from digen.sched.simulator import ideal_bound, simulate_plan

    counted = [e for e in events if e.step >= first]
    # medians, as the step times they are compared with
    prof = OnlineProfiler(method="median", window=1_000_000)
    prof.observe_all(counted)
    if not prof.ready():
        prof.observe_all(events)
    costs = prof.costs()
    if rung.mode == COLOCATED:
        world = cfg.train.num_devices
        samples = cfg.data.train_batch_size * cfg.rollout.n
        mbs = -(-samples // world // cfg.train.micro_batch_size) * world  # chunks of a step
        # a colocated worker scores its whole share at once: one score event per step
        score = costs.score * world / mbs
        costs = type(costs)(**{**costs.to_dict(), "score": score})
        chain = costs.gen + costs.score + costs.update
        shared = mbs * chain / world + costs.step
        # ideal_bound's rule with every worker in both roles: all work shared, or one chain
        bound = max(shared, chain + costs.step)
        # each draw of a score is one micro-batch's share of a worker's one scoring call
        measured = _measured(counted)
        measured["score"] = [d * world / mbs for d in measured.get("score", [])]
        rng = random.Random(0)
        times = []
        for _ in range(PREDICTION_DRAWS):
            sim = simulate_colocated(
                costs, mbs, world, steps=2, draw=lambda name, v: _pick(rng, measured, name, v)
            )
            times += sim.step_times
        return costs.to_dict(), bound, statistics.median(times)
    plan = schedule_plan(cfg)
    bound = ideal_bound(
        costs, plan.microbatches, plan.generators, plan.trainers, score_overlap=plan.score_overlap
    )
    extra = call_overhead(rows)
    # Task times vary (a TAG here took 0.34-0.44 s), and a step can hinge on whether an
    # update and a TAG fit inside one generation: simulate with costs drawn from the run's
    # own task times, and take the median step over the draws.
    measured = _measured(counted)
    rng = random.Random(0)
    times: list[float] = []
    for _ in range(PREDICTION_DRAWS):
        drawn = {name: _pick(rng, measured, name, getattr(costs, name)) for name in COST_NAMES}
        drawn = {k: v + extra.get(k, 0.0) for k, v in drawn.items()}
        # a grouped run timed whole groups' updates: one is what a group costs
        whole = {"update_fixed": drawn["update"]} if plan.group_updates else {}
        sim = simulate_plan(plan, Costs(**drawn, **whole))
        times += sim.step_times[first:] or sim.step_times
    return costs.to_dict(), bound, statistics.median(times)


def run_bench(
    s: BenchSettings,
    *,
    out_dir: Path | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, list[RunMeasure]]:
    """Run every rung ``s.repeats`` times, interleaved; key -> its runs, in ladder order.

    Run directories go under ``out_dir`` (``r<repeat>-<key>``), or a temporary directory
    that is removed afterwards.
    """
    cfgs = rung_configs(s)
    todo = rungs(s)
    say = progress or (lambda text: None)
    root = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="digen-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[RunMeasure]] = {r.key: [] for r in todo}
    try:
        for rep in range(s.repeats):
            for i, rung in enumerate(todo, 1):
                say(f"repeat {rep + 1}/{s.repeats}, run {i}/{len(todo)}: {rung.name} ...")
                run_dir = root / f"r{rep + 1}-{rung.key}"
                if run_dir.exists():
                    shutil.rmtree(run_dir)
                m = measure_run(rung, cfgs[rung.key], run_dir, rep)
                runs[rung.key].append(m)
                say(
                    f"  {statistics.median(m.step_times_s):.3f} s a step "
                    f"({m.wall_s:.1f} s with start-up)"
                )
    finally:
        if out_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return runs


# --- reporting ------------------------------------------------------------------------------


def summarise(
    s: BenchSettings, runs: dict[str, list[RunMeasure]], *, command: str | None = None
) -> dict[str, Any]:
    """The bench's JSON: ``modes`` (rungs 1-7, rung 1 the fastest colocated variant),
    ``colocated_variants`` (every one tried), settings, machine and command; with
    ``s.sharded``, ``sharded`` instead (:func:`summarise_sharded`)."""
    if s.sharded:
        return summarise_sharded(s, runs, command=command)
    variants = colocated_variants(s)
    rows = {r.key: _row(r, runs[r.key]) for r in [*variants, *ladder(s)]}
    best = min((v.key for v in variants), key=lambda k: rows[k]["step_time_s"])
    colocated = rows[best]["step_time_s"]
    naive = rows[NAIVE]["step_time_s"]
    for row in rows.values():
        row["speedup_vs_colocated"] = colocated / row["step_time_s"]
        row["speedup_vs_naive"] = naive / row["step_time_s"]
    first = dict(rows[best], name="colocated (best variant)", key=COLOCATED, variant=best)
    modes = [first, *(rows[r.key] for r in ladder(s))]
    for i, m in enumerate(modes, 1):
        m["rung"] = i
    return {
        "modes": modes,
        "colocated_variants": [dict(rows[v.key], chosen=v.key == best) for v in variants],
        "settings": asdict(s),
        "machine": machine_info(),
        "command": command if command is not None else " ".join(sys.argv),
        "argv": list(sys.argv),
    }


def summarise_sharded(
    s: BenchSettings, runs: dict[str, list[RunMeasure]], *, command: str | None = None
) -> dict[str, Any]:
    """``--sharded``: both rungs, the speed-up of dealing terms, and the planner's prediction
    of the terms rung from the samples rung alone.

    The prediction scales the samples rung's measured update by the members' shares of the
    work (:meth:`~digen.planning.layouts.Workload.trained_share`, the planner's model: by
    samples every member runs as many passes as the member that trains the sample; by terms
    each runs its share of the terms) and replays the terms rung's schedule with those costs
    (:func:`~digen.sched.simulator.simulate_plan`, the samples rung's other costs and call
    overheads, drawn as :func:`_bound_and_prediction` draws them)."""
    from digen.algos.train_step import terms_per_sample
    from digen.config import schedule_plan
    from digen.planning.layouts import Workload
    from digen.sched.simulator import simulate_plan

    by_key = {r.key: r for r in sharded_rungs(s)}
    rows = {k: _row(by_key[k], runs[k]) for k in (SAMPLES_DEALT, TERMS_DEALT, GROUPED)}
    cfgs = rung_configs(s)
    cfg = cfgs[TERMS_DEALT]
    plan = schedule_plan(cfg)
    trainers = cfg.runtime.trainers
    work = Workload(
        costs=Costs(gen=1.0, update=1.0),
        microbatches=plan.microbatches,
        samples_per_microbatch=1,
        tsp_degree=cfg.runtime.schedule.tsp_degree,
        timesteps=terms_per_sample(cfg, 0),
        pass_samples=cfg.train.micro_batch_size,
    )
    terms_share, terms_passes = work.trained_share(trainers, tsp=True)
    by_samples = dataclasses.replace(work, shard_deal="samples")
    samples_share, samples_passes = by_samples.trained_share(trainers, tsp=True)
    # every member runs the passes of the member with most work: its share is what it costs
    scale = terms_share / samples_share
    rng = random.Random(0)
    times: list[float] = []
    for m in runs[SAMPLES_DEALT]:
        measured = _measured([e for e in m.events if e.worker != DRIVER and e.step >= 1])
        base = Costs(**m.costs)
        for _ in range(PREDICTION_DRAWS):
            drawn = {n: _pick(rng, measured, n, getattr(base, n)) for n in COST_NAMES}
            drawn["update"] *= scale
            costs = {k: v + m.call_overhead.get(k, 0.0) for k, v in drawn.items()}
            sim = simulate_plan(plan, Costs(**costs))
            times += sim.step_times[1:] or sim.step_times
    predicted = statistics.median(times)
    measured_terms = rows[TERMS_DEALT]["step_time_s"]
    return {
        "sharded": {
            "rungs": [rows[SAMPLES_DEALT], rows[TERMS_DEALT], rows[GROUPED]],
            "speedup_terms_vs_samples": rows[SAMPLES_DEALT]["step_time_s"] / measured_terms,
            "speedup_grouped_vs_terms": measured_terms / rows[GROUPED]["step_time_s"],
            "update_speedup": rows[SAMPLES_DEALT]["costs"]["update"]
            / rows[TERMS_DEALT]["costs"]["update"],
            "model": {
                "trainers": trainers,
                "trained_timesteps": work.timesteps,
                "passes_by_samples": samples_passes,
                "passes_by_terms": terms_passes,
                "update_scale": scale,
                "predicted_terms_step_time_s": predicted,
                "prediction_error": (predicted - measured_terms) / measured_terms,
            },
        },
        "settings": asdict(s),
        "machine": machine_info(),
        "command": command if command is not None else " ".join(sys.argv),
        "argv": list(sys.argv),
    }


def _row(rung: Rung, runs: list[RunMeasure]) -> dict[str, Any]:
    times = [t for m in runs for t in m.step_times_s]
    step = statistics.median(times)
    q = statistics.quantiles(times, n=4, method="inclusive") if len(times) > 1 else [step] * 3
    pools = sorted({p for m in runs for p in m.utilization})
    predicted = statistics.median(m.predicted_step_time_s for m in runs)
    bound = statistics.median(m.ideal_bound_s for m in runs)
    return {
        "name": rung.name,
        "key": rung.key,
        "mode": rung.mode,
        "overrides": list(rung.overrides),
        "threads": rung.threads,
        "step_time_s": step,
        "step_time_min_s": min(times),
        "step_time_max_s": max(times),
        "step_time_iqr_s": [q[0], q[2]],
        "step_times_s": times,
        "reported_step_time_s": statistics.median(t for m in runs for t in m.reported_step_times_s),
        "samples_per_s": runs[0].samples_per_step / step,
        "utilization": {
            p: statistics.median(m.utilization[p] for m in runs if p in m.utilization)
            for p in pools
        },
        "bubble_fraction": statistics.median(m.bubble_fraction for m in runs),
        "overhead_fraction": statistics.median(m.overhead_fraction for m in runs),
        "ideal_bound_s": bound,
        "bound_ratio": step / bound if bound > 0 else float("nan"),
        "predicted_step_time_s": predicted,
        "prediction_error": (predicted - step) / step,
        "prediction": (
            "per step, the slowest worker's generate + score, update, and step, summed"
            if rung.mode == COLOCATED
            else "simulate_plan with the run's costs plus its measured call overhead"
        ),
        "costs": {k: statistics.median(m.costs[k] for m in runs) for k in runs[0].costs},
        "repeats": len(runs),
        "run_wall_s": [m.wall_s for m in runs],
    }


def machine_info() -> dict[str, Any]:
    import torch

    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "date": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    }


def format_table(report: dict[str, Any]) -> str:
    """The ladder as a markdown table (the colocated variants not chosen as extra rows); the
    sharded rungs as theirs."""
    if "sharded" in report:
        return format_sharded(report["sharded"])
    head = (
        "| rung | step s median [min-max] | samples/s | vs colocated | vs naive "
        "| util gen / trainer | bubble % | call overhead % | bound ratio | predicted s "
        "| pred error % |"
    )
    lines = [head, "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    extra = [v for v in report["colocated_variants"] if not v["chosen"]]
    for m in report["modes"]:
        label = f"{m['rung']}. {m['name']}"
        if m["key"] == COLOCATED:
            chosen = next(v for v in report["colocated_variants"] if v["chosen"])
            label += f": {chosen['name'].removeprefix('colocated, ')}"
        lines.append(_table_line(label, m))
    for v in extra:
        lines.append(_table_line(f"({v['name']})", v))
    return "\n".join(lines)


def format_sharded(sh: dict[str, Any]) -> str:
    """``--sharded``'s table and the planner's prediction, in markdown."""
    lines = [
        "| rung | step s median [min-max] | update s | util gen / trainer | predicted s "
        "| pred error % |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for m in sh["rungs"]:
        u = m["utilization"]
        lines.append(
            f"| {m['name']} | {m['step_time_s']:.3f} [{m['step_time_min_s']:.3f}-"
            f"{m['step_time_max_s']:.3f}] | {m['costs']['update']:.3f} "
            f"| {u.get(Pool.GENERATOR, float('nan')):.2f} / {u.get(Pool.TRAINER, float('nan')):.2f}"
            f" | {m['predicted_step_time_s']:.3f} | {100 * m['prediction_error']:+.0f} |"
        )
    mo = sh["model"]
    lines += [
        "",
        f"terms dealt vs samples dealt: {sh['speedup_terms_vs_samples']:.2f}x a step, "
        f"{sh['update_speedup']:.2f}x an update; grouped updates vs one a micro-batch: "
        f"{sh['speedup_grouped_vs_terms']:.2f}x a step.",
        f"planner's model ({mo['trainers']} trainers, {mo['trained_timesteps']} trained "
        f"timesteps a sample, {mo['passes_by_samples']} passes a member by samples, "
        f"{mo['passes_by_terms']} by terms): the samples rung's update x {mo['update_scale']:.2f} "
        f"predicts {mo['predicted_terms_step_time_s']:.3f} s a step dealing terms "
        f"({100 * mo['prediction_error']:+.0f} %).",
    ]
    return "\n".join(lines)


def _table_line(label: str, m: dict[str, Any]) -> str:
    u = m["utilization"]
    if Pool.GENERATOR in u or Pool.TRAINER in u:
        util = (
            f"{u.get(Pool.GENERATOR, float('nan')):.2f} / {u.get(Pool.TRAINER, float('nan')):.2f}"
        )
    else:  # colocated: every worker does both jobs
        util = " / ".join(f"{v:.2f}" for v in u.values()) + " (both)"
    return (
        f"| {label} | {m['step_time_s']:.3f} [{m['step_time_min_s']:.3f}-{m['step_time_max_s']:.3f}]"
        f" | {m['samples_per_s']:.1f} | {m['speedup_vs_colocated']:.2f}x"
        f" | {m['speedup_vs_naive']:.2f}x | {util} | {100 * m['bubble_fraction']:.0f}"
        f" | {100 * m.get('overhead_fraction', 0.0):.1f} | {m['bound_ratio']:.2f} | {m['predicted_step_time_s']:.3f}"
        f" | {100 * m['prediction_error']:+.0f} |"
    )


def plot_bench(
    report: dict[str, Any],
    runs: dict[str, list[RunMeasure]],
    path: str | os.PathLike[str],
    *,
    dpi: int = 100,
) -> Path:
    """One picture: every rung's timeline (its last run) on one shared time axis, one panel
    per rung, and a bar chart of the speed-ups over colocated and over naive."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if "sharded" in report:
        base = report["sharded"]["rungs"][0]["step_time_s"]
        modes = [
            dict(m, rung=i, speedup_vs_samples=base / m["step_time_s"])
            for i, m in enumerate(report["sharded"]["rungs"], 1)
        ]
        bars = [("vs samples dealt", "speedup_vs_samples", "#1f77b4")]
    else:
        modes = report["modes"]
        bars = [
            ("vs colocated", "speedup_vs_colocated", "#1f77b4"),
            ("vs naive", "speedup_vs_naive", "#ff7f0e"),
        ]
    traces = []
    for m in modes:
        key = m.get("variant", m["key"])
        traces.append([e for e in runs[key][-1].events if e.worker != DRIVER])
    lanes = [sorted({e.worker for e in evs}, key=_lane_key) for evs in traces]
    heights = [max(1, len(ln)) for ln in lanes] + [max(3, len(modes) // 2)]
    fig = Figure(figsize=(16, 1.0 + 0.45 * sum(heights)), dpi=dpi)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heights), 1, gridspec_kw={"height_ratios": heights})
    span = max(
        (max(e.t1 for e in evs) - min(e.t0 for e in evs) for evs in traces if evs), default=1.0
    )
    for ax, m, evs, names in zip(axes[:-1], modes, traces, lanes, strict=True):
        _draw_lanes(ax, evs, names, span)
        ax.set_title(
            f"{m['rung']}. {m['name']}: {m['step_time_s']:.3f} s a step", loc="left", fontsize=9
        )
        ax.set_xlim(0, span)
        if ax is not axes[-2]:
            ax.tick_params(labelbottom=False)
    axes[-2].set_xlabel("seconds from the run's first task")
    ax = axes[-1]
    x = range(len(modes))
    width = 0.8 / len(bars)
    for b, (label, key, colour) in enumerate(bars):
        at = [i + (b - (len(bars) - 1) / 2) * width for i in x]
        ax.bar(at, [m[key] for m in modes], width, label=label, color=colour)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks(list(x), labels=[f"{m['rung']}. {m['name']}" for m in modes], fontsize=8)
    ax.set_ylabel("speed-up")
    ax.legend(fontsize=8, loc="upper left", frameon=False)
    handles = [Patch(facecolor=KIND_COLOURS[k], label=k) for k in KINDS]
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), frameon=False, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=dpi)
    os.replace(tmp, out)
    return out


def _lane_key(worker: str) -> tuple[int, str]:
    order = {Pool.GENERATOR: 0, Pool.TRAINER: 1}
    return order.get(pool_of(worker), 2), worker


def _draw_lanes(ax: Any, events: list[TraceEvent], workers: list[str], span: float) -> None:
    """One lane per worker, tasks coloured by kind (short tasks drawn a few pixels wide)."""
    start = min((e.t0 for e in events), default=0.0)
    lane = {w: i for i, w in enumerate(workers)}
    shortest = span * 0.002
    bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for e in events:
        bars.setdefault((e.worker, e.kind), []).append((e.t0 - start, max(e.duration, shortest)))
    for kind in KINDS:
        for w in workers:
            if (w, kind) in bars:
                ax.broken_barh(
                    bars[(w, kind)], (lane[w] - 0.4, 0.8), facecolors=KIND_COLOURS[kind], lw=0
                )
    for end in step_ends(events).values():
        ax.axvline(end - start, color="black", ls="--", lw=0.8)
    ax.set_yticks(range(len(workers)), labels=workers, fontsize=8)
    ax.set_ylim(len(workers) - 0.5, -0.5)
