"""Per-micro-batch task costs and their online estimates — pure, torch-free.

The simulator and the bubble-triggered search need one number per kind of task: how long a
micro-batch takes to generate on a generator, to generate on a trainer (TAG), to score, to
update, and how long the per-step optimizer step and weight sync take. :class:`Costs` holds
those numbers; :class:`OnlineProfiler` keeps running estimates of them from the run's own
:class:`~digen.sched.trace.TraceEvent` stream, so the search can re-plan with fresh numbers at
every bubble and ``digen simulate`` can replay a finished run from its ``profile.json``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from digen.errors import DigenError
from digen.sched.names import Pool, TaskKind, pool_of
from digen.sched.trace import TraceEvent

__all__ = ["COST_NAMES", "EVENT_COST", "Costs", "OnlineProfiler", "pool_of"]

COST_NAMES = ("gen", "gen_tag", "score", "update", "step", "sync")
"""The fields of :class:`Costs`, in order."""

EVENT_COST = {
    TaskKind.GENERATE: "gen",
    TaskKind.TAG: "gen_tag",
    TaskKind.SCORE: "score",
    TaskKind.UPDATE: "update",
    TaskKind.STEP: "step",
    TaskKind.SYNC: "sync",
}
"""Trace event kind -> the cost it measures."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Costs:
    """Seconds per task: per micro-batch for gen / gen_tag / score / update, per step otherwise."""

    gen: float
    """Generating one micro-batch on a generator."""
    update: float
    """One trainer's update (forward + backward, gradients accumulated) on one micro-batch."""
    gen_tag: float | None = None
    """Generating one micro-batch on a trainer (TAG); ``None`` means "as fast as ``gen``"."""
    score: float = 0.0
    """Scoring (rewards) one micro-batch on a generator."""
    step: float = 0.0
    """The optimizer step that ends a train step (every trainer at once)."""
    sync: float = 0.0
    """Weight sync after the step; occupies every trainer and every generator."""
    update_fixed: float = 0.0
    """Of ``update``, what an update pays once however many micro-batches it takes
    (``runtime.schedule.group_updates``): ``c`` of them taken together cost
    :meth:`update_for`. Sharded trainers: mostly the gathers of their passes. Not measured
    (the planner derives it); written only when set."""

    def __post_init__(self) -> None:
        if self.gen_tag is None:
            object.__setattr__(self, "gen_tag", self.gen if _is_number(self.gen) else None)
        for name in (*COST_NAMES, "update_fixed"):
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value) or value < 0:
                raise DigenError(
                    f"costs.{name} must be a finite number of seconds >= 0, got {value!r}"
                )
            object.__setattr__(self, name, float(value))
        if self.update_fixed > self.update:
            raise DigenError(
                f"costs.update_fixed = {self.update_fixed!r} cannot exceed costs.update = "
                f"{self.update!r}, the update it is part of"
            )

    def update_for(self, count: int) -> float:
        """Seconds of one update of ``count`` micro-batches taken together: the fixed part
        once, the rest for each."""
        return self.update_fixed + count * (self.update - self.update_fixed)

    def to_dict(self) -> dict[str, float]:
        """The six costs as a JSON-ready dict (and ``update_fixed`` when set)."""
        d = asdict(self)
        if not d["update_fixed"]:
            del d["update_fixed"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Costs:
        """Inverse of :meth:`to_dict`; unknown keys are an error (a typo would be silent)."""
        known = (*COST_NAMES, "update_fixed")
        extra = set(d) - set(known)
        if extra:
            raise DigenError(
                f"unknown cost key(s) {', '.join(sorted(extra))}; "
                f"expected some of {', '.join(COST_NAMES)}"
            )
        return cls(**{k: d[k] for k in known if k in d})

    def as_tuple(self) -> tuple[float, ...]:
        """``(gen, gen_tag, score, update, step, sync, update_fixed)``: a cheap, hashable
        cache key."""
        return (
            self.gen,
            self.gen_tag,  # type: ignore[return-value]
            self.score,
            self.update,
            self.step,
            self.sync,
            self.update_fixed,
        )


def _is_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(slots=True)
class _Estimate:
    """Running statistics of one (cost, pool) pair."""

    ema: float
    n: int
    recent: deque[float]


@dataclass(slots=True)
class OnlineProfiler:
    """Running estimates of every cost, per (cost, pool), fed from trace events.

    Two estimators are kept for every (cost, pool): an exponential moving average (the first
    sample sets it; later ones move it by ``alpha``) and the mean of the last ``window``
    samples. ``method`` picks which one :meth:`estimate` and :meth:`costs` report: the EMA
    follows drift (warm-up, thermal throttling), the window mean forgets outliers completely
    once they leave the window, and the window median (``"median"``) ignores them inside it
    (a benchmark comparing median step times uses it).
    """

    alpha: float = 0.3
    """EMA weight of the newest sample, in (0, 1]."""
    window: int = 8
    """How many recent samples the window mean keeps (>= 1)."""
    method: str = "ema"
    """``"ema"``, ``"window"`` (mean) or ``"median"`` (of the window): what :meth:`costs` uses."""
    tag_scale: float = 1.0
    """Until a TAG has been timed, ``gen_tag`` is ``gen`` times this (trainer vs generator speed)."""
    _est: dict[tuple[str, str], _Estimate] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not (_is_number(self.alpha) and 0.0 < self.alpha <= 1.0):
            raise DigenError(f"profiler alpha must be in (0, 1], got {self.alpha!r}")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise DigenError(f"profiler window must be an integer >= 1, got {self.window!r}")
        if self.method not in ("ema", "window", "median"):
            raise DigenError(
                f"profiler method must be 'ema', 'window' or 'median', got {self.method!r}"
            )
        if not (
            _is_number(self.tag_scale) and self.tag_scale > 0 and math.isfinite(self.tag_scale)
        ):
            raise DigenError(f"profiler tag_scale must be a number > 0, got {self.tag_scale!r}")

    # -- feeding ----------------------------------------------------------------------------

    def add(self, cost: str, pool: str, seconds: float) -> None:
        """Add one measurement of ``cost`` (a name of :data:`COST_NAMES`) taken on ``pool``."""
        if cost not in COST_NAMES:
            raise DigenError(f"unknown cost {cost!r}; expected one of {', '.join(COST_NAMES)}")
        x = float(seconds)
        if not math.isfinite(x) or x < 0:
            raise DigenError(f"a {cost} measurement must be finite and >= 0 s, got {seconds!r}")
        est = self._est.get((cost, pool))
        if est is None:
            self._est[(cost, pool)] = _Estimate(x, 1, deque([x], maxlen=self.window))
        else:
            est.ema += self.alpha * (x - est.ema)
            est.n += 1
            est.recent.append(x)

    def observe(self, event: TraceEvent) -> None:
        """Add one trace event: its duration is a sample of the cost its kind measures."""
        self.add(EVENT_COST[event.kind], pool_of(event.worker), event.duration)

    def observe_all(self, events: Iterable[TraceEvent]) -> None:
        """Add several trace events (e.g. a whole finished run's trace)."""
        for ev in events:
            self.observe(ev)

    # -- reading ----------------------------------------------------------------------------

    def seen(self, cost: str, pool: str | None = None) -> bool:
        """Whether ``cost`` has been measured at all (on ``pool``, or on any pool)."""
        if cost in EVENT_COST:  # accept event kinds too: seen("generate")
            cost = EVENT_COST[cost]
        return any(c == cost and (pool is None or p == pool) for c, p in self._est)

    def pools(self, cost: str) -> list[str]:
        """The pools that have measured ``cost``, sorted."""
        return sorted(p for c, p in self._est if c == cost)

    def count(self, cost: str, pool: str | None = None) -> int:
        """How many samples of ``cost`` (on ``pool``, or on all pools together)."""
        return sum(e.n for (c, p), e in self._est.items() if c == cost and pool in (None, p))

    def estimate(self, cost: str, pool: str | None = None) -> float | None:
        """The current estimate of ``cost`` on ``pool``; ``None`` when never measured.

        Without a pool, the mean of the pools' estimates (one number per pool, so a large pool
        does not drown a small one), except for ``step`` and ``sync``: those are collectives
        that last as long as their slowest member, so the largest pool estimate is used.
        """
        vals = [
            self._value(e) for (c, p), e in self._est.items() if c == cost and pool in (None, p)
        ]
        if not vals:
            return None
        if cost in ("step", "sync"):
            return max(vals)
        return sum(vals) / len(vals)

    def _value(self, est: _Estimate) -> float:
        if self.method == "ema":
            return est.ema
        if self.method == "median":
            return statistics.median(est.recent)
        return sum(est.recent) / len(est.recent)

    def ready(self) -> bool:
        """Whether generation and update have both been timed (enough for a search)."""
        return self.seen("gen") and self.seen("update")

    def costs(
        self,
        *,
        generator_pool: str | None = None,
        trainer_pool: str | None = None,
        defaults: Costs | None = None,
    ) -> Costs:
        """The current estimates as :class:`Costs`, with fallbacks for what is not measured yet.

        ``gen`` and ``score`` come from ``generator_pool``, ``gen_tag`` and ``update`` from
        ``trainer_pool`` (any pool when ``None``); ``score`` from the scoring lanes
        (``scorer``) when they have measured it, as they do when scoring is overlapped. A cost never measured falls back to
        ``defaults`` when given; otherwise ``gen_tag`` is ``gen * tag_scale`` (a trainer is
        assumed as fast as a generator until a TAG has been timed) and any other unmeasured
        cost is 0 s. ``gen`` or ``update`` unmeasured with no ``defaults`` is an error: a search
        fed zeros would be meaningless (see :meth:`ready`).
        """
        scorer = Pool.SCORER if self.seen("score", Pool.SCORER) else generator_pool
        pool_for = {"gen": generator_pool, "score": scorer}
        pool_for |= {"gen_tag": trainer_pool, "update": trainer_pool}
        out: dict[str, float] = {}
        for name in COST_NAMES:
            v = self.estimate(name, pool_for.get(name))
            if v is None and defaults is not None:
                v = getattr(defaults, name)
            if v is not None:
                out[name] = v
        for name in ("gen", "update"):
            if name not in out:
                raise DigenError(
                    f"no {name} time measured yet and no defaults given; "
                    "feed the profiler a generate and an update event first"
                )
        if "gen_tag" not in out:
            out["gen_tag"] = out["gen"] * self.tag_scale
        return Costs(**out)

    # -- files ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Settings, every per-pool estimate, and (when available) the resolved costs."""
        d: dict[str, Any] = {
            "alpha": self.alpha,
            "window": self.window,
            "method": self.method,
            "tag_scale": self.tag_scale,
            "estimates": [
                {"cost": c, "pool": p, "ema": e.ema, "n": e.n, "recent": list(e.recent)}
                for (c, p), e in sorted(self._est.items())
            ],
        }
        if self.ready():
            d["costs"] = self.costs().to_dict()
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> OnlineProfiler:
        """Inverse of :meth:`to_dict`."""
        prof = cls(
            alpha=d.get("alpha", 0.3),
            window=d.get("window", 8),
            method=d.get("method", "ema"),
            tag_scale=d.get("tag_scale", 1.0),
        )
        for row in d.get("estimates", ()):
            if row["cost"] not in COST_NAMES:
                raise DigenError(f"profile has an unknown cost {row['cost']!r}")
            recent = deque((float(x) for x in row["recent"]), maxlen=prof.window)
            prof._est[(row["cost"], row["pool"])] = _Estimate(
                float(row["ema"]), int(row["n"]), recent
            )
        return prof

    def to_json(self) -> str:
        """:meth:`to_dict` as indented JSON text."""
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> OnlineProfiler:
        """Inverse of :meth:`to_json`."""
        return cls.from_dict(json.loads(text))

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_json` to ``path`` (e.g. a run's ``profile.json``), whole or not at all."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(self.to_json() + "\n", encoding="utf-8")
        os.replace(tmp, out)
        return out

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> OnlineProfiler:
        """Read a file written by :meth:`save`."""
        return cls.from_json(Path(path).read_text(encoding="utf-8"))
