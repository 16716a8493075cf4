"""``digen bench --quality``: time to a quality, per mode and per algorithm, on this machine.

Speed per step (``digen bench``) is not what a user pays for: a faster mode whose updates
are staler, or an algorithm that needs more steps, may reach a given quality later. So every
*arm* below trains the shapes task (the ``shapes`` reward on the ``shapes`` prompts) from the
same weights with the same seed and budget, evaluates its held-out accuracy as it goes
(``eval.every``: GenEval's strict rule per category, averaged over the categories; the mean
evaluation reward where the prompts have no accuracy) and is repeated over several seeds:

- ``colocated`` (and ``colocated-<algo>`` for the other algorithms): one process with every
  core's thread, the fastest colocated configuration ``digen bench`` measures on two cores;
- ``disaggregated``: full digen without staleness (GAP, TSP 2, TAG by BTS), on-policy;
- ``tcss``: the same with bounded staleness (one version, half a step's micro-batches).

Per arm and seed the curve is accuracy against policy version (train steps) and against
training time, the sum of the steps' ``step_time_s`` up to that version (an evaluation's own
time is left out of both). From the curves (:func:`summarise_quality`, pure): the time and
step at which each run first reaches ``target``, the area under the accuracy-per-step curve
(its mean over the run), medians and spreads over the seeds, and whether the TCSS curve
stays within the on-policy seeds' spread at every evaluation (the DigenRL paper's claim that
bounded staleness "maintains a reward curve comparable to on-policy training").
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from digen.errors import stop_if_interrupted
from digen.run.paired import mcnemar_p

__all__ = [
    "Arm",
    "Curve",
    "QualitySettings",
    "arm_config",
    "arms",
    "auc",
    "format_quality",
    "plot_quality",
    "run_quality",
    "summarise_quality",
    "time_to_target",
]


@dataclass(frozen=True, slots=True)
class QualitySettings:
    """What every arm shares."""

    model: str = "flux"
    flavour: str = "shapes"
    """The weights every arm starts from (``model.flavour``)."""
    algos: tuple[str, ...] = ("flowgrpo", "dancegrpo", "mixgrpo")
    """Colocated arms, one per algorithm; the mode arms use the first."""
    steps: int = 30
    seeds: tuple[int, ...] = (0, 1, 2)
    eval_every: int = 5
    target: float = 0.5
    """The quality to reach: held-out accuracy (or evaluation reward)."""
    workers: int = 2
    """Disaggregated arms: generators + trainers."""
    cores: int = 2
    overrides: tuple[str, ...] = ()
    """The user's own config overrides, applied to every arm before the arm's own."""


@dataclass(frozen=True, slots=True)
class Arm:
    """One configuration raced."""

    key: str
    name: str
    mode: str
    algo: str
    overrides: tuple[str, ...] = ()
    threads: int | None = None
    """Colocated: torch threads of this process while the arm runs."""


def arms(s: QualitySettings) -> list[Arm]:
    """The arms (module docstring): the mode arms first, then the other algorithms."""
    first, rest = s.algos[0], s.algos[1:]
    generators, trainers = s.workers - s.workers // 2, s.workers // 2
    split = (
        f"runtime.generators={generators}",
        f"runtime.trainers={trainers}",
        f"runtime.placement.threads_per_worker={max(1, s.cores // s.workers)}",
        "runtime.schedule.tsp_degree=2",
        "runtime.schedule.tag=bts",
    )
    out = [
        Arm("colocated", f"colocated {first}", "colocated", first, threads=s.cores),
        Arm("disaggregated", f"disaggregated {first} (on-policy)", "disaggregated", first, split),
        Arm(
            "tcss",
            f"disaggregated {first} + TCSS",
            "disaggregated",
            first,
            (*split, "runtime.schedule.max_staleness=1", "runtime.schedule.staleness_ratio=0.5"),
        ),
    ]
    out += [Arm(f"colocated-{a}", f"colocated {a}", "colocated", a, threads=s.cores) for a in rest]
    return out


def arm_config(s: QualitySettings, arm: Arm, seed: int) -> Any:
    """The resolved config of ``arm`` with ``seed`` (a bad setting fails here, in one
    sentence, before anything runs)."""
    from digen.config import load_config
    from digen.presets import preset

    shared = [
        f"model.flavour={s.flavour}",
        "data.prompts=shapes",
        "rewards=[shapes]",
        f"steps={s.steps}",
        f"seed={seed}",
        f"eval.every={s.eval_every}",
        "save_every=0",
        *s.overrides,
    ]
    return load_config(
        base=preset(s.model, arm.algo, mode=arm.mode, flavour=s.flavour),
        overrides=[*shared, *arm.overrides],
    )


# --- measuring ------------------------------------------------------------------------------


@dataclass(slots=True)
class Curve:
    """One run's quality curve."""

    arm: str
    seed: int
    versions: list[int]
    """Policy versions evaluated (train steps done), ascending, from the first."""
    seconds: list[float]
    """Training time at each version: the steps' ``step_time_s`` summed."""
    quality: list[float]
    """Held-out accuracy (or evaluation reward) at each version."""
    categories: dict[str, list[float]] = field(default_factory=dict)
    """Per category, its accuracy at each version (shapes prompts)."""
    verdicts: list[dict[str, str]] = field(default_factory=list)
    """At each version, each image's verdict per category (``0`` / ``1`` strings,
    :mod:`digen.run.paired`): the same images at every version and in every arm of a seed
    (fixed evaluation noise), so rises and arms compare image by image. Empty where the
    prompts have no judge."""
    wall_s: float = 0.0
    """The whole run, start-up and evaluations included."""


