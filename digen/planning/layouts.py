"""The planner: colocated or split, which split, on which devices, ranked by time and by cost.

Every candidate layout of a set of devices is simulated with the same task costs:

- **colocated**: every device generates and scores its share of the step's micro-batches,
  the rewards are gathered, every device trains its share, then the optimizer step: three
  phases, each as long as its slowest device (:func:`simulate_colocated`); with and without
  TSP when the update was timed both ways;
- **split**: ``G`` generators and ``T`` trainers, for every split (one kind of device) or
  the given pools (two kinds), each under every TAG policy (none, static-k, BTS) without and
  with TCSS, simulated by the runtime's own scheduler model
  (:func:`~digen.sched.simulator.simulate`).

On GPUs (a :class:`~digen.planning.hardware.Hardware` description and the model's
:class:`~digen.planning.hardware.ModelSize`), each candidate also pays the terms of
:mod:`digen.planning.hardware` its layout incurs, and only layouts that fit in memory are
ranked:

- colocated: replicated training state when it fits beside everything else (then the
  gradients are all-reduced at the optimizer step), else FSDP over all devices, and then one
  of three ways to sample, the fastest that fits: *gathered copy* (a full bf16 copy gathered
  once a step), *sharded sampling* (every block gathered at every forward pass), *offload*
  (the training state moved to host memory and back each step, then a gathered copy);
- split: generators hold a full bf16 copy and the reward model; trainers replicate or shard
  (FSDP, one lockstep slot that deals each micro-batch's (sample, timestep) terms, or its
  samples, over its devices; every forward/backward pass gathers the model); TAG on sharded
  trainers samples with sharded weights; new weights reach the generators each step
  (:func:`~digen.planning.hardware.weight_sync_s` over the link between the pools).

Costs are per micro-batch, measured on one device (a run's ``profile.json``); another kind
of device runs them ``speed`` times faster (:meth:`Hardware.speed`). The price of a
candidate is its devices' price per hour; ``cost_per_1k`` is that price times the step time,
per 1,000 samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from digen.errors import DigenError
from digen.planning.hardware import (
    FROZEN_BYTES,
    GRAD_BYTES,
    RECOMPUTE,
    Device,
    Hardware,
    ModelSize,
    activation_bytes,
    allgather_s,
    allreduce_s,
    fsdp_update_s,
    offload_reload_s,
    overlapped,
    reward_bytes,
    sampling_activation_bytes,
    sampling_copy_bytes,
    sharded_sampling_s,
    train_state_bytes,
    ulysses_s,
    weakest,
    weight_sync_s,
)
from digen.sched.costs import Costs
from digen.sched.names import TaskKind, worker_names
from digen.sched.simulator import SimResult, simulate
from digen.sched.tag import BTS, NoTAG, StaticTAG, TagPolicy
from digen.sched.trace import TraceEvent

__all__ = [
    "COLOCATED",
    "SPLIT",
    "Candidate",
    "DoesNotFit",
    "SplitCosts",
    "Workload",
    "by_cost",
    "best_colocated",
    "colocated_costs",
    "explain",
    "format_plan",
    "grouped_update",
    "with_grouped_updates",
    "plan",
    "simulate_colocated",
    "split_costs",
]

COLOCATED, SPLIT = "colocated", "split"
SHARD_DEALS = ("terms", "samples", "sequence")
"""What sharded trainers may deal over their members (``runtime.placement.shard_deal``)."""
SEQUENCE_DEGREES = (1, 2, 4, 8)
"""Devices a generator may split its samples' tokens over (sequence parallelism)."""
_POLICY_RANK = {"none": 0, "static": 1, "bts": 2}
COLOCATED_WORKER = "worker"
"""Colocated devices' pool name in traces (``worker-0``, ...), as the colocated runtime's."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """What one train step asks for, and what its tasks cost on the measured device."""

    costs: Costs
    """Per micro-batch (``update`` one timestep at a time, unless TSP was the only timing)."""
    microbatches: int
    """Micro-batches a step."""
    samples_per_microbatch: int = 1
    mbs_per_group: int = 1
    """Micro-batches of one prompt's group (GAP); updates wait for a whole group."""
    update_tsp: float | None = None
    """Update of one micro-batch with TSP, when it was timed too."""
    tsp_degree: int = 1
    """The TSP degree ``update_tsp`` was timed at."""
    passes: int = 0
    """Forward passes of the denoiser to sample one micro-batch (sampling steps, twice with
    separate guidance passes): what sharded sampling gathers for."""
    timesteps: int = 1
    """Trained timesteps a sample: an update's terms are its samples x these."""
    pass_samples: int | None = None
    """Samples a training forward pass holds (``train.micro_batch_size``); None: a
    micro-batch's. With TSP a pass holds ``tsp_degree`` timesteps of each."""
    shard_deal: str = "terms"
    """What sharded trainers deal over their members: ``terms``, ``samples`` or
    ``sequence`` (every term, the tokens split) (``runtime.placement.shard_deal``)."""
    guided: bool = False
    """Sampling runs both branches of classifier-free guidance (two rows a sample), which
    CFG parallelism puts on two devices."""
    model: ModelSize | None = None
    """The model's sizes (GPU terms need them)."""

    def __post_init__(self) -> None:
        names = ("microbatches", "samples_per_microbatch", "mbs_per_group", "tsp_degree")
        for name in (*names, "timesteps", *(("pass_samples",) if self.pass_samples else ())):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DigenError(f"{name} must be an integer >= 1, got {v!r}")
        if self.shard_deal not in SHARD_DEALS:
            raise DigenError(
                f"shard_deal must be one of {', '.join(SHARD_DEALS)}, got {self.shard_deal!r}"
            )
        if self.update_tsp is not None and not (
            math.isfinite(self.update_tsp) and self.update_tsp >= 0
        ):
            raise DigenError(f"update_tsp must be seconds >= 0, got {self.update_tsp!r}")

    @property
    def samples(self) -> int:
        return self.microbatches * self.samples_per_microbatch

    def update(self, tsp: bool) -> float:
        if tsp and self.update_tsp is not None:
            return self.update_tsp
        return self.costs.update

    def tsp_degrees(self) -> list[int]:
        """The TSP degrees the planner weighs: the timed one, and, where the two timings
        differ in passes (:meth:`at_degree` can model others), every power of two up to the
        trained timesteps. None without a TSP timing."""
        if self.update_tsp is None:
            return []
        k = self.timesteps
        if k == -(-k // self.tsp_degree):
            return [self.tsp_degree]
        return sorted({self.tsp_degree} | {d for d in (2, 4, 8, 16) if d <= k})

    def at_degree(self, degree: int) -> Workload:
        """This workload with TSP timed at ``degree``: an update costs a fixed part a
        forward/backward pass and a part a term, the line through the two timings (one
        timestep a pass: ``K`` passes; ``tsp_degree`` a pass: ``ceil(K / D)``), so at degree
        ``d`` it pays ``ceil(K / d)`` passes' fixed part and every term's. A larger degree
        saves passes and holds more rows a pass (activations grow with it)."""
        if degree == self.tsp_degree:
            return self
        k, timed = self.timesteps, self.tsp_degree
        passes = k - -(-k // timed)
        if self.update_tsp is None or passes == 0:
            raise DigenError(f"TSP degree {degree} cannot be modelled from this workload's timings")
        per_pass = (self.costs.update - self.update_tsp) / passes
        terms = self.costs.update - k * per_pass
        update = max(-(-k // degree) * per_pass + terms, 0.0)
        return dataclasses.replace(self, update_tsp=update, tsp_degree=degree)

    def at_degrees(self, tsp: bool) -> list[Workload]:
        """With TSP, this workload at every degree the planner weighs
        (:meth:`tsp_degrees`); without, itself."""
        return [self.at_degree(d) for d in self.tsp_degrees()] if tsp else [self]

    def degree(self, tsp: bool) -> int:
        """Timesteps a training pass batches: the TSP degree with TSP, or when it is the
        only timing (then at the run's degree); else 1."""
        return self.tsp_degree if tsp or self.update_tsp is None else 1

    def pass_rows(self, *, tsp: bool) -> int:
        """Rows (terms) one training forward/backward pass holds at most: a pass's samples,
        times the TSP degree."""
        return (self.pass_samples or self.samples_per_microbatch) * self.degree(tsp)

    def trained_share(self, members: int, *, tsp: bool) -> tuple[float, int]:
        """What one of ``members`` trainers sharing one model (FSDP) does of a micro-batch's
        update: its share of the terms, and its forward/backward passes (each gathers the
        whole model, and every member runs as many, in lockstep). Dealt by samples, a member
        trains ``ceil(n / T)`` of the ``n`` samples at all ``K`` trained timesteps, ``d`` of
        them a pass with TSP; dealt by terms, ``ceil(n K / T)`` (sample, timestep) pairs, a
        pass's worth (``pass_samples x d``) at a time; with the tokens split (``sequence``)
        every pass of the update, each with ``1 / T`` of every row's tokens. One member: the
        whole update."""
        n, k, d = self.samples_per_microbatch, self.timesteps, self.degree(tsp)
        per_pass = self.pass_samples or n
        if self.shard_deal == "sequence" and members > 1:
            return 1 / members, -(-n // per_pass) * -(-k // d)
        if self.shard_deal == "terms" and members > 1:
            terms = -(-n * k // members)
            return terms / (n * k), -(-terms // (per_pass * d))
        rows = -(-n // members)
        return rows / n, -(-rows // per_pass) * -(-k // d)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidate:
    """One layout, simulated."""

    layout: str
    """``colocated`` or ``split``."""
    generators: int
    """Generator devices (0 when colocated)."""
    trainers: int
    """Trainer devices; colocated: every device."""
    policy: str = "-"
    """Split: the TAG policy (``none``, ``static-k``, ``bts``)."""
    tcss: bool = False
    tsp: bool = False
    step_time: float = math.inf
    samples_per_step: int = 1
    price_h: float = 0.0
    """The devices' price per hour."""
    strategy: str = ""
    """How the model sits on the devices (GPU terms): ``replicated``, ``gathered copy``,
    ``sharded sampling``, ``offload``; for a split, ``fsdp trainers`` or ``replicated``."""
    terms: dict[str, float] = field(default_factory=dict)
    """Seconds a step of each GPU term, as the candidate pays it (before overlap)."""
    tsp_degree: int = 1
    grouped: bool = False
    """Split with sharded trainers: a group's micro-batches are one update
    (``runtime.schedule.group_updates``)."""
    checkpointing: bool = False
    """Training recomputes each block in the backward (per-block activation
    checkpointing): the activations of a pass fit only so."""
    generator_sequence: int = 1
    """Split: devices of a generator that share each sample's tokens (sequence
    parallelism); the generators are ``generators / (this x 2 with CFG)``."""
    generator_cfg: bool = False
    """Split: a generator's guidance branches run on two devices (CFG parallelism)."""
    shard_deal: str = ""
    """Split with sharded trainers: what they deal (``terms``, ``samples``, ``sequence``)."""
    trainer_sampling: str = ""
    """Split with sharded trainers: how they sample a TAG micro-batch (``rows`` dealt, or
    ``sequence``: every row, the tokens split)."""

    @property
    def devices(self) -> int:
        return self.generators + self.trainers

    @property
    def cost_per_1k(self) -> float | None:
        """Price of 1,000 samples; None when the devices are not priced."""
        if self.price_h <= 0:
            return None
        return self.price_h * self.step_time / 3600 * 1000 / self.samples_per_step

    @property
    def label(self) -> str:
        """``colocated + TSP 4 on 8 devices``, ``6G+2T bts + TCSS``."""
        if self.layout == COLOCATED:
            tsp = f" + TSP {self.tsp_degree}" if self.tsp else ""
            return f"colocated{tsp} on {self.trainers} devices"
        tcss = " + TCSS" if self.tcss else ""
        tsp = f" + TSP {self.tsp_degree}" if self.tsp else ""
        grouped = " + grouped updates" if self.grouped else ""
        ways = [
            w
            for w, on in (
                ("CFG 2", self.generator_cfg),
                (f"SP {self.generator_sequence}", self.generator_sequence > 1),
            )
            if on
        ]
        each = f" ({' x '.join(ways)})" if ways else ""
        return f"{self.generators}G{each}+{self.trainers}T {self.policy}{tsp}{grouped}{tcss}"

    @property
    def how(self) -> str:
        """How the model sits: ``fsdp trainers, tokens split, checkpointed``, ..."""
        parts = [self.strategy or "-"]
        if self.shard_deal == "sequence":
            parts.append("tokens split")
        elif self.trainer_sampling == "sequence":
            parts.append("tokens split to sample")
        if self.checkpointing:
            parts.append("checkpointed")
        return ", ".join(parts)

    @property
    def generator_group(self) -> int:
        """Devices a generator runs on."""
        return self.generator_sequence * (2 if self.generator_cfg else 1)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["label"] = self.label
        d["cost_per_1k"] = self.cost_per_1k
        return d


# -- the colocated model ----------------------------------------------------------------------


def simulate_colocated(
    costs: Costs,
    microbatches: int,
    devices: int,
    *,
    steps: int = 1,
    switch_s: float = 0.0,
    draw: Callable[[str, float], float] | None = None,
) -> SimResult:
    """Simulate ``steps`` colocated train steps over ``devices`` data-parallel devices.

    Micro-batch ``m`` of a step goes to device ``m mod devices``. A step is a phase switch
    (``switch_s``, moving weights between the training and sampling layouts; a ``sync``
    event), then three phases, each ending when its slowest device is done (the rewards'
    gather, the gradients' all-reduce): every device generates its micro-batches and scores
    them in one go (``score`` per micro-batch), updates them, and runs the optimizer
    ``step``. ``draw(cost_name, value)`` gives each task's seconds (default: ``value``, the
    cost), so a caller can draw them from measured times.
    """
    if not isinstance(devices, int) or devices < 1:
        raise DigenError(f"devices must be an integer >= 1, got {devices!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise DigenError(f"microbatches must be an integer >= 1, got {microbatches!r}")
    take = draw or (lambda _name, value: value)
    names = worker_names(COLOCATED_WORKER, devices)
    shares = [list(range(w, microbatches, devices)) for w in range(devices)]
    events: list[TraceEvent] = []
    now, ends = 0.0, []

    def phase(step: int, tasks: Callable[[int], list[tuple[str, int, float]]]) -> float:
        end = now
        for w, name in enumerate(names):
            t = now
            for kind, mb, seconds in tasks(w):
                events.append(TraceEvent(kind, name, step, mb, step, t, t + seconds))
                t += seconds
            end = max(end, t)
        return end

    for s in range(steps):
        if switch_s > 0:
            now = phase(s, lambda w: [(TaskKind.SYNC, -1, take("sync", switch_s))])

        def sample(w: int) -> list[tuple[str, int, float]]:
            out = [(TaskKind.GENERATE, m, take("gen", costs.gen)) for m in shares[w]]
            if shares[w]:  # one scoring call for the device's whole share
                score = sum(take("score", costs.score) for _ in shares[w])
                out.append((TaskKind.SCORE, shares[w][0], score))
            return out

        now = phase(s, sample)
        now = phase(
            s, lambda w: [(TaskKind.UPDATE, m, take("update", costs.update)) for m in shares[w]]
        )
        now = phase(s, lambda w: [(TaskKind.STEP, -1, take("step", costs.step))])
        ends.append(now)
    events.sort(key=lambda e: (e.t0, e.worker, e.t1))
    return SimResult(
        makespan=now,
        events=events,
        step_ends=ends,
        tag_count=0,
        bubble_count=0,
        decisions=[],
        stale={s: 0 for s in range(steps)},
    )


# -- what each layout costs on GPUs -------------------------------------------------------------


class DoesNotFit(ValueError):
    """A layout that cannot hold the model (the message says what does not fit where)."""


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.0f} GB"


def _room(d: Device) -> str:
    return f"{d.memory_gb:g} GB less {d.reserve_gb:g} GB reserved"


def _training_fit(
    work: Workload,
    device: Device,
    beside: float,
    *,
    tsp: bool,
    who: str,
    what: str = "",
    degree: int = 1,
) -> bool:
    """Whether a training pass's activations (:func:`activation_bytes`) fit on ``device``
    beside ``beside`` bytes of training state only with per-block checkpointing (tried
    second), ``degree`` devices sharing each row's tokens. Raises :class:`DoesNotFit`:
    ``who`` ``what`` when the state alone does not fit, else naming the activations. With the model's token count unknown: False where the
    state fits."""
    assert work.model is not None
    if not device.fits(beside):  # the state itself, before any activation
        raise DoesNotFit(f"{who} {what} ({_gb(beside)} a device; {_room(device)})")
    rows = work.pass_rows(tsp=tsp)
    act = 0.0
    for checkpointing in (False, True):
        act = activation_bytes(work.model, rows, checkpointing=checkpointing, degree=degree)
        if device.fits(beside + act):
            return checkpointing
    split = f" ({degree} devices sharing its tokens)" if degree > 1 else ""
    raise DoesNotFit(
        f"{who}: a training pass{split} of {rows} row(s) of {work.model.tokens} tokens keeps "
        f"{_gb(act)} of activations even checkpointed a block at a time, beside "
        f"{_gb(beside)} of training state ({_room(device)})"
    )


def colocated_costs(
    work: Workload,
    hw: Hardware | None,
    devices: int,
    *,
    tsp: bool,
    device: Device | None = None,
    engine: bool = False,
) -> list[tuple[str, Costs, float, dict[str, float]]]:
    """Every way the colocated layout can hold the model on ``devices`` of ``device`` (the
    trainer kind by default): ``(strategy, per-micro-batch costs, switch seconds a step,
    terms a step)``, or the plain costs when there are no GPU terms. Raises
    :class:`DoesNotFit` when none fits.

    ``engine``: sampling runs in a separate rollout engine that keeps its own full copy (as
    veRL-Omni does with vLLM-Omni): each step the new weights are gathered into it, and when
    the engine's copy and the training state do not both fit, each is moved to host memory
    while the other works (*rollout engine swaps*)."""
    base = dataclasses.replace(work.costs, update=work.update(tsp))
    if hw is None or work.model is None:
        return [("", base, 0.0, {})]
    d = device or hw.trainer
    speed = hw.speed(d)
    m = work.model
    scaled = Costs(
        gen=base.gen / speed,
        gen_tag=base.gen / speed,
        score=base.score / speed,
        update=base.update / speed,
        step=base.step / speed,
        sync=0.0,
    )
    per_device = -(-work.microbatches // devices)
    copy, reward = sampling_copy_bytes(m), reward_bytes(m)
    try:  # every device holds everything: it samples with the weights it trains
        ckpt = _training_fit(work, d, train_state_bytes(m) + reward, tsp=tsp, who="")
    except DoesNotFit:
        pass
    else:
        grads = allreduce_s(m.trained * GRAD_BYTES, devices, d.link_gb_s)
        terms = {"gradient all-reduce": grads, **_recompute(scaled.update, per_device, ckpt)}
        update = scaled.update * (RECOMPUTE if ckpt else 1.0)
        c = dataclasses.replace(scaled, update=update, step=scaled.step + grads)
        return [("replicated", c, 0.0, terms)]
    shard = train_state_bytes(m, devices)
    ckpt = _training_fit(
        work,
        d,
        shard + reward,
        tsp=tsp,
        who=f"{devices} {d.kind}",
        what="cannot hold the training state even sharded, with the reward model",
    )
    # every forward/backward pass of an update gathers the whole model (TSP makes fewer)
    _, passes = work.trained_share(1, tsp=tsp)
    fsdp = passes * fsdp_update_s(m, devices, d.link_gb_s)
    compute = scaled.update * (RECOMPUTE if ckpt else 1.0)
    trained = dataclasses.replace(scaled, update=compute + fsdp)
    fsdp_term = {"fsdp update": fsdp * per_device, **_recompute(scaled.update, per_device, ckpt)}
    gather = allgather_s(copy, devices, d.link_gb_s)
    if engine:
        if d.fits(shard + copy + reward):
            return [("rollout engine", trained, gather, {**fsdp_term, "copy gather": gather})]
        if not d.fits(copy + reward):
            raise DoesNotFit(f"a {d.kind} cannot hold the rollout engine's copy ({_gb(copy)})")
        moved = offload_reload_s(shard, d.host_gb_s) + offload_reload_s(copy, d.host_gb_s)
        terms = {**fsdp_term, "swaps": moved, "copy gather": gather}
        return [("rollout engine swaps", trained, moved + gather, terms)]
    out = []
    if d.fits(shard + copy + reward):
        out.append(("gathered copy", trained, gather, {**fsdp_term, "copy gather": gather}))
    gathers = sharded_sampling_s(m, devices, d.link_gb_s, work.passes)
    sharded = dataclasses.replace(trained, gen=overlapped(trained.gen, gathers))
    out.append(
        ("sharded sampling", sharded, 0.0, {**fsdp_term, "sampling gathers": gathers * per_device})
    )
    if d.fits(copy + reward):
        moved = offload_reload_s(shard, d.host_gb_s)
        out.append(
            (
                "offload",
                trained,
                moved + gather,
                {**fsdp_term, "offload": moved, "copy gather": gather},
            )
        )
    return out


class SplitCosts(NamedTuple):
    """What a split layout costs (:func:`split_costs`)."""

    strategy: str
    """How the trainers hold the model: ``replicated`` or ``fsdp trainers`` (empty without
    GPU terms)."""
    costs: Costs
    """Per micro-batch, on one generator (of its devices) and one trainer slot."""
    slots: int
    """Trainer slots: the trainers, or 1 for sharded ones (they move as one)."""
    terms: dict[str, float]
    """Seconds a step of each GPU term."""
    shard_deal: str = ""
    """Sharded trainers: what an update deals over them (the work's, or ``sequence`` where
    only a split of the tokens makes its pass fit)."""
    trainer_sampling: str = ""
    """Sharded trainers: how a TAG micro-batch is sampled, the faster of ``rows`` dealt and
    ``sequence`` (the tokens split)."""


def split_costs(
    work: Workload,
    hw: Hardware | None,
    generators: int,
    trainers: int,
    *,
    tsp: bool,
    sequence: int = 1,
    cfg: bool = False,
    trainer_sampling: str | None = None,
) -> SplitCosts:
    """The split's costs with generators of ``sequence`` devices sharing each sample's
    tokens (times 2 with ``cfg``, each device one branch of guidance); sharded trainers
    sample as ``trainer_sampling`` says (None: the faster way). Raises :class:`DoesNotFit`
    when a pool cannot hold its part."""
    base = dataclasses.replace(work.costs, update=work.update(tsp))
    if hw is None or work.model is None:
        return SplitCosts("", base, trainers, {})
    m, g, t = work.model, hw.generator, hw.trainer
    gs, ts = hw.speed(g), hw.speed(t)
    n = work.samples_per_microbatch
    # a generator device: a full copy, the reward model and one sampling pass of its rows
    branches = 2 if work.guided and not cfg else 1
    act = sampling_activation_bytes(m, n * branches, sequence)
    need = sampling_copy_bytes(m) + reward_bytes(m) + act
    if not g.fits(need):
        each = f" sharing tokens over {sequence}" if sequence > 1 else ""
        what = "the model and a sampling pass" if act else "the model"
        raise DoesNotFit(f"a {g.kind} generator{each} cannot hold {what} ({_gb(need)}; {_room(g)})")
    # what is trained reaches the generators in bf16
    sync = weight_sync_s(
        m.trained * FROZEN_BYTES,
        hw.cross_link_gb_s,
        bucket_mb=hw.bucket_mb,
        latency_s=hw.sync_latency_s,
    )
    split_gen = work.passes * ulysses_s(m, n * branches, sequence, g.link_gb_s)
    group = sequence * (2 if cfg else 1)
    costs = {
        "gen": base.gen / gs / group + split_gen,
        "score": base.score / gs,
        "gen_tag": base.gen_tag / ts,
        "update": base.update / ts,
        "step": base.step / ts,
        "sync": sync,
    }
    terms = {"weight sync": sync}
    if split_gen:
        terms["sequence all-to-all"] = split_gen * work.microbatches / (generators / group)
    try:
        ckpt = _training_fit(work, t, train_state_bytes(m), tsp=tsp, who="")
    except DoesNotFit:
        pass
    else:
        grads = allreduce_s(m.trained * GRAD_BYTES, trainers, t.link_gb_s)
        costs["step"] += grads
        terms["gradient all-reduce"] = grads
        terms.update(_recompute(costs["update"], work.microbatches / trainers, ckpt))
        costs["update"] *= RECOMPUTE if ckpt else 1.0
        return SplitCosts("replicated", Costs(**costs), trainers, terms)
    shard = train_state_bytes(m, trainers)
    who = f"{trainers} {t.kind} trainer(s)"
    deal = work.shard_deal
    try:
        ckpt = _training_fit(
            work,
            t,
            shard,
            tsp=tsp,
            who=who,
            what="cannot hold the training state even sharded",
            degree=trainers if deal == "sequence" else 1,
        )
    except DoesNotFit:
        if deal == "sequence" or not t.fits(shard) or trainers < 2:
            raise
        # a pass of whole rows does not fit: every member takes every term, its tokens split
        deal, work = "sequence", dataclasses.replace(work, shard_deal="sequence")
        ckpt = _training_fit(work, t, shard, tsp=tsp, who=who, degree=trainers)
    # one lockstep slot: a micro-batch's terms (or samples) are dealt over the trainers,
    # each pass of each member gathering the whole model (Workload.trained_share)
    share, passes = work.trained_share(trainers, tsp=tsp)
    fsdp = passes * fsdp_update_s(m, trainers, t.link_gb_s)
    if deal == "sequence":  # and each pass trades its tokens' attention, both ways
        rows = work.pass_rows(tsp=tsp)
        fsdp += passes * ulysses_s(m, rows, trainers, t.link_gb_s, backward=True)
    terms.update(_recompute(costs["update"] * share, work.microbatches, ckpt))
    costs["update"] *= RECOMPUTE if ckpt else 1.0
    costs["update"] = costs["update"] * share + fsdp
    terms["fsdp update"] = fsdp * work.microbatches
    # TAG on the slot samples with the sharded weights: rows dealt (a micro-batch smaller
    # than the group leaves some members idle) or every row with the tokens split
    gathers = sharded_sampling_s(m, trainers, t.link_gb_s, work.passes)
    tag_rows = n * (2 if work.guided else 1)
    by_rows = costs["gen_tag"] * -(-n // trainers) / n
    by_tokens = costs["gen_tag"] / trainers + work.passes * ulysses_s(
        m, tag_rows, trainers, t.link_gb_s
    )
    known = m.tokens > 0  # what the all-to-alls cost needs the tokens
    sampling = "sequence" if deal == "sequence" or (known and by_tokens < by_rows) else "rows"
    if trainer_sampling is not None and deal != "sequence":
        sampling = trainer_sampling
    tag = by_tokens if sampling == "sequence" else by_rows
    costs["gen_tag"] = overlapped(tag, gathers)
    return SplitCosts("fsdp trainers", Costs(**costs), 1, terms, deal, sampling)


def _recompute(update_s: float, updates: float, checkpointing: bool) -> dict[str, float]:
    """The ``recompute`` term of a step (what checkpointing adds to its updates), if any."""
    return {"recompute": (RECOMPUTE - 1) * update_s * updates} if checkpointing else {}


def grouped_update(
    work: Workload, hw: Hardware, trainers: int, *, tsp: bool, checkpointing: bool = False
) -> Callable[[int], float]:
    """Seconds an update of ``count`` micro-batches taken together costs ``trainers`` FSDP
    trainers (``runtime.schedule.group_updates``): each member's share of their terms, dealt
    together, and the gathers of its passes (fuller passes, so fewer of them than one update
    a micro-batch). One micro-batch costs what :func:`split_costs` charges."""
    assert work.model is not None
    t = hw.trainer
    per_microbatch = work.update(tsp) / hw.speed(t) * (RECOMPUTE if checkpointing else 1.0)
    fsdp = fsdp_update_s(work.model, trainers, t.link_gb_s)
    if work.shard_deal == "sequence":  # each pass trades its tokens' attention, both ways
        rows = work.pass_rows(tsp=tsp)
        fsdp += ulysses_s(work.model, rows, trainers, t.link_gb_s, backward=True)
    n = work.samples_per_microbatch

    def update_of(count: int) -> float:
        together = dataclasses.replace(
            work, samples_per_microbatch=n * count, pass_samples=work.pass_samples or n
        )
        share, passes = together.trained_share(trainers, tsp=tsp)
        return per_microbatch * count * share + passes * fsdp

    return update_of


def with_grouped_updates(costs: Costs, update_of: Callable[[int], float], group: int) -> Costs:
    """``costs`` with the ``update_fixed`` that makes :meth:`Costs.update_for` agree with
    ``update_of`` for one micro-batch and for a whole group of ``group``: the line through
    the two (the schedule models, and the TAG search, price an update of ``c`` micro-batches
    on it)."""
    one = update_of(1)
    each = (update_of(group) - one) / (group - 1) if group > 1 else one
    fixed = min(max(one - each, 0.0), one)
    return dataclasses.replace(costs, update=one, update_fixed=fixed)


# -- ranking ------------------------------------------------------------------------------------


def best_colocated(
    work: Workload,
    hw: Hardware | None,
    devices: int,
    *,
    tsp: bool,
    device: Device | None = None,
    engine: bool = False,
    steps: int = 4,
    price_h: float = 0.0,
) -> Candidate:
    """The fastest way to hold the model colocated on ``devices`` (:func:`colocated_costs`),
    simulated (:func:`simulate_colocated`)."""
    best = None
    for strategy, costs, switch, terms in colocated_costs(
        work, hw, devices, tsp=tsp, device=device, engine=engine
    ):
        res = simulate_colocated(costs, work.microbatches, devices, steps=steps, switch_s=switch)
        step = _mean_step(res)
        if best is None or step < best.step_time:
            best = Candidate(
                layout=COLOCATED,
                generators=0,
                trainers=devices,
                tsp=tsp,
                step_time=step,
                samples_per_step=work.samples,
                price_h=price_h,
                strategy=strategy,
                terms=terms,
                tsp_degree=work.tsp_degree,
                checkpointing="recompute" in terms,
            )
    assert best is not None
    return best


def _policies(static_k: int, node_limit: int) -> list[tuple[str, TagPolicy]]:
    return [
        ("none", NoTAG()),
        (f"static-{static_k}", StaticTAG(static_k)),
        ("bts", BTS(node_limit=node_limit)),
    ]


def _mean_step(res: SimResult) -> float:
    """The steady step: the mean after the first, which also fills the pipeline (a run's
    steps are many); the one step where only one was simulated."""
    ends = res.step_ends
    if len(ends) < 2:
        return res.makespan / max(len(ends), 1)
    return (ends[-1] - ends[0]) / (len(ends) - 1)


def _price(hw: Hardware | None, prices: tuple[float, float], g: int, t: int, colocated: bool):
    gp, tp = prices if hw is None else (hw.generator.price_h, hw.trainer.price_h)
    return (g + t) * tp if colocated else g * gp + t * tp


def plan(
    work: Workload,
    devices: int | None = None,
    hardware: Hardware | None = None,
    *,
    steps: int = 4,
    static_k: int | None = None,
    max_staleness: int = 1,
    staleness_ratio: float = 0.25,
    node_limit: int = 32,
    score_overlap: bool = True,
    prices: tuple[float, float] = (0.0, 0.0),
    splits: bool = True,
    tcss: bool = True,
    on_split: Callable[[int, int, list[Candidate]], None] | None = None,
) -> tuple[list[Candidate], list[str]]:
    """Every candidate layout, fastest step first, and why any layout was left out.

    ``devices``: how many devices of one kind to lay out (with ``hardware`` of two kinds,
    its pool counts are used instead). ``prices``: per device-hour of a generator and of a
    trainer when there is no ``hardware`` (a colocated device is billed as a trainer).
    ``splits=False`` ranks the colocated candidates only; ``tcss=False`` leaves out the
    splits with TCSS (which train on samples one version old). Ties rank the simpler choice first:
    colocated, on-policy, then none < static < BTS, then more generators.
    """
    pools = hardware is not None and hardware.generators is not None
    if pools:
        assert hardware is not None and hardware.generators and hardware.trainers
        split_list = [(hardware.generators, hardware.trainers)]
        total = hardware.generators + hardware.trainers
    else:
        if not isinstance(devices, int) or devices < 2:
            raise DigenError(
                f"devices must be an integer >= 2 (one generator, one trainer), got {devices!r}"
            )
        total = devices
        split_list = [(g, devices - g) for g in range(1, devices)]
    skipped: list[str] = []
    cands: list[Candidate] = []
    tsps = [False] + ([True] if work.update_tsp is not None else [])

    # colocated: over every device when the pools are one kind; with two kinds, over the
    # trainers' kind alone, and over both, every device as slow and small as the weaker
    layouts: list[tuple[int, Device | None, float]] = []
    if hardware is None or hardware.homogeneous:
        layouts.append((total, None, _price(hardware, prices, 0, total, True)))
    else:
        assert hardware.trainers is not None and hardware.generators is not None
        layouts.append((hardware.trainers, None, hardware.trainers * hardware.trainer.price_h))
        mixed = weakest(hardware.generator, hardware.trainer)
        g, t = hardware.generators, hardware.trainers
        layouts.append((total, mixed, _price(hardware, prices, g, t, False)))
    for devs, device, price in layouts:
        for tsp in tsps:
            # with TSP, the fastest degree whose pass fits (its activations grow with it)
            fits, why = [], ""
            for w in work.at_degrees(tsp):
                try:
                    fits.append(
                        best_colocated(
                            w, hardware, devs, tsp=tsp, device=device, steps=steps, price_h=price
                        )
                    )
                except DoesNotFit as exc:
                    why = why or str(exc)
            if not fits:
                skipped.append(f"colocated on {devs} devices: {why}")
                continue
            cands.append(min(fits, key=lambda c: (c.step_time, c.tsp_degree)))

    for g, t in split_list if splits else []:
        done: list[Candidate] = []
        for sequence, cfg in _generator_groups(work, hardware, g):
            group = sequence * (2 if cfg else 1)
            # with TSP where it was timed, else (its passes' activations too large) without
            # with TSP where it was timed, at the degree whose update is cheapest among
            # those whose passes fit; else (no TSP pass fits) without
            fitted, why = None, []
            for tsp in [True, False] if work.update_tsp is not None else [False]:
                fits, failed = [], ""
                for w in work.at_degrees(tsp):
                    try:
                        split = split_costs(w, hardware, g, t, tsp=tsp, sequence=sequence, cfg=cfg)
                    except DoesNotFit as exc:
                        failed = failed or f"{g}G+{t}T{' + TSP' if tsp else ''}: {exc}"
                        continue
                    fits.append((split.costs.update, w.tsp_degree, w, split))
                if not fits:
                    why.append(failed)
                else:
                    _, _, chosen, split = min(fits, key=lambda f: (f[0], f[1]))
                    fitted = tsp, split, chosen
                    break
            if fitted is None:  # what stops it without TSP says it all
                if group == 1:
                    skipped.append(why[-1])
                continue
            if group == 1:
                skipped += why  # TSP's passes did not fit: it runs without
            tsp, split, at = fitted
            k = split.slots if static_k is None else static_k
            stale = [(True, max_staleness, staleness_ratio)] if tcss else []
            # sharded trainers may take a group's micro-batches as one update
            grouping = [(False, split.costs)]
            if split.strategy == "fsdp trainers" and work.mbs_per_group > 1:
                assert hardware is not None
                dealt = dataclasses.replace(at, shard_deal=split.shard_deal)
                update_of = grouped_update(
                    dealt, hardware, t, tsp=tsp, checkpointing="recompute" in split.terms
                )
                grouped_costs = with_grouped_updates(split.costs, update_of, work.mbs_per_group)
                grouping.append((True, grouped_costs))
            for grouped, priced in grouping:
                for with_tcss, w, r in [(False, 0, 0.0), *stale]:
                    for name, policy in _policies(k, node_limit):
                        res = simulate(
                            priced,
                            work.microbatches,
                            g // group,
                            split.slots,
                            policy,
                            steps=steps,
                            mbs_per_group=work.mbs_per_group,
                            max_staleness=w,
                            staleness_ratio=r,
                            score_overlap=score_overlap,
                            group_updates=grouped,
                        )
                        done.append(
                            Candidate(
                                layout=SPLIT,
                                generators=g,
                                trainers=t,
                                policy=name,
                                tcss=with_tcss,
                                tsp=tsp,
                                step_time=_mean_step(res),
                                price_h=_price(hardware, prices, g, t, False),
                                strategy=split.strategy,
                                terms=split.terms,
                                grouped=grouped,
                                checkpointing="recompute" in split.terms,
                                generator_sequence=sequence,
                                generator_cfg=cfg,
                                shard_deal=split.shard_deal,
                                trainer_sampling=split.trainer_sampling,
                                samples_per_step=work.samples,
                                tsp_degree=at.tsp_degree,
                            )
                        )
        if on_split is not None:
            on_split(g, t, done)
        cands += done
    cands.sort(key=_rank_key)
    return cands, skipped


def _generator_groups(work: Workload, hw: Hardware | None, g: int) -> list[tuple[int, bool]]:
    """The ways ``g`` generator devices may form generators: ``(sequence degree, CFG)``,
    one device each first; several a generator only with the GPU terms and the tokens
    known (what their all-to-alls cost), in groups that divide ``g``."""
    ways = [(1, False)]
    if hw is None or work.model is None or work.model.tokens <= 0:
        return ways
    for cfg in (False, True) if work.guided else (False,):
        for sequence in SEQUENCE_DEGREES:
            group = sequence * (2 if cfg else 1)
            if group > 1 and g % group == 0:
                ways.append((sequence, cfg))
    return ways


def _rank_key(c: Candidate) -> tuple:
    return (
        round(c.step_time, 9),
        c.layout != COLOCATED,
        c.tcss,
        c.grouped,
        c.generator_group,
        _POLICY_RANK.get(c.policy.split("-")[0], -1),
        -c.generators,
    )


def by_cost(cands: list[Candidate]) -> list[Candidate]:
    """The candidates cheapest per 1,000 samples first (unpriced ones last, by time)."""
    return sorted(
        cands,
        key=lambda c: (c.cost_per_1k is None, c.cost_per_1k or 0.0, *_rank_key(c)),
    )


def explain(ranked: list[Candidate]) -> str:
    """One line: the first choice, its predicted step, and the best of the other layout."""
    if not ranked:
        return "no layout fits"
    best = ranked[0]
    other = next((c for c in ranked[1:] if c.layout != best.layout), None)
    line = f"{best.label}: predicted {best.step_time:.3f} s/step"
    if other is not None:
        line += f" vs {other.step_time:.3f} s for {other.label}"
    return line


def format_plan(ranked: list[Candidate], skipped: list[str], *, top: int | None = None) -> str:
    """The ranking as a markdown table (time and cost), with what was left out below it."""
    priced = any(c.cost_per_1k is not None for c in ranked)
    head = "| rank | layout | how the model sits | step time (s) | vs best |"
    rule = "| ---: | --- | --- | ---: | ---: |"
    if priced:
        head += " price / h | per 1k samples |"
        rule += " ---: | ---: |"
    lines = [head, rule]
    best = ranked[0].step_time if ranked else 0.0
    for i, c in enumerate(ranked[:top] if top else ranked, 1):
        line = (
            f"| {i} | {c.label} | {c.how} | {c.step_time:.3f} "
            f"| {c.step_time / best if best else 1.0:.2f}x |"
        )
        if priced:
            cost = c.cost_per_1k
            line += f" {c.price_h:.2f} | {'-' if cost is None else f'{cost:.4f}'} |"
        lines.append(line)
    lines += [f"- left out: {why}" for why in skipped]
    return "\n".join(lines)
