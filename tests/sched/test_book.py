"""The driver's book-keeping (``Book``) against the simulator's model of the same history.

The simulator's engine logs every transition; replaying the log into a ``Book`` (as the driver
reports transitions) must give, at every bubble, exactly the ``SchedState`` the engine gave
the TAG policy. Partial GAP groups with 3 and 4 micro-batches per group are in the grid: the
book counts scored *micro-batches* per group, which is what the model expects.
"""

from __future__ import annotations

import pytest

from digen.sched import BTS, Costs, StaticTAG, TagPolicy
from digen.sched._engine import GEN, SCORE, TAG, UPDATE, Engine, Model
from digen.sched.admission import Admission, stale_cap
from digen.sched.book import Book
from digen.sched.names import Pool, worker_name
from digen.sched.plan import SchedulePlan, StepLayout
from digen.sched.state import WORKER_KINDS, SchedState


class _Recorder(TagPolicy):
    """Answers like ``inner`` and keeps every state it was shown."""

    def __init__(self, inner: TagPolicy) -> None:
        self.inner = inner
        self.states: list[SchedState] = []

    def decide(self, state: SchedState, costs: Costs) -> bool:
        self.states.append(state)
        return self.inner.decide(state, costs)


def _simulate_with_log(
    costs, b, g, t, policy, *, steps, gsize, w, ratio, schedule, inflight, overlap=False
):
    plan = SchedulePlan(
        microbatches=b,
        update_group=gsize,
        generators=g,
        trainers=t,
        admission=Admission(
            max_staleness=w,
            stale_cap=stale_cap(b, ratio),
            schedule=schedule,
            max_inflight=inflight,
            last_step=steps - 1,
        ),
        score_overlap=overlap,
        layout=StepLayout(b // gsize, gsize, 1),
    )
    model = Model(plan, costs)
    eng = Engine(model, horizon=steps, log=True)
    while (j := eng.run()) >= 0:
        eng.decide(j, policy.decide(eng.to_state(j), costs))
    return model, eng.log


def _replay(model: Model, log: list[tuple], costs: Costs, seen: list[SchedState]) -> int:
    """Feed the engine's history to a Book; compare at every bubble. Returns bubbles compared."""
    names = model.names
    book = Book(model.plan)
    compared = 0
    now = 0.0
    for entry in log:
        op = entry[0]
        if op == "take":
            _, s, m, version = entry
            mb = book.hand_out(version)
            assert mb is not None and (mb.step, mb.mb) == (s, m)
        elif op == "start":
            _, i, kind, s, m, now = entry
            if kind in (GEN, TAG, SCORE, UPDATE):
                if kind == SCORE and i >= model.workers:  # a scoring lane: SQ first, then its own
                    took = book.next_to_score(i - model.workers)
                    assert took is not None and (took[0].step, took[0].mb) == (s, m)
                elif kind == SCORE and (s, m) in book.sq:  # a generator scores SQ's head
                    took = book.next_to_score()
                    assert took is not None and (took[0].step, took[0].mb) == (s, m)
                book.started(names[i], WORKER_KINDS[kind], s, m, now)
        elif op == "finish":
            _, i, kind, s, m, version, now = entry
            book.finished(names[i])
            mb = book.record(s).mbs[m] if m >= 0 else None
            if kind in (GEN, TAG):
                book.generated(mb, names[i], version)
            elif kind == SCORE and book.scored(mb, [0.0] * len(mb.samples), {}):
                for other in book.record(s).group(mb.prompt):
                    book.queued(s, other.mb)
            elif kind == UPDATE:
                book.trained(s, m, None)
        elif op == "wait":
            book.idle(entry[1])
        elif op == "bubble":
            _, j, insert = entry
            assert book.sched_state(j, now, costs) == seen[compared]
            compared += 1
            book.bubble(j, insert)
        elif op == "version":
            book.advance(entry[1])
            book.gen_version = [entry[1]] * model.generators
    assert compared == len(seen)
    return compared


@pytest.mark.parametrize(
    ("g", "t", "gsize", "w", "schedule", "inflight"),
    [
        (1, 1, 1, 0, "fixed", None),
        (2, 1, 2, 0, "fixed", None),
        (3, 1, 3, 0, "fixed", None),  # 3 micro-batches per GAP group
        (2, 1, 3, 0, "fixed", None),  # 3 per group on 2 generators: groups stay partial
        (3, 2, 4, 0, "fixed", None),  # 4 per group, two trainers
        (3, 2, 3, 1, "fixed", None),  # TCSS, fixed schedule
        (3, 1, 4, 1, "eager", None),  # TCSS, eager schedule
        (2, 2, 2, 0, "fixed", 3),  # C_gen back-pressure
    ],
)
@pytest.mark.parametrize("policy", ["static", "bts"])
@pytest.mark.parametrize("overlap", [False, True], ids=["scored-by-generators", "score-lanes"])
def test_book_state_equals_engine_state_at_every_bubble(
    g: int,
    t: int,
    gsize: int,
    w: int,
    schedule: str,
    inflight: int | None,
    policy: str,
    overlap: bool,
) -> None:
    # overlapped, scoring is slow enough to be still running at some bubbles
    score = 0.8 if overlap else 0.15
    costs = Costs(gen=1.0, gen_tag=1.3, score=score, update=0.3, step=0.2, sync=0.1)
    b = 4 * gsize
    inner = BTS() if policy == "bts" else StaticTAG(2)
    rec = _Recorder(inner)
    model, log = _simulate_with_log(
        costs,
        b,
        g,
        t,
        rec,
        steps=3,
        gsize=gsize,
        w=w,
        ratio=0.5,
        schedule=schedule,
        inflight=inflight,
        overlap=overlap,
    )
    compared = _replay(model, log, costs, rec.states)
    assert compared >= 2
    # the comparison saw partial groups and running work, so equality says something
    if gsize > g:
        assert any(c > 1 for s in rec.states for _, _, c in s.partial_groups), (
            "no group with 2+ scored micro-batches at a bubble"
        )
    assert any(any(c.kind for c in s.generators) for s in rec.states)
    if overlap:
        assert all(len(s.scorers) == g for s in rec.states)
        if inflight is None:  # (back-pressure keeps the lanes' work short of the bubbles)
            assert any(any(c.kind == "score" for c in s.scorers) for s in rec.states)


def test_partial_groups_count_microbatches_not_samples() -> None:
    """Three generators, 6 samples per prompt: 3 micro-batches of 2 samples per group."""
    plan = SchedulePlan(
        microbatches=6,
        update_group=3,
        generators=3,
        trainers=1,
        admission=Admission(),
        layout=StepLayout(2, 6, 2),
    )
    book = Book(plan)
    mbs = [book.hand_out(0) for _ in range(3)]
    assert [m.samples for m in mbs] == [(0, 1), (2, 3), (4, 5)]
    for m in mbs[:2]:
        book.generated(m, worker_name(Pool.GENERATOR, m.mb), 0)
        assert not book.scored(m, [1.0, 2.0], {})
    state = book.sched_state(0, 0.0, Costs(gen=1.0, update=1.0))
    assert state.partial_groups == ((0, 0, 2),)  # two micro-batches, not four samples
    book.generated(mbs[2], "generator-2", 0)
    assert book.scored(mbs[2], [3.0, 4.0], {})
    assert book.group_rewards(0, 0, 6) == [1.0, 2.0, 1.0, 2.0, 3.0, 4.0]


def test_admission_fixed_and_eager_tcss_and_back_pressure() -> None:
    fixed = Admission(max_staleness=1, stale_cap=2, schedule="fixed", last_step=3)
    # step 1's first two micro-batches are made with version 0, the rest with version 1
    assert [fixed.version_for(1, m) for m in range(4)] == [0, 0, 1, 1]
    assert fixed.admits(1, 0, 0) and not fixed.admits(1, 0, 1)
    assert fixed.admits(1, 2, 1) and not fixed.admits(1, 2, 0)
    assert [fixed.version_for(0, m) for m in range(2)] == [0, 0]  # no version before 0
    assert not fixed.admits(4, 3, 4)  # past the last step
    assert fixed.quota_pending(1, (1, 1)) and not fixed.quota_pending(1, (1, 2))
    eager = Admission(max_staleness=1, stale_cap=2, schedule="eager")
    assert eager.admits(1, 0, 0) and eager.admits(1, 0, 1)  # stale or not, as it comes
    assert not eager.admits(1, 2, 0) and not eager.admits(2, 0, 0)  # cap, and W = 1
    bounded = Admission(max_inflight=3)
    assert bounded.admits(0, 0, 0, in_flight=2) and not bounded.admits(0, 0, 0, in_flight=3)
    with pytest.raises(ValueError, match="staleness schedule"):
        Admission(schedule="sometimes")