def curve_of(
    arm: str,
    seed: int,
    metrics: Sequence[dict],
    evals: Sequence[dict],
    verdicts: Sequence[dict[str, str]] = (),
) -> Curve:
    """The curve of a finished run from its ``metrics.jsonl`` and ``eval.jsonl`` rows (and
    the evaluations' per-image verdicts)."""
    key = "eval/accuracy" if evals and "eval/accuracy" in evals[0] else "eval/reward_mean"
    first = metrics[0]["step"] if metrics else 0
    elapsed = [0.0]
    for row in metrics:
        elapsed.append(elapsed[-1] + row["step_time_s"])
    prefix = "eval/accuracy/"
    cats = [k[len(prefix) :] for k in (evals[0] if evals else {}) if k.startswith(prefix)]
    return Curve(
        arm=arm,
        seed=seed,
        versions=[r["eval/policy_version"] for r in evals],
        seconds=[elapsed[r["eval/policy_version"] - first] for r in evals],
        quality=[r[key] for r in evals],
        categories={c: [r[prefix + c] for r in evals] for c in cats},
        verdicts=[dict(v) for v in verdicts] if all(verdicts) else [],
    )


def measure_arm(arm: Arm, cfg: Any, out_dir: Path) -> Curve:
    """Run ``cfg`` into ``out_dir``; its curve."""
    import torch

    from digen.run.runner import DigenRunner

    before = torch.get_num_threads()
    if arm.threads is not None:
        torch.set_num_threads(arm.threads)
    t0 = time.perf_counter()
    try:
        runner = DigenRunner(cfg, out_dir=out_dir, progress=False, save_weights=False)
        result = asyncio.run(runner.run())
    finally:
        torch.set_num_threads(before)
    stop_if_interrupted(result)  # a signal stops the bench, not just this run
    out = curve_of(arm.key, cfg.seed, result.metrics, result.evals, result.verdicts)
    out.wall_s = time.perf_counter() - t0
    return out


def run_quality(
    s: QualitySettings, out_dir: Path, *, progress: Callable[[str], None] | None = None
) -> list[Curve]:
    """Every arm with every seed, seeds outermost (a machine that drifts slows every arm of
    a seed alike); run directories ``<out_dir>/s<seed>-<arm>``."""
    say = progress or (lambda text: None)
    configs = {(a.key, seed): arm_config(s, a, seed) for a in arms(s) for seed in s.seeds}
    curves = []
    for seed in s.seeds:
        for arm in arms(s):
            say(f"seed {seed}: {arm.name} ...")
            c = measure_arm(arm, configs[arm.key, seed], Path(out_dir) / f"s{seed}-{arm.key}")
            say(f"  quality {c.quality[0]:.3f} -> {c.quality[-1]:.3f} in {c.seconds[-1]:.0f} s")
            curves.append(c)
    return curves


# --- summarising (pure) ------------------------------------------------------------------------


def time_to_target(c: Curve, target: float) -> tuple[int, float] | None:
    """``(version, training seconds)`` of the first evaluation at or above ``target``;
    None when the run never reached it."""
    for v, t, q in zip(c.versions, c.seconds, c.quality, strict=True):
        if q >= target:
            return v, t
    return None


