"""Task trace of a run: events, per-step statistics, Chrome trace export and a timeline plot.

Every task a worker runs is one :class:`TraceEvent` (``kind, worker, step, mb, version, t0,
t1``). The real runtime and the simulator produce the same events, so everything here is
computed from a plain list of them and the same plot draws both. Times are seconds on any
clock (wall clock or simulated); only differences matter.

Per-step statistics (:meth:`Trace.step_stats`), for the events whose ``step`` field is ``s``:

- ``wall_s``: the step window, from the earliest ``t0`` to the latest ``t1`` of those events
  (all workers, the driver included).
- ``busy_s[w]``: the length of the union of worker ``w``'s task intervals of the step, so
  overlapping tasks on one worker count once. A scoring lane (``scorer-i``, scoring
  overlapped with generation) is a thread of generator ``i``'s process: its tasks count as
  generator ``i``'s, so a device busy generating and scoring at once is busy once.
- ``utilisation = sum(busy_s) / (wall_s * len(workers))``; ``bubble_fraction = 1 -
  utilisation``. By default the workers are every worker seen anywhere in the trace except
  ``"driver"`` and the scoring lanes, so a worker idle for the whole step counts as idle.
- ``ideal_bound_s = max(total_work_s / len(workers), critical_path_s)`` with ``total_work_s =
  sum(busy_s)``. ``critical_path_s`` is, for now, the busiest worker's busy time: a lower
  bound on any chain of tasks the step must run, since one worker runs its tasks one after
  another. (With this choice the bound equals the busiest worker's time.)
- ``efficiency = ideal_bound_s / wall_s``: measured against the bound, as benchmarks report.

A run's trace stays small however long the run: once a step's statistics are taken its owner
calls :meth:`Trace.close_step`, and from then on the trace holds in memory only the events of
the steps still open. The rest are in the trace's file (the run's ``trace.jsonl``, appended to
as each task finishes, or a temporary file), and the whole trace, the Chrome export and the
timeline are read back from there: a step's statistics cost the same at step 2,000 as at
step 10.

This module imports nothing heavy; matplotlib is imported only when a timeline is drawn.
"""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
import threading
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from digen.sched.names import DRIVER, Pool, TaskKind, index_of, pool_of

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "KINDS",
    "KIND_COLOURS",
    "MARKS",
    "StepUsage",
    "Trace",
    "TraceEvent",
    "TraceStatistics",
    "device_of",
    "union_length",
]

KINDS: tuple[str, ...] = tuple(TaskKind)
"""Task kinds (:class:`~digen.sched.names.TaskKind`); ``tag`` is a generation run on a
trainer (trainer-assisted generation)."""

KIND_COLOURS = {
    TaskKind.GENERATE: "#1f77b4",
    TaskKind.TAG: "#ff7f0e",
    TaskKind.SCORE: "#2ca02c",
    TaskKind.UPDATE: "#d62728",
    TaskKind.STEP: "#9467bd",
    TaskKind.SYNC: "#7f7f7f",
}
"""One fixed colour per kind, so timelines of different runs read the same."""

MARKS = {"lost": ("X", "#d62728"), "joined": ("^", "#2ca02c")}
"""What can happen to a worker's lane besides its tasks (a generator lost, or joining the
pool mid-run), with the marker and colour a timeline draws it in."""

_ROLE_RANK = {DRIVER: 0, Pool.GENERATOR: 1, Pool.SCORER: 1, Pool.TRAINER: 2}
"""Lane order: the driver, each generator followed by its scoring lane, then trainers."""


def device_of(worker: str) -> str:
    """The worker whose device (and process) ``worker``'s tasks run on: a scoring lane's
    is its generator's; every other worker's, its own."""
    if pool_of(worker) == Pool.SCORER:
        return f"{Pool.GENERATOR}-{index_of(worker)}"
    return worker


