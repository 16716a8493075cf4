"""A long run's accounting stays flat: each step costs the same work and memory at step 2,000
as at step 100, and still gives the metrics worked out by hand."""

from __future__ import annotations

import json
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from digen import load_config
from digen.presets import preset
from digen.runtime.driver.accounting import CostLedger
from digen.runtime.messages import LossStats
from digen.sched.names import DRIVER, TaskKind
from digen.sched.scheduler import StepRecord
from digen.sched.trace import Trace

WORKERS = ["generator-0", "generator-1", "trainer-0"]


def _step(acc: CostLedger, s: int, b: int, n: int) -> dict:
    """One step ``s`` of ten seconds from ``T = 10 s``; generator-1 makes the next step's
    micro-batch while this one trains, so two steps are open at once:

    generator-0 generate [T, T+4], its scoring lane score [T+4, T+5]  -> busy 5
    generator-1 generate of step s+1 [T+5, T+9] (step s's: [T-5, T-1]) -> busy 4 (0 at s=0)
    trainer-0 update [T+5, T+8], step [T+8, T+9]                      -> busy 4
    driver sync [T+9, T+10]; window [T-5, T+10]: 15 s (10 s at s=0)
    """
    t = 10.0 * s
    acc.record(TaskKind.GENERATE, "generator-0", s, 0, s, 4.5, t, t + 4)
    acc.record(TaskKind.SCORE, "scorer-0", s, 0, s, 1.0, t + 4, t + 5)
    acc.scored(s, {"jpeg": 0.25})
    acc.record(TaskKind.GENERATE, "generator-1", s + 1, 1, s, 4.0, t + 5, t + 9)
    acc.record(TaskKind.UPDATE, "trainer-0", s, 0, s, 3.0, t + 5, t + 8, memory_gb=1.5)
    acc.record(TaskKind.STEP, "trainer-0", s, -1, s, 1.0, t + 8, t + 9)
    acc.trace.record(TaskKind.SYNC.value, DRIVER, s, -1, s + 1, t + 9, t + 10)
    rec = StepRecord(step=s, mbs=[])
    rec.rewards = {(p, j): (s % 7) + p + 0.5 * j for p in range(b) for j in range(n)}
    rec.components = {"jpeg": dict(rec.rewards)}
    rec.trained = {0: LossStats(terms=4, loss=1.0 + s)}
    texts = [f"prompt {p}" for p in range(b)]
    res = acc.step_result(
        rec,
        texts,
        version=s + 1,
        grad_norms=[0.5],
        step_time_s=10.0,
        optimizer_s=1.0,
        sync_s=1.0,
        driver_mb=0.0,
    )
    return res.metrics


def _lines_run(fn: Callable[[], None]) -> int:
    """Python lines ``fn`` executes: a count of work that no load on the machine changes."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    before = sys.gettrace()
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(before)
    return count


def _check(row: dict, s: int, b: int, n: int) -> None:
    """The metrics of step ``s``, worked out by hand (see :func:`_step`)."""
    assert row["step"] == s
    assert row["utilisation"] == (9 / 30 if s == 0 else 13 / 45)
    assert row["time/generate_s"] == (4.0 if s == 0 else 8.0)  # generator-1's is the next's
    assert (row["time/score_s"], row["time/train_s"]) == (1.0, 3.0)
    assert row["overhead_ms/generate"] == (500.0 if s == 0 else 250.0)  # 0.5 s and 0 s
    assert row["memory/peak_gb/trainer"] == 1.5
    assert row["loss"] == (1.0 + s) / 4
    assert row["reward_mean"] == pytest.approx(s % 7 + (b - 1) / 2 + 0.25 * (n - 1))


@pytest.mark.parametrize("to_file", [False, True])
def test_two_thousand_steps_cost_what_the_first_hundred_do(tmp_path: Path, to_file: bool) -> None:
    cfg = load_config(base=preset("sd3", "flowgrpo", mode="disaggregated"))
    b, n = cfg.data.train_batch_size, cfg.rollout.n
    path = tmp_path / "trace.jsonl" if to_file else None
    acc = CostLedger(cfg, Trace(path=path), WORKERS)
    held: set[int] = set()
    work: dict[int, int] = {}

    def steps(first: int, last: int) -> None:  # keeps nothing but what the accounts keep
        for s in range(first, last):
            _check(_step(acc, s, b, n), s, b, n)
            held.add(acc.trace.statistics().held)

    steps(0, 100)
    work[100] = _lines_run(lambda: steps(100, 200))
    steps(200, 1900)
    tracemalloc.start()
    try:
        work[1900] = _lines_run(lambda: steps(1900, 2000))
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # bounded: in memory only the open step's look-ahead; per step the same work, no growth
    assert len(acc.trace) == 6 * 2000
    assert held == {1}  # step s+1's generation, made while step s trained
    assert work[1900] <= 1.2 * work[100]
    assert grown < 20_000  # bytes still held after 100 more steps of 6 events each

    if to_file:  # every event is in the run's file as it is recorded, nothing twice
        lines = path.read_text().splitlines()
        assert len(lines) == len(acc.trace)
        assert json.loads(lines[0]) == {
            "kind": "generate",
            "worker": "generator-0",
            "step": 0,
            "mb": 0,
            "version": 0,
            "t0": 0.0,
            "t1": 4.0,
        }
    events = acc.trace.events
    assert len(events) == len(acc.trace) and max(e.step for e in events) == 2000
    assert [e.t0 for e in events] == sorted(e.t0 for e in events)
    assert acc.trace.step_stats(1234, WORKERS).utilisation == 13 / 45  # closed: from the file