def auc(c: Curve) -> float:
    """The mean quality over the run: the area under quality per version (trapezoids)
    divided by the versions it spans (a single evaluation: its value)."""
    if len(c.versions) < 2:
        return c.quality[0]
    area = sum(
        (v1 - v0) * (q0 + q1) / 2
        for v0, v1, q0, q1 in zip(c.versions, c.versions[1:], c.quality, c.quality[1:])
    )
    return area / (c.versions[-1] - c.versions[0])


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _pooled(pairs: Sequence[tuple[dict[str, str], dict[str, str]]]) -> dict[str, dict]:
    """Per category and ``all``: the change from each pair's first verdicts to its second,
    the images of every pair pooled (each pair a seed: different images, each image's change
    independent of the others' under no effect), with McNemar's exact p."""
    if not pairs:
        return {}
    from digen.run.paired import paired_changes

    per_pair = [paired_changes(a, b) for a, b in pairs]
    out = {}
    for group in per_pair[0]:
        gained = sum(p[group].gained for p in per_pair)
        lost = sum(p[group].lost for p in per_pair)
        out[group] = {
            "rise": _spread([p[group].rise for p in per_pair]),
            "gained": gained,
            "lost": lost,
            "p": mcnemar_p(gained, lost),
        }
    return out


def rises(runs: Sequence[Curve]) -> dict[str, dict]:
    """Per category (and ``all``), the rise from the first evaluation to the last over
    ``runs`` (one per seed): its median and range over the seeds, and the images gained and
    lost with McNemar's exact p, pooled over the seeds."""
    return _pooled([(c.verdicts[0], c.verdicts[-1]) for c in runs if c.verdicts])


def arms_compared(a: Sequence[Curve], b: Sequence[Curve]) -> list[dict[str, dict]]:
    """At each evaluation, arm ``b`` against arm ``a`` on the same images (the seeds both
    ran, paired seed by seed): per category and ``all``, the difference ``b - a`` (median and
    range over seeds) and the images only ``b`` passed (``gained``) and only ``a`` passed
    (``lost``), pooled over the seeds, with McNemar's exact p. The test of whether one arm's
    quality differs from the other's, evaluation by evaluation."""
    by_seed = {c.seed: c for c in a if c.verdicts}
    pairs = [(by_seed[c.seed], c) for c in b if c.verdicts and c.seed in by_seed]
    if not pairs:
        return []
    n = min(len(x.verdicts) for p in pairs for x in p)
    return [_pooled([(x.verdicts[i], y.verdicts[i]) for x, y in pairs]) for i in range(n)]


def summarise_quality(s: QualitySettings, curves: Sequence[Curve], command: str = "") -> dict:
    """The report: per arm, its curves' medians and spreads, time to target and area;
    the TCSS-within-spread check; the arm reaching the target first in time."""
    by_arm: dict[str, list[Curve]] = {}
    for c in curves:
        by_arm.setdefault(c.arm, []).append(c)
    names = {a.key: a.name for a in arms(s)}
    report: dict[str, Any] = {
        "settings": asdict(s),
        "command": command,
        "arms": {},
    }
    for key, runs in by_arm.items():
        reached = [time_to_target(c, s.target) for c in runs]
        hit = [r for r in reached if r is not None]
        versions = runs[0].versions
        report["arms"][key] = {
            "name": names.get(key, key),
            "seeds": [c.seed for c in runs],
            "versions": versions,
            "quality": [_spread([c.quality[i] for c in runs]) for i in range(len(versions))],
            "seconds": [
                statistics.median(c.seconds[i] for c in runs) for i in range(len(versions))
            ],
            "first": _spread([c.quality[0] for c in runs]),
            "last": _spread([c.quality[-1] for c in runs]),
            "auc": _spread([auc(c) for c in runs]),
            "reached": f"{len(hit)}/{len(runs)}",
            "steps_to_target": _spread([v for v, _ in hit]) if hit else None,
            "seconds_to_target": _spread([t for _, t in hit]) if hit else None,
            "categories_last": {
                cat: statistics.median(c.categories[cat][-1] for c in runs)
                for cat in runs[0].categories
            },
            "rises": rises(runs),
            "wall_s": _spread([c.wall_s for c in runs]),
        }
    arms_ = report["arms"]
    if "tcss" in arms_ and "disaggregated" in arms_:
        on, stale = arms_["disaggregated"]["quality"], arms_["tcss"]["quality"]
        report["tcss_within_on_policy_spread"] = [
            o["min"] <= t["median"] <= o["max"] for o, t in zip(on, stale, strict=True)
        ]
    # paired tests between arms, each evaluation: TCSS against on-policy, and every other
    # algorithm against the first
    versus = {"tcss": "disaggregated"} | {
        k: "colocated" for k in by_arm if k.startswith("colocated-")
    }
    report["compared"] = {
        f"{k} vs {base}": arms_compared(by_arm[base], by_arm[k])
        for k, base in versus.items()
        if k in by_arm and base in by_arm
    }
    # an arm counts when most of its seeds reach the target: one lucky seed is no ranking
    timed = {
        k: a["seconds_to_target"]["median"]
        for k, a in arms_.items()
        if a["seconds_to_target"] and 2 * _hits(a["reached"]) > len(a["seeds"])
    }
    report["first_to_target"] = min(timed, key=timed.__getitem__) if timed else None
    return report


