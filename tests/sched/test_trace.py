"""Trace events, per-step statistics, Chrome export, JSONL round trip and the timeline plot."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from digen.sched.trace import (
    KIND_COLOURS,
    KINDS,
    StepUsage,
    Trace,
    TraceEvent,
    TraceStatistics,
)

T = 1000.0  # traces need not start at 0; exports are relative to the first event


def small_trace() -> Trace:
    """Two steps on a driver, two generators and one trainer; numbers worked out by hand.

    step 0: generator-0 generate [0,2] and [1,3] (overlap: union 3) + score [4,5] -> busy 4
            trainer-0 update [3,4], update [5,6], step [6,7]                   -> busy 3
            driver sync [7,8] (widens the window, not counted)                 -> wall 8
            generator-1 has nothing in step 0 but still counts as a worker
    step 1: generator-1 generate [8,10] -> busy 2; trainer-0 step [10,11] -> busy 1; wall 3
    """
    tr = Trace()
    tr.record("generate", "generator-0", 0, 0, 0, T + 0, T + 2)
    tr.record("generate", "generator-0", 0, 1, 0, T + 1, T + 3)
    tr.record("update", "trainer-0", 0, 0, 0, T + 3, T + 4)
    tr.record("score", "generator-0", 0, 1, 0, T + 4, T + 5)
    tr.record("update", "trainer-0", 0, 1, 0, T + 5, T + 6)
    tr.record("step", "trainer-0", 0, -1, 0, T + 6, T + 7)
    tr.record("sync", "driver", 0, -1, 1, T + 7, T + 8)
    tr.record("generate", "generator-1", 1, 0, 1, T + 8, T + 10)
    tr.record("step", "trainer-0", 1, -1, 1, T + 10, T + 11)
    return tr


# -- events -------------------------------------------------------------------------------


def test_event_checks_and_coercion() -> None:
    with pytest.raises(ValueError, match="kind 'train'"):
        TraceEvent("train", "trainer-0", 0, 0, 0, 0.0, 1.0)
    with pytest.raises(ValueError, match="ends before it starts"):
        TraceEvent("update", "trainer-0", 0, 0, 0, 2.0, 1.0)
    with pytest.raises(ValueError, match="finite"):
        TraceEvent("update", "trainer-0", 0, 0, 0, 0.0, float("nan"))
    with pytest.raises(ValueError, match="worker"):
        TraceEvent("update", "", 0, 0, 0, 0.0, 1.0)
    ev = TraceEvent("tag", "trainer-1", np.int64(3), np.int32(2), np.int64(1), np.float32(0.5), 2)
    assert type(ev.step) is int and type(ev.t0) is float and type(ev.t1) is float
    assert ev.duration == 1.5
    want = {"kind": "tag", "worker": "trainer-1", "step": 3, "mb": 2, "version": 1}
    assert json.loads(json.dumps(ev.to_dict())) == {**want, "t0": 0.5, "t1": 2.0}
    assert TraceEvent.from_dict({**ev.to_dict(), "extra": 1}) == ev


def test_events_sorted_and_workers_order() -> None:
    tr = Trace()
    names = ["trainer-10", "other", "generator-2", "driver", "trainer-2", "generator-10", "x-10"]
    for i, w in enumerate(names + ["x-2"]):
        tr.record("generate", w, 0, i, 0, 10.0 - i, 11.0)
    assert [e.t0 for e in tr.events] == sorted(e.t0 for e in tr.events)
    assert len(tr) == 8
    assert tr.workers() == [
        "driver", "generator-2", "generator-10", "trainer-2", "trainer-10", "other", "x-2", "x-10",
    ]  # fmt: skip
    assert (tr.start, tr.end) == (3.0, 11.0)


def test_record_is_thread_safe() -> None:
    tr = Trace()

    def work(k: int) -> None:
        for i in range(1000):
            tr.record("generate", f"generator-{k}", 0, i, 0, 1000.0 - i, 1000.0 - i + 0.5)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    evs = tr.events
    assert len(tr) == len(evs) == 4000
    assert {(e.worker, e.mb) for e in evs} == {
        (f"generator-{k}", i) for k in range(4) for i in range(1000)
    }
    assert all(a.t0 <= b.t0 for a, b in zip(evs, evs[1:]))


# -- statistics ---------------------------------------------------------------------------


def test_step_stats_by_hand() -> None:
    tr = small_trace()
    s0 = tr.step_stats(0)
    assert isinstance(s0, StepUsage)
    assert s0.wall_s == 8.0
    assert s0.busy_s == {"generator-0": 4.0, "generator-1": 0.0, "trainer-0": 3.0}
    assert s0.total_work_s == 7.0
    assert s0.utilisation == pytest.approx(7 / (8 * 3))
    assert s0.bubble_fraction == pytest.approx(1 - 7 / 24)
    assert s0.critical_path_s == 4.0
    assert s0.ideal_bound_s == 4.0  # max(7/3, 4)
    assert s0.efficiency == 0.5

    only_two = tr.step_stats(0, workers=["generator-0", "trainer-0"])
    assert only_two.wall_s == 8.0  # the driver's sync still bounds the window
    assert only_two.utilisation == pytest.approx(7 / 16)
    assert only_two.bubble_fraction == pytest.approx(9 / 16)
    assert only_two.ideal_bound_s == 4.0  # max(7/2, 4)

    s1 = tr.step_stats(1)
    assert s1.wall_s == 3.0
    assert s1.busy_s == {"generator-0": 0.0, "generator-1": 2.0, "trainer-0": 1.0}
    assert s1.utilisation == pytest.approx(3 / 9)
    assert s1.ideal_bound_s == 2.0 and s1.efficiency == pytest.approx(2 / 3)


def test_step_stats_total_work_bound_and_edge_cases() -> None:
    tr = Trace()
    # Two trainers, equal work: the bound is total work / workers, and nesting counts once.
    tr.record("update", "trainer-0", 0, 0, 0, 0.0, 4.0)
    tr.record("update", "trainer-0", 0, 1, 0, 1.0, 2.0)  # inside the first: adds nothing
    tr.record("update", "trainer-1", 0, 2, 0, 2.0, 6.0)
    st = tr.step_stats(0)
    assert st.busy_s == {"trainer-0": 4.0, "trainer-1": 4.0}
    assert st.wall_s == 6.0 and st.utilisation == pytest.approx(8 / 12)
    assert st.ideal_bound_s == 4.0 and st.efficiency == pytest.approx(4 / 6)
    with pytest.raises(ValueError, match="step 7"):
        tr.step_stats(7)
    with pytest.raises(ValueError, match="no workers"):
        tr.step_stats(0, workers=[])
    zero = Trace([TraceEvent("sync", "generator-0", 0, -1, 0, 1.0, 1.0)]).step_stats(0)
    assert (zero.wall_s, zero.utilisation, zero.bubble_fraction, zero.efficiency) == (0, 1, 0, 1)


def test_step_boundaries() -> None:
    tr = small_trace()
    # step 0: its "step" event ends at 7 even though the driver's sync runs to 8
    assert tr.step_boundaries() == {0: T + 7, 1: T + 11}
    tr.record("score", "generator-0", 2, 0, 2, T + 11, T + 12)
    assert tr.step_boundaries()[2] == T + 12  # no "step" event: the last event of the step


# -- files --------------------------------------------------------------------------------


def test_chrome_export(tmp_path: Path) -> None:
    tr = small_trace()
    doc = tr.to_chrome()
    assert doc["displayTimeUnit"] == "ms"
    evs = doc["traceEvents"]
    names = {
        e["pid"]: e["args"]["name"] for e in evs if e["ph"] == "M" and e["name"] == "process_name"
    }
    order = {e["pid"]: e["args"]["sort_index"] for e in evs if e["name"] == "process_sort_index"}
    workers = ["driver", "generator-0", "generator-1", "trainer-0"]
    assert sorted(names.values()) == sorted(workers) and len(set(names)) == 4
    assert [names[p] for p in sorted(order, key=order.get)] == workers

    pid = {w: p for p, w in names.items()}
    xs = [e for e in evs if e["ph"] == "X"]
    assert len(xs) == len(tr) == 9
    assert all(e["name"] == e["cat"] and e["name"] in KINDS for e in xs)
    first, second = (e for e in xs if e["pid"] == pid["generator-0"] and e["name"] == "generate")
    assert (first["ts"], first["dur"], first["tid"]) == (0.0, 2e6, 0)
    assert (second["ts"], second["dur"], second["tid"]) == (1e6, 2e6, 1)  # overlaps: own thread
    assert second["args"] == {"step": 0, "mb": 1, "version": 0}
    sync = next(e for e in xs if e["name"] == "sync")
    assert sync["pid"] == pid["driver"] and (sync["ts"], sync["dur"]) == (7e6, 1e6)
    last = next(e for e in xs if e["name"] == "step" and e["args"]["step"] == 1)
    assert (last["pid"], last["tid"], last["ts"], last["dur"]) == (pid["trainer-0"], 0, 10e6, 1e6)

    path = tr.write_chrome(tmp_path / "out" / "trace.json")
    with open(path) as f:
        assert json.load(f) == json.loads(json.dumps(doc))
    assert not list(path.parent.glob("*.tmp"))


def test_a_lost_or_joining_worker_is_marked_on_its_lane() -> None:
    tr = small_trace()
    t0 = tr.start
    tr.mark("joined", "generator-1", t0 + 4.0)
    tr.mark("lost", "generator-0", t0 + 2.5)
    tr.mark("lost", "generator-7", t0 + 3.0)  # no lane (it never ran a task): not drawn
    assert [(t - t0, w, m) for t, w, m in tr.marks] == [
        (2.5, "generator-0", "lost"),
        (3.0, "generator-7", "lost"),
        (4.0, "generator-1", "joined"),
    ]
    with pytest.raises(ValueError, match="'gone' is not one of lost, joined"):
        tr.mark("gone", "generator-0", 1.0)
    doc = tr.to_chrome()["traceEvents"]
    pid = {e["args"]["name"]: e["pid"] for e in doc if e["name"] == "process_name"}
    instants = [(e["name"], e["pid"], e["ts"]) for e in doc if e["ph"] == "i"]
    assert instants == [("lost", pid["generator-0"], 2.5e6), ("joined", pid["generator-1"], 4e6)]
    assert _legend(tr) == ["generate", "score", "update", "step", "sync", "lost", "joined"]
    ax = tr.timeline_figure().axes[0]
    lanes = {t.get_text(): i for i, t in enumerate(ax.get_yticklabels())}
    drawn = {tuple(xy) for c in ax.collections for xy in c.get_offsets() if len(xy) == 2}
    assert {(2.5, lanes["generator-0"]), (4.0, lanes["generator-1"])} <= drawn


def test_jsonl_round_trip(tmp_path: Path) -> None:
    tr = small_trace()
    tr.record("tag", "trainer-0", 1, 3, 1, T + 0.1, T + 0.30000000000000004)
    path = tr.save_jsonl(tmp_path / "trace.jsonl")
    assert len(path.read_text().splitlines()) == len(tr) == 10
    back = Trace.load_jsonl(path)
    assert back.events == tr.events
    path.write_text(path.read_text() + '\n{"kind": "oops"}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:12"):
        Trace.load_jsonl(path)


@pytest.mark.parametrize("own_file", [True, False])
def test_closed_steps_leave_memory_and_stay_in_the_file(tmp_path: Path, own_file: bool) -> None:
    path = tmp_path / "run" / "trace.jsonl"
    if own_file:
        path.parent.mkdir()
        path.write_text("an earlier run's trace\n")
    tr = Trace(path=path if own_file else None)
    tr.extend(small_trace().events)
    ref = small_trace()
    assert tr.statistics() == TraceStatistics(events=9, held=9, open_steps=2)
    want = tr.step_stats(0)
    assert want == ref.step_stats(0)
    tr.close_step(0)
    assert tr.statistics() == TraceStatistics(events=9, held=2, open_steps=1)  # step 1's
    if own_file:  # every event, in recording order, flushed once the step closed
        lines = path.read_text().splitlines()
        assert [TraceEvent.from_dict(json.loads(x)) for x in lines] == ref.events
    assert tr.step_stats(0) == want  # a closed step's statistics, read from the file
    assert tr.step_stats(1) == ref.step_stats(1)

    # an event of a closed step goes to the file only; one of a new step is held
    tr.record("sync", "generator-1", 0, -1, 1, T + 7.5, T + 8)
    tr.record("generate", "generator-0", 2, 0, 2, T + 11, T + 13)
    ref.record("sync", "generator-1", 0, -1, 1, T + 7.5, T + 8)
    ref.record("generate", "generator-0", 2, 0, 2, T + 11, T + 13)
    assert tr.statistics() == TraceStatistics(events=11, held=3, open_steps=2)
    assert len(tr) == 11 and tr.events == ref.events and tr.steps() == [0, 1, 2]
    assert (tr.start, tr.end, tr.workers()) == (ref.start, ref.end, ref.workers())
    assert tr.step_stats(0).busy_s["generator-1"] == 0.5
    assert tr.to_chrome() == ref.to_chrome()
    assert tr.step_boundaries() == ref.step_boundaries()

    saved = tr.save_jsonl(path)  # the trace's own file is complete as it is
    assert Trace.load_jsonl(saved).events == ref.events
    assert len(saved.read_text().splitlines()) == 11
    other = tr.save_jsonl(tmp_path / "copy.jsonl")  # elsewhere: sorted by start, as ever
    assert other.read_text() == ref.save_jsonl(tmp_path / "ref.jsonl").read_text()


# -- plot ---------------------------------------------------------------------------------


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return tuple(int(hex_colour[i : i + 2], 16) for i in (1, 3, 5))  # type: ignore[return-value]


def test_plot_timeline(tmp_path: Path) -> None:
    tr = small_trace()
    path = tr.plot_timeline(tmp_path / "timeline.png", title="two steps")
    img = np.asarray(Image.open(path).convert("RGB"))
    assert img.shape == (600, 1600, 3)
    flat = img.reshape(-1, 3)
    for kind in ("generate", "score", "update", "step", "sync"):
        assert (flat == _rgb(KIND_COLOURS[kind])).all(axis=1).sum() > 500, kind
    packed = flat.astype(np.int64) @ np.array([1 << 16, 1 << 8, 1])
    assert len(np.unique(packed)) > 20

    # Dark columns are the axes' left/right spines (x = 0 and x = span) and the dashed step
    # ends; map the expected step ends through the spines and look for a dashed line there.
    dark = (img.max(axis=2) < 100).sum(axis=0)
    cols = np.flatnonzero(dark > 150)
    left, right = cols.min(), cols.max()
    span = tr.end - tr.start
    for b in tr.step_boundaries().values():
        x = left + (b - tr.start) / span * (right - left)
        if abs(x - right) > 5:
            assert dark[int(x) - 2 : int(x) + 3].max() > 100, b
    assert dark[left + (right - left) // 2] < 50  # mid-step 0 (t = 5.5 s): no line


def _legend(tr: Trace) -> list[str]:
    fig = tr.timeline_figure()
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_legend_names_only_kinds_in_the_trace_and_each_shows() -> None:
    assert _legend(small_trace()) == ["generate", "score", "update", "step", "sync"]  # no tag
    tr = Trace()
    tr.record("generate", "generator-0", 0, 0, 0, 0.0, 1.0)
    tr.record("tag", "trainer-0", 0, 1, 0, 0.0, 1.0)
    assert _legend(tr) == ["generate", "tag"]
    assert _legend(Trace()) == []

    # An optimizer step of 10 ms between a minute of updates and the weight sync right after
    # it: both are widened to a few pixels, side by side, so the step is not hidden.
    tr = Trace()
    for s in range(3):
        t = 60.0 * s
        tr.record("update", "trainer-0", s, 0, s, t, t + 50)
        tr.record("step", "trainer-0", s, -1, s, t + 50, t + 50.01)
        tr.record("sync", "trainer-0", s, -1, s + 1, t + 50.01, t + 50.05)
    fig = tr.timeline_figure()
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    for kind in ("step", "sync"):
        hits = (img == _rgb(KIND_COLOURS[kind])).all(axis=2)
        assert hits.any(axis=0).sum() >= 3 * 2, kind  # at least 2 pixel columns a step


def test_plot_many_workers_and_empty(tmp_path: Path) -> None:
    tr = Trace()
    rng = np.random.default_rng(0)
    for w in [f"generator-{i}" for i in range(32)] + [f"trainer-{i}" for i in range(16)]:
        t = 0.0
        for i in range(60):
            d = float(rng.uniform(0.05, 0.5))
            tr.record(KINDS[i % 4], w, i // 20, i, i // 20, t, t + d)
            t += d + float(rng.uniform(0, 0.1))
    assert len(tr) == 2880
    path = tr.plot_timeline(tmp_path / "big.png")
    with Image.open(path) as im:
        assert im.size == (1600, 600)
    empty = Trace().plot_timeline(tmp_path / "sub" / "empty.png", size_px=(800, 300))
    with Image.open(empty) as im:
        assert im.size == (800, 300)


def test_import_is_light() -> None:
    code = (
        "import sys, digen.sched.trace; print('torch' in sys.modules, 'matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