@dataclass(frozen=True, slots=True)
class TraceEvent:
    """One task: what ran, where, for which step / micro-batch / policy version, and when."""

    kind: str
    """One of :data:`KINDS`."""
    worker: str
    """The worker that ran it, e.g. ``"generator-0"``, ``"trainer-1"``, ``"driver"``."""
    step: int
    """Train step the task belongs to."""
    mb: int
    """Micro-batch id within the step; -1 where none applies (``step``, ``sync``)."""
    version: int
    """Policy version the task used."""
    t0: float
    """Start, in seconds."""
    t1: float
    """End, in seconds (``t1 >= t0``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"trace event kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.worker, str) or not self.worker:
            raise ValueError(f"trace event worker must be a non-empty string, got {self.worker!r}")
        # Coerce numpy scalars and the like so events always serialise to JSON.
        for name in ("step", "mb", "version"):
            object.__setattr__(self, name, int(getattr(self, name)))
        for name in ("t0", "t1"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if not (math.isfinite(self.t0) and math.isfinite(self.t1)):
            raise ValueError(f"trace event times must be finite, got t0={self.t0}, t1={self.t1}")
        if self.t1 < self.t0:
            raise ValueError(f"trace event ends before it starts: t0={self.t0}, t1={self.t1}")

    @property
    def duration(self) -> float:
        """``t1 - t0`` in seconds."""
        return self.t1 - self.t0

    def to_dict(self) -> dict[str, Any]:
        """The event as a JSON-ready dict with one key per field."""
        return {
            "kind": self.kind,
            "worker": self.worker,
            "step": self.step,
            "mb": self.mb,
            "version": self.version,
            "t0": self.t0,
            "t1": self.t1,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TraceEvent:
        """Inverse of :meth:`to_dict`; extra keys are ignored."""
        return cls(
            kind=d["kind"],
            worker=d["worker"],
            step=d["step"],
            mb=d["mb"],
            version=d["version"],
            t0=d["t0"],
            t1=d["t1"],
        )


@dataclass(frozen=True)
class StepUsage:
    """How well one step kept its workers busy (definitions in the module docstring)."""

    step: int
    wall_s: float
    """Span of the step: earliest start to latest end of its events."""
    busy_s: dict[str, float]
    """Per counted worker, the union length of its task intervals in the step."""
    utilisation: float
    """``sum(busy_s) / (wall_s * len(busy_s))``."""
    bubble_fraction: float
    """``1 - utilisation``."""
    total_work_s: float
    """``sum(busy_s)``."""
    critical_path_s: float
    """Lower bound on the step's longest task chain: the busiest worker's busy time."""
    ideal_bound_s: float
    """``max(total_work_s / len(busy_s), critical_path_s)``."""
    efficiency: float
    """``ideal_bound_s / wall_s`` (1.0 for a zero-length step)."""


@dataclass(frozen=True, slots=True)
class TraceStatistics:
    """What a trace holds: all its events, and the few it keeps in memory."""

    events: int
    """Events recorded, in memory or only in the file."""
    held: int
    """Events in memory: those of the open steps (every event until a step is closed)."""
    open_steps: int
    """Steps with events in memory."""


class Trace:
    """Collects events; appending is thread-safe (the runtime records from RPC callbacks).

    ``path``: the file every event is appended to as it is recorded (one JSON object per
    line, in recording order; an existing file is replaced). Without one, events stay in
    memory until the first :meth:`close_step`, which moves them to a temporary file.
    Statistics of an open step read its events from memory; anything else reads the file.
    """

    def __init__(
        self, events: Iterable[TraceEvent] = (), *, path: str | os.PathLike[str] | None = None
    ) -> None:
        self._lock = threading.Lock()
        self.path = Path(path) if path is not None else None
        """The trace's own file, or None (memory, then a temporary file)."""
        self._file: Any = None
        """Where every event goes once the trace has a file (None: all are in ``_held``)."""
        self._held: list[TraceEvent] = []
        """Without a file: every event, in recording order (sorted by start when read)."""
        self._sorted = True
        self._by_step: dict[int, list[TraceEvent]] = {}
        """The events of each open step, in recording order."""
        self._closed_through: int | None = None
        """The newest closed step: an event of an older step that is not open goes to the
        file only (it would come after that step's statistics)."""
        self._workers: set[str] = set()
        self._marks: list[tuple[float, str, str]] = []
        self._count = 0
        self._start = math.inf
        self._end = -math.inf
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._attach(self.path.open("w+", encoding="utf-8"))
        self.extend(events)

    def _attach(self, fh: Any) -> None:
        self._file = fh
        weakref.finalize(self, fh.close)  # flushed and closed with the trace

    # -- collecting -------------------------------------------------------------------------

    def _append(self, ev: TraceEvent) -> None:  # caller holds the lock
        self._count += 1
        self._workers.add(ev.worker)
        self._start = min(self._start, ev.t0)
        self._end = max(self._end, ev.t1)
        if self._file is not None:
            self._file.write(_line(ev))
        else:
            if self._held and ev.t0 < self._held[-1].t0:
                self._sorted = False
            self._held.append(ev)
        closed = self._closed_through
        if ev.step in self._by_step or closed is None or ev.step > closed:
            self._by_step.setdefault(ev.step, []).append(ev)

    def record(
        self, kind: str, worker: str, step: int, mb: int, version: int, t0: float, t1: float
    ) -> TraceEvent:
        """Add one event and return it."""
        ev = TraceEvent(kind, worker, step, mb, version, t0, t1)
        with self._lock:
            self._append(ev)
        return ev

    def extend(self, events: Iterable[TraceEvent]) -> None:
        """Add several events."""
        evs = list(events)
        for ev in evs:
            if not isinstance(ev, TraceEvent):
                raise TypeError(f"expected a TraceEvent, got {type(ev).__name__}")
        with self._lock:
            for ev in evs:
                self._append(ev)

    def mark(self, what: str, worker: str, t: float) -> None:
        """``worker``'s lane ends or starts at ``t``: ``what`` is ``lost`` or ``joined``
        (one of :data:`MARKS`). Shown in the Chrome export and the timeline; kept in memory
        (a few per run), not in the trace's file."""
        if what not in MARKS:
            raise ValueError(f"trace mark {what!r} is not one of {', '.join(MARKS)}")
        with self._lock:
            self._marks.append((float(t), worker, what))

    @property
    def marks(self) -> list[tuple[float, str, str]]:
        """``(t, worker, what)`` of every :meth:`mark`, in time order."""
        with self._lock:
            return sorted(self._marks)

    def close_step(self, step: int) -> None:
        """Step ``step`` is over (its statistics are taken): its events leave memory.

        They stay in the file (a temporary one is made the first time, when the trace has
        none), which is flushed, so every closed step is on disk.
        """
        with self._lock:
            if self._file is None:
                spill = tempfile.TemporaryFile("w+", encoding="utf-8")  # noqa: SIM115 (the trace's)
                self._attach(spill)
                self._file.writelines(_line(e) for e in self._held)
                self._held = []
            self._by_step.pop(step, None)
            closed = self._closed_through
            self._closed_through = step if closed is None else max(closed, step)
            self._file.flush()

    def statistics(self) -> TraceStatistics:
        """How many events the trace has, and how many it holds in memory."""
        with self._lock:
            if self._file is None:
                held = len(self._held)
            else:
                held = sum(len(evs) for evs in self._by_step.values())
            return TraceStatistics(self._count, held, len(self._by_step))

    @property
    def events(self) -> list[TraceEvent]:
        """Every event, sorted by start time (ties keep recording order); read from the
        file once the trace has one."""
        with self._lock:
            if self._file is None:
                if not self._sorted:
                    self._held.sort(key=lambda e: e.t0)
                    self._sorted = True
                return list(self._held)
            evs = list(self._read_file())
        evs.sort(key=lambda e: e.t0)
        return evs

    def _read_file(self) -> Iterator[TraceEvent]:  # caller holds the lock
        """The file's events in recording order (its position is put back after)."""
        fh = self._file
        fh.flush()
        fh.seek(0)
        try:
            for line in fh:
                if line.strip():
                    yield TraceEvent.from_dict(json.loads(line))
        finally:
            fh.seek(0, os.SEEK_END)

    def __len__(self) -> int:
        with self._lock:
            return self._count

    # -- simple views -----------------------------------------------------------------------

    def workers(self) -> list[str]:
        """Workers with events: driver, generators by index, trainers by index, then others."""
        with self._lock:
            names = set(self._workers)
        return sorted(names, key=_worker_key)

    def steps(self) -> list[int]:
        """The distinct step numbers, ascending."""
        return sorted({e.step for e in self.events})

    @property
    def start(self) -> float:
        """Earliest ``t0`` (0.0 for an empty trace); exported times are relative to it."""
        with self._lock:
            return self._start if self._count else 0.0

    @property
    def end(self) -> float:
        """Latest ``t1`` (0.0 for an empty trace)."""
        with self._lock:
            return self._end if self._count else 0.0

    def step_boundaries(self) -> dict[int, float]:
        """Per step, when it ended: the end of its last ``step`` event, else of its last event."""
        last: dict[int, float] = {}
        last_step_ev: dict[int, float] = {}
        for e in self.events:
            last[e.step] = max(last.get(e.step, e.t1), e.t1)
            if e.kind == TaskKind.STEP:
                last_step_ev[e.step] = max(last_step_ev.get(e.step, e.t1), e.t1)
        return {s: last_step_ev.get(s, last[s]) for s in sorted(last)}

    # -- statistics -------------------------------------------------------------------------

    def step_stats(self, step: int, workers: Sequence[str] | None = None) -> StepUsage:
        """Wall time, busy time, utilisation and ideal bound of one step.

        ``workers`` are the workers counted in utilisation; by default every worker in the
        trace except ``"driver"``. Events of other workers still widen the step window.
        """
        with self._lock:  # an open step's events are at hand; a closed one's, in the file
            evs = list(self._by_step.get(step, ()))
            if not evs and self._file is not None:
                evs = [e for e in self._read_file() if e.step == step]
        if not evs:
            raise ValueError(f"the trace has no events for step {step}")
        if workers is None:
            counted = [w for w in self.workers() if w != DRIVER and pool_of(w) != Pool.SCORER]
        else:
            counted = list(workers)
        if not counted:
            raise ValueError(f"no workers to compute step {step}'s utilisation over")
        t0 = min(e.t0 for e in evs)
        wall = max(e.t1 for e in evs) - t0
        per_worker: dict[str, list[tuple[float, float]]] = {w: [] for w in counted}
        for e in evs:
            w = e.worker if e.worker in per_worker else device_of(e.worker)
            if w in per_worker:
                per_worker[w].append((e.t0, e.t1))
        busy = {w: union_length(iv) for w, iv in per_worker.items()}
        total = sum(busy.values())
        critical = max(busy.values())
        ideal = max(total / len(counted), critical)
        if wall > 0:
            util = total / (wall * len(counted))
            eff = ideal / wall
        else:  # every event has zero length: nothing idled, nothing to gain
            util, eff = 1.0, 1.0
        return StepUsage(
            step=step,
            wall_s=wall,
            busy_s=busy,
            utilisation=util,
            bubble_fraction=1.0 - util,
            total_work_s=total,
            critical_path_s=critical,
            ideal_bound_s=ideal,
            efficiency=eff,
        )

    # -- files ------------------------------------------------------------------------------

    def to_chrome(self) -> dict[str, Any]:
        """The trace in Chrome trace format (opens in Perfetto and chrome://tracing).

        One process per worker, ordered as :meth:`workers`; each task is a complete (``"X"``)
        event with ``ts`` / ``dur`` in microseconds from the trace start. Tasks of one worker
        that overlap go on separate threads of its process, so every thread nests cleanly.
        A worker lost or joining mid-run (:meth:`mark`) has an instant event there.
        """
        events = self.events
        start = min((e.t0 for e in events), default=0.0)
        out: list[dict[str, Any]] = []
        pid_of: dict[str, int] = {}
        for i, w in enumerate(self.workers()):
            pid = pid_of[w] = i + 1
            out.append(_meta("process_name", pid, 0, {"name": w}))
            out.append(_meta("process_sort_index", pid, 0, {"sort_index": i}))
        lane_ends: dict[str, list[float]] = {w: [] for w in pid_of}
        for e in events:  # sorted by t0: first-fit lanes never overlap
            ends = lane_ends[e.worker]
            tid = next((k for k, end in enumerate(ends) if end <= e.t0), len(ends))
            if tid == len(ends):
                ends.append(e.t1)
                name = "tasks" if tid == 0 else f"tasks (overlap {tid})"
                out.append(_meta("thread_name", pid_of[e.worker], tid, {"name": name}))
            else:
                ends[tid] = e.t1
            ts = round((e.t0 - start) * 1e6, 3)
            dur = round(round((e.t1 - start) * 1e6, 3) - ts, 3)
            out.append(
                {
                    "ph": "X",
                    "name": e.kind,
                    "cat": e.kind,
                    "pid": pid_of[e.worker],
                    "tid": tid,
                    "ts": ts,
                    "dur": dur,
                    "args": {"step": e.step, "mb": e.mb, "version": e.version},
                }
            )
        for t, worker, what in self.marks:  # instant events on the worker's lane
            if worker in pid_of:
                ts = round((t - start) * 1e6, 3)
                out.append({"ph": "i", "s": "p", "name": what, "cat": "pool", "ts": ts})
                out[-1] |= {"pid": pid_of[worker], "tid": 0}
        return {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {"trace_start_s": start},
        }

    def write_chrome(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`to_chrome` as JSON (whole file or nothing) and return the path."""
        text = json.dumps(self.to_chrome(), separators=(",", ":"))
        return _write_text(Path(path), text)

    def save_jsonl(self, path: str | os.PathLike[str]) -> Path:
        """Write the raw events, one JSON object per line, sorted by start time. To the
        trace's own file (``path``), nothing is left to write: it is flushed as it is."""
        path = Path(path)
        if self.path is not None and path.resolve() == self.path.resolve():
            with self._lock:
                self._file.flush()
            return path
        return _write_text(path, "".join(_line(e) for e in self.events))

    @classmethod
    def load_jsonl(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a file written by :meth:`save_jsonl` (blank lines are skipped)."""
        evs: list[TraceEvent] = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    evs.append(TraceEvent.from_dict(json.loads(line)))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(f"{path}:{lineno}: not a trace event ({exc})") from exc
        return cls(evs)

    # -- plot -------------------------------------------------------------------------------

    def plot_timeline(
        self,
        path: str | os.PathLike[str],
        *,
        title: str | None = None,
        size_px: tuple[int, int] = (1600, 600),
        dpi: int = 100,
    ) -> Path:
        """Save :meth:`timeline_figure` to ``path``: exactly ``size_px`` pixels, in the format
        the suffix names."""
        fig = self.timeline_figure(title=title, size_px=size_px, dpi=dpi)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        fig.savefig(tmp, format=out.suffix.lstrip(".").lower() or "png", dpi=dpi)
        os.replace(tmp, out)
        return out

    def timeline_figure(
        self, *, title: str | None = None, size_px: tuple[int, int] = (1600, 600), dpi: int = 100
    ) -> Figure:
        """One lane per worker (order of :meth:`workers`), coloured by kind; a worker lost
        or joining mid-run has a marker there (:data:`MARKS`).

        Step ends (:meth:`step_boundaries`) are dashed vertical lines; x is seconds from the
        trace start. Tasks too short to see (an optimizer step next to minutes of sampling)
        are drawn a few pixels wide, so they show; the legend names only the kinds the trace
        holds.
        """
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch

        events = self.events
        workers = self.workers()
        start = min((e.t0 for e in events), default=0.0)
        span = max((e.t1 for e in events), default=start) - start

        fig = Figure(figsize=(size_px[0] / dpi, size_px[1] / dpi), dpi=dpi)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        fig.subplots_adjust(left=0.09, right=0.985, bottom=0.09, top=0.9)
        if title:
            fig.text(0.01, 0.985, title, ha="left", va="top", fontsize=11)

        lane = {w: i for i, w in enumerate(workers)}
        bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
        shortest = span * 0.002  # a task shorter than 3 pixels in 1600 is drawn that wide
        after: dict[str, float] = {}  # lane -> end of its last widened task
        for e in events:  # by start time
            x, width = e.t0 - start, e.t1 - e.t0
            if width < shortest:  # beside the widened task before it (a step, then its sync)
                x = max(x, after.get(e.worker, x))
                width = shortest
                after[e.worker] = x + width
            bars.setdefault((e.worker, e.kind), []).append((x, width))
        for i in range(1, len(workers), 2):  # light banding keeps many lanes apart
            ax.axhspan(i - 0.5, i + 0.5, color="#f2f2f2", linewidth=0, zorder=0)
        for kind in KINDS:  # fixed drawing order: later kinds on top where tasks overlap
            for w in workers:
                xr = bars.get((w, kind))
                if xr:
                    ax.broken_barh(
                        xr,
                        (lane[w] - 0.4, 0.8),
                        facecolors=KIND_COLOURS[kind],
                        linewidth=0,
                        zorder=2,
                    )

        marked = []
        for what, (marker, colour) in MARKS.items():
            at = [(t - start, lane[w]) for t, w, m in self.marks if m == what and w in lane]
            if at:
                xs, ys = zip(*at, strict=True)
                ax.scatter(xs, ys, marker=marker, s=90, c=colour, edgecolors="black", zorder=4)
                marked.append(what)

        bounds = self.step_boundaries()
        xaxis = ax.get_xaxis_transform()
        if bounds:
            xs = [b - start for b in bounds.values()]
            ax.vlines(xs, 0, 1, transform=xaxis, colors="black", linestyles="--", lw=1.2, zorder=3)
            if len(bounds) <= 40:
                for s, x in zip(bounds, xs, strict=True):
                    ax.text(
                        x, 1.005, f"s{s}", transform=xaxis, ha="center", va="bottom", fontsize=7
                    )

        n = len(workers)
        ax.set_yticks(range(n), labels=workers, fontsize=max(5.0, min(9.0, 360 / max(n, 1))))
        ax.set_ylim(max(n, 1) - 0.5, -0.5)
        ax.set_xlim(0, span if span > 0 else 1.0)
        ax.set_xlabel("seconds from trace start")
        ax.grid(axis="x", alpha=0.3, zorder=1)
        ax.set_axisbelow(True)
        if not events:
            ax.text(0.5, 0.5, "no task ran", transform=ax.transAxes, ha="center", va="center")
        present = [k for k in KINDS if any(kk == k for _, kk in bars)]
        if present or marked:
            handles: list[Any] = [Patch(facecolor=KIND_COLOURS[k], label=k) for k in present]
            handles += [
                Line2D([], [], marker=MARKS[m][0], color=MARKS[m][1], ls="", label=m)
                for m in marked
            ]
            fig.legend(
                handles=handles,
                loc="upper right",
                bbox_to_anchor=(0.985, 0.995),
                ncol=len(handles),
                frameon=False,
                fontsize=9,
            )
        return fig


def _worker_key(name: str) -> tuple[int, int, tuple[tuple[int, int, str], ...]]:
    role = pool_of(name)
    if role in _ROLE_RANK:
        return _ROLE_RANK[role], index_of(name), ((int(role == Pool.SCORER), 0, ""),)
    # Anything else after the known roles, in natural order ("x-2" before "x-10").
    parts = tuple(
        (0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name) if p
    )
    return 3, 0, parts


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by a set of intervals (overlaps count once)."""
    total = 0.0
    cur_a = cur_b = None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _line(ev: TraceEvent) -> str:
    return json.dumps(ev.to_dict()) + "\n"


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": pid, "tid": tid, "args": args}


def _write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