def _hits(reached: str) -> int:
    """The seeds that reached the target, from ``"k/n"``."""
    return int(reached.split("/")[0])


def format_quality(report: dict) -> str:
    """The report as a table: one line per arm."""
    s = report["settings"]
    lines = [
        f"time to held-out quality {s['target']} ({s['model']} {s['flavour']}, {s['steps']} "
        f"steps, seeds {s['seeds']}; medians, [min, max] over seeds)",
        f"{'arm':38} {'first':>6} {'last':>14} {'AUC':>6} {'reached':>7} "
        f"{'steps':>6} {'seconds':>16}",
    ]
    for a in report["arms"].values():
        sec, steps = a["seconds_to_target"], a["steps_to_target"]
        when = f"{sec['median']:.0f} [{sec['min']:.0f}, {sec['max']:.0f}]" if sec else "-"
        last = a["last"]
        lines.append(
            f"{a['name']:38} {a['first']['median']:6.3f} "
            f"{last['median']:6.3f} [{last['min']:.2f},{last['max']:.2f}] "
            f"{a['auc']['median']:6.3f} {a['reached']:>7} "
            f"{(str(steps['median']) if steps else '-'):>6} {when:>16}"
        )
    if "tcss_within_on_policy_spread" in report:
        inside = report["tcss_within_on_policy_spread"]
        lines.append(
            f"TCSS median within the on-policy seeds' range at {sum(inside)} of {len(inside)} "
            "evaluations"
        )
    if report["first_to_target"]:
        lines.append(f"first to the target in training time: {report['first_to_target']}")
    lines += _rise_table(report)
    for name, at in report.get("compared", {}).items():
        if not at:
            continue
        last = at[-1]["all"]
        lines.append(
            f"{name}, last evaluation: {last['rise']['median']:+.3f} median over seeds, "
            f"{last['gained']} images only the first passes, {last['lost']} only the second "
            f"(McNemar p = {last['p']:.3g}); p at each evaluation: "
            + ", ".join(f"{e['all']['p']:.2g}" for e in at)
        )
    return "\n".join(lines)


def _rise_table(report: dict) -> list[str]:
    """Rows: categories and ``all``; columns: arms; each cell the median rise over seeds
    and McNemar's p of the images pooled over seeds."""
    arms_ = [a for a in report["arms"].values() if a.get("rises")]
    if not arms_:
        return []
    groups = list(arms_[0]["rises"])
    out = [
        "rise from the first evaluation to the last: median over seeds, McNemar p over the "
        "seeds' images",
        f"{'category':15}" + "".join(f" {a['name'][:22]:>22}" for a in arms_),
    ]
    for g in groups:
        cells = []
        for a in arms_:
            r = a["rises"].get(g)
            cells.append(f"{r['rise']['median']:+.3f} p={r['p']:.2g}" if r else "-")
        out.append(f"{g:15}" + "".join(f" {c:>22}" for c in cells))
    return out


def plot_quality(report: dict, path: Path) -> None:
    """Quality against policy version and against training time, one line per arm (the
    seeds' median, their range shaded)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for a in report["arms"].values():
        med = [q["median"] for q in a["quality"]]
        lo, hi = [q["min"] for q in a["quality"]], [q["max"] for q in a["quality"]]
        for ax, x in ((by_step, a["versions"]), (by_time, a["seconds"])):
            (line,) = ax.plot(x, med, marker="o", ms=3, label=a["name"])
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    target = report["settings"]["target"]
    for ax in (by_step, by_time):
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.grid(alpha=0.3)
    by_step.set_xlabel("train steps (policy version)")
    by_time.set_xlabel("training time (s)")
    by_step.set_ylabel("held-out accuracy")
    by_step.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
