"""The logic behind ``digen simulate``: compare TAG / TCSS policies, recommend a pool split.

Plain functions over the simulator, so the command stays a thin click wrapper and everything
here is unit-tested without a process:

- :func:`load_costs` reads costs given as numbers or from a run's ``profile.json``;
- :func:`compare_policies` simulates NoTAG, StaticTAG(k) and BTS, each with and without TCSS;
- :func:`recommend` tries every generator/trainer split of N devices and ranks the options;
- :func:`format_table` and :func:`plot_simulation` present the results.

Costs are per micro-batch and are taken as independent of the split (a profile measured on
one split predicts another only as far as that holds).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from digen.sched.costs import Costs, OnlineProfiler
from digen.sched.simulator import SimResult, ideal_bound, simulate
from digen.sched.tag import BTS, NoTAG, StaticTAG, TagPolicy

__all__ = ["compare_policies", "format_table", "load_costs", "plot_simulation", "recommend"]

_POLICY_RANK = {"none": 0, "static": 1, "bts": 2}


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
        raise ValueError(f"profile file {str(path)!r} does not exist") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"profile file {str(path)!r} is not JSON ({exc})") from None
    if isinstance(data, dict) and "estimates" in data:
        return OnlineProfiler.from_dict(data).costs()
    if isinstance(data, dict) and isinstance(data.get("costs"), dict):
        return Costs.from_dict(data["costs"])
    if isinstance(data, dict):
        return Costs.from_dict(data)
    raise ValueError(f"profile file {str(path)!r} holds no costs")


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


def recommend(
    devices: int,
    costs: Costs,
    microbatches: int,
    *,
    steps: int = 4,
    static_k: int | None = None,
    mbs_per_group: int = 1,
    max_staleness: int = 1,
    staleness_ratio: float = 0.25,
    node_limit: int = 32,
    score_overlap: bool = True,
    on_split: Callable[[int, int, dict[str, dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Every generator/trainer split of ``devices`` x every policy, fastest step first.

    Each candidate: ``generators``, ``trainers``, ``policy`` (``none`` / ``static-k`` /
    ``bts``), ``tcss`` (bool), ``step_time`` and ``makespan``. Equal step times rank the
    simpler choice first: on-policy before TCSS, then none < static < BTS, then more
    generators. ``on_split(generators, trainers, table)`` is called as each split is done,
    with its :func:`compare_policies` table (a command shows progress with it).
    """
    if not isinstance(devices, int) or devices < 2:
        raise ValueError(
            f"devices must be an integer >= 2 (one generator, one trainer), got {devices!r}"
        )
    cands: list[dict[str, Any]] = []
    for g in range(1, devices):
        t = devices - g
        table = compare_policies(
            costs,
            microbatches,
            g,
            t,
            steps=steps,
            static_k=static_k,
            mbs_per_group=mbs_per_group,
            max_staleness=max_staleness,
            staleness_ratio=staleness_ratio,
            node_limit=node_limit,
            score_overlap=score_overlap,
        )
        if on_split is not None:
            on_split(g, t, table)
        for name, row in table.items():
            policy, _, tcss = name.partition("+")
            cands.append(
                {
                    "generators": g,
                    "trainers": t,
                    "policy": policy,
                    "tcss": bool(tcss),
                    "step_time": row["step_time"],
                    "makespan": row["makespan"],
                }
            )
    cands.sort(
        key=lambda c: (
            round(c["step_time"], 9),
            c["tcss"],
            _POLICY_RANK[c["policy"].split("-")[0]],
            -c["generators"],
        )
    )
    return cands


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
