"""The logic behind ``digen simulate``: compare TAG / TCSS policies, price generators that come and go.

Plain functions over the simulator, so the command stays a thin click wrapper and everything
here is unit-tested without a process:

- :func:`load_costs` reads costs given as numbers or from a run's ``profile.json``;
- :func:`compare_policies` simulates NoTAG, StaticTAG(k) and BTS, each with and without TCSS;
- ranking layouts (colocated and every split) is :mod:`digen.planning.layouts`'s;
- :func:`with_losses` prices generators that come and go (preemptible, spot) against
  generators that stay;
- :func:`format_table` and :func:`plot_simulation` present the results.

Costs are per micro-batch and are taken as independent of the split (a profile measured on
one split predicts another only as far as that holds).
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from digen.errors import DigenError
from digen.sched.costs import Costs, OnlineProfiler
from digen.sched.names import TaskKind
from digen.sched.simulator import SimResult, ideal_bound, simulate
from digen.sched.tag import BTS, NoTAG, StaticTAG, TagPolicy
from digen.sched.trace import TraceEvent

__all__ = [
    "compare_policies",
    "format_losses",
    "format_table",
    "held_work_s",
    "load_costs",
    "plot_simulation",
    "with_losses",
]


def load_costs(source: Costs | Mapping[str, Any] | str | os.PathLike[str]) -> Costs:
    """Costs from a :class:`Costs`, a dict of seconds, or a JSON file.

    The file may be a profile written by :meth:`OnlineProfiler.save` (its estimates are
    resolved with :meth:`OnlineProfiler.costs`) or a plain ``{"gen": ..., "update": ...}``.
    """
    if isinstance(source, Costs):
        return source
    if isinstance(source, Mapping):
        return Costs.from_dict(source)
    path = Path(source)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DigenError(f"profile file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise DigenError(f"profile file {str(path)!r} is not JSON ({exc})") from None
    if isinstance(data, dict) and "estimates" in data:
        return OnlineProfiler.from_dict(data).costs()
    if isinstance(data, dict) and isinstance(data.get("costs"), dict):
        return Costs.from_dict(data["costs"])
    if isinstance(data, dict):
        return Costs.from_dict(data)
    raise DigenError(f"profile file {str(path)!r} holds no costs")


def _policies(static_k: int, node_limit: int) -> list[tuple[str, TagPolicy]]:
    return [
        ("none", NoTAG()),
        (f"static-{static_k}", StaticTAG(static_k)),
        ("bts", BTS(node_limit=node_limit)),
    ]


def _entry(res: SimResult, policy: TagPolicy, bound: float) -> dict[str, Any]:
    steps = len(res.step_ends)
    out: dict[str, Any] = {
        "makespan": res.makespan,
        "step_time": res.makespan / steps,
        "vs_bound": res.makespan / (steps * bound) if bound > 0 else 1.0,
        "tag_count": res.tag_count,
        "stale": sum(res.stale.values()),
    }
    if isinstance(policy, BTS):
        ms = policy.stats.ms
        out["search_ms"] = statistics.fmean(ms) if ms else 0.0
        out["search_ms_max"] = max(ms, default=0.0)
        out["decisions"] = policy.stats.decisions
        out["exact_fraction"] = (
            1.0 - policy.stats.inexact / policy.stats.decisions if policy.stats.decisions else 1.0
        )
    return out


def compare_policies(
    costs: Costs,
    microbatches: int,
    generators: int,
    trainers: int,
    *,
    steps: int = 4,
    static_k: int | None = None,
    mbs_per_group: int = 1,
    max_staleness: int = 1,
    staleness_ratio: float = 0.25,
    node_limit: int = 32,
    score_overlap: bool = True,
) -> dict[str, dict[str, Any]]:
    """Simulate every policy, without and with TCSS; one dict entry per policy.

    Keys are ``none``, ``static-k`` (``k`` defaults to the trainer count: one TAG per trainer
    before updates start) and ``bts``, plus the same names with ``+tcss`` (using
    ``max_staleness`` and ``staleness_ratio``). Each entry holds ``makespan``, ``step_time``
    (makespan / steps), ``vs_bound`` (step time over :func:`ideal_bound`), ``tag_count`` and
    ``stale``; BTS entries add ``search_ms`` (mean per decision), ``search_ms_max``,
    ``decisions`` and ``exact_fraction``. ``score_overlap``: scoring on a lane beside each
    generator (the runtime's default) or on the generator itself.
    """
    k = trainers if static_k is None else static_k
    bound = ideal_bound(costs, microbatches, generators, trainers, score_overlap=score_overlap)
    out: dict[str, dict[str, Any]] = {}
    for suffix, w, r in (("", 0, 0.0), ("+tcss", max_staleness, staleness_ratio)):
        for name, policy in _policies(k, node_limit):
            res = simulate(
                costs,
                microbatches,
                generators,
                trainers,
                policy,
                steps=steps,
                mbs_per_group=mbs_per_group,
                max_staleness=w,
                staleness_ratio=r,
                score_overlap=score_overlap,
            )
            out[name + suffix] = _entry(res, policy, bound)
    return out


def held_work_s(res: SimResult, gen_cost: float) -> float:
    """Seconds of generation a generator holds at a random moment, on average: what a loss
    then throws away and the others make again. A micro-batch counts from its generation's
    start (the part made so far) until a trainer starts its update (it fetches the rollout
    then); everything is averaged over the run and the generators."""
    made: dict[tuple[int, int], TraceEvent] = {}
    fetched: dict[tuple[int, int], float] = {}
    for e in res.events:
        if e.kind == TaskKind.GENERATE:
            made[e.step, e.mb] = e
        elif e.kind == TaskKind.UPDATE:
            fetched.setdefault((e.step, e.mb), e.t0)
    gens = {e.worker for e in made.values()}
    if not gens or res.makespan <= 0:
        return 0.0
    area = 0.0  # integral over time of the work held, summed over generators
    for key, e in made.items():
        span = e.t1 - e.t0
        area += span * span / 2  # in flight: the part made so far, growing to gen_cost
        area += (fetched.get(key, e.t1) - e.t1) * gen_cost  # made: all of it at stake
    return area / (res.makespan * len(gens))


def with_losses(
    costs: Costs,
    microbatches: int,
    generators: int,
    trainers: int,
    *,
    loss_rate_per_h: float,
    rejoin_s: float,
    generator_price: float = 0.0,
    trainer_price: float = 0.0,
    preemptible_price: float | None = None,
    steps: int = 4,
    mbs_per_group: int = 1,
    node_limit: int = 32,
    score_overlap: bool = True,
) -> dict[str, Any]:
    """The expected step time and cost of generators that are lost ``loss_rate_per_h``
    times an hour each (preemptions) and back ``rejoin_s`` seconds later on average.

    Each generator is up a fraction ``a = 1 / (1 + rate * rejoin_s)`` of the time, lost
    and back independently of the others, so ``k`` of them are up with the binomial
    probability ``C(G, k) a^k (1 - a)^(G - k)``; the run with ``k`` up takes the simulated
    BTS step time ``T(k)``. A loss throws away the work its generator holds
    (:func:`held_work_s`), which the others make again: ``losses per step x held / k``
    more seconds. With no generator up the run stops (``runtime.elastic.min_generators = 1``): that
    probability is reported, and the step time is the expectation given at least one is
    up. Cost per step: up generators and every trainer at their price per device-hour
    (a preempted machine is not billed); the generators that come and go at
    ``preemptible_price`` when given (else ``generator_price``), the steady ones at
    ``generator_price``.
    """
    if loss_rate_per_h < 0 or rejoin_s < 0:
        raise DigenError("the loss rate and the rejoin time must not be negative")
    if generators < 1 or trainers < 1:
        raise DigenError("at least one generator and one trainer")
    rate = loss_rate_per_h / 3600.0
    up = 1.0 / (1.0 + rate * rejoin_s)
    pool: list[dict[str, Any]] = []
    for k in range(1, generators + 1):
        res = simulate(
            costs,
            microbatches,
            k,
            trainers,
            BTS(node_limit=node_limit),
            steps=steps,
            mbs_per_group=mbs_per_group,
            score_overlap=score_overlap,
        )
        held = held_work_s(res, costs.gen)
        step = res.makespan / steps
        losses = rate * k * step  # per step, with k up
        p = math.comb(generators, k) * up**k * (1.0 - up) ** (generators - k)
        pool.append(
            {
                "generators_up": k,
                "probability": p,
                "step_time": step,
                "held_s": held,
                "losses_per_step": losses,
                "step_time_with_remakes": step + losses * held / k,
            }
        )
    stopped = (1.0 - up) ** generators
    live = 1.0 - stopped
    expected = sum(r["probability"] * r["step_time_with_remakes"] for r in pool) / live
    up_mean = sum(r["probability"] * r["generators_up"] for r in pool) / live
    steady = pool[-1]["step_time"]  # every generator always up: no losses
    spot = generator_price if preemptible_price is None else preemptible_price
    price_h = up_mean * spot + trainers * trainer_price
    steady_price_h = generators * generator_price + trainers * trainer_price
    return {
        "availability": up,
        "no_generator_probability": stopped,
        "step_time": expected,
        "steady_step_time": steady,
        "slowdown": expected / steady if steady > 0 else 1.0,
        "generators_up_mean": up_mean,
        "cost_per_step": price_h * expected / 3600.0,
        "steady_cost_per_step": steady_price_h * steady / 3600.0,
        "pools": pool,
    }


def format_losses(
    got: Mapping[str, Any], generators: int, trainers: int, rate: float, rejoin_s: float
) -> str:
    """What :func:`with_losses` found, as a few lines and a table per pool size."""
    lines = [
        f"{generators} generators lost {rate:g} times an hour each, back after {rejoin_s:g} s "
        f"(up {got['availability']:.1%} of the time), {trainers} trainer(s), BTS:",
        f"- step time {got['step_time']:.3f} s against {got['steady_step_time']:.3f} s with "
        f"generators that stay ({got['slowdown']:.3f}x), "
        f"{got['generators_up_mean']:.2f} generators up on average;",
        f"- cost per step {got['cost_per_step']:.6f} against {got['steady_cost_per_step']:.6f};",
        f"- no generator up (the run stops) {got['no_generator_probability']:.2e} of the time.",
        "",
        "| generators up | probability | step time (s) | held at a loss (s) | with remakes (s) |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in got["pools"]:
        lines.append(
            f"| {r['generators_up']} | {r['probability']:.4f} | {r['step_time']:.3f} "
            f"| {r['held_s']:.3f} | {r['step_time_with_remakes']:.3f} |"
        )
    return "\n".join(lines)


def format_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """A markdown table of :func:`compare_policies` output."""
    lines = [
        "| policy | step time (s) | makespan (s) | vs bound | TAG | stale | search ms (mean / max) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, r in results.items():
        search = f"{r['search_ms']:.2f} / {r['search_ms_max']:.2f}" if "search_ms" in r else ""
        lines.append(
            f"| {name} | {r['step_time']:.3f} | {r['makespan']:.3f} | {r['vs_bound']:.3f} "
            f"| {r['tag_count']} | {r['stale']} | {search} |"
        )
    return "\n".join(lines)


def plot_simulation(
    result: SimResult, path: str | os.PathLike[str], *, title: str | None = None
) -> Path:
    """Draw a simulated run with the same timeline plot a real run uses."""
    return result.trace.plot_timeline(path, title=title)
