"""The simulator against timelines worked out by hand, plus invariants on random runs."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from digen.sched import Costs, NoTAG, StaticTAG, TagPolicy, ideal_bound, simulate
from digen.sched.state import SchedState
from digen.sched.trace import Trace, TraceEvent


def timeline(events: list[TraceEvent]) -> list[tuple]:
    return [(e.kind, e.worker, e.step, e.mb, e.version, e.t0, e.t1) for e in events]


HAND = Costs(gen=2, score=1, update=3, step=0.5, sync=0.5)


def test_one_generator_one_trainer_no_tag() -> None:
    """G = T = 1, B = 2; the trainer waits at its first bubble.

    t=0 generate mb0 [0,2]; trainer bubble -> skip. mb0 scored [2,3] (score first), then the
    generator makes mb1 [3,5] while the trainer updates mb0 [3,6]; mb1 scored [5,6] and
    updated [6,9]; step [9,9.5]; sync on both workers [9.5,10].
    """
    res = simulate(HAND, 2, 1, 1, NoTAG())
    assert res.makespan == 10.0
    assert timeline(res.events) == [
        ("generate", "generator-0", 0, 0, 0, 0.0, 2.0),
        ("score", "generator-0", 0, 0, 0, 2.0, 3.0),
        ("generate", "generator-0", 0, 1, 0, 3.0, 5.0),
        ("update", "trainer-0", 0, 0, 0, 3.0, 6.0),
        ("score", "generator-0", 0, 1, 0, 5.0, 6.0),
        ("update", "trainer-0", 0, 1, 0, 6.0, 9.0),
        ("step", "trainer-0", 0, -1, 0, 9.0, 9.5),
        ("sync", "generator-0", 0, -1, 1, 9.5, 10.0),
        ("sync", "trainer-0", 0, -1, 1, 9.5, 10.0),
    ]
    assert (res.tag_count, res.bubble_count, res.decisions) == (0, 1, [False])
    assert res.step_ends == [10.0] and res.step_times == [10.0]


def test_scoring_overlapped_frees_the_generator() -> None:
    """G = T = 1, B = 2, scoring as slow as generation (2 s).

    Scored by the generator: gen mb0 [0,2], score [2,4], gen mb1 [4,6] (update mb0 [4,7]),
    score mb1 [6,8], update [8,11], step [11,11.5], sync [11.5,12]. On a scoring lane the
    generator makes mb1 [2,4] while scorer-0 scores mb0 [2,4]; mb1 is scored [4,6] and
    updated after mb0 [7,10]: the step ends a second earlier, and the lane takes no sync.
    """
    costs = Costs(gen=2, score=2, update=3, step=0.5, sync=0.5)
    assert simulate(costs, 2, 1, 1, NoTAG()).makespan == 12.0
    res = simulate(costs, 2, 1, 1, NoTAG(), score_overlap=True)
    assert res.makespan == 11.0
    assert timeline(res.events) == [
        ("generate", "generator-0", 0, 0, 0, 0.0, 2.0),
        ("generate", "generator-0", 0, 1, 0, 2.0, 4.0),
        ("score", "scorer-0", 0, 0, 0, 2.0, 4.0),
        ("update", "trainer-0", 0, 0, 0, 4.0, 7.0),
        ("score", "scorer-0", 0, 1, 0, 4.0, 6.0),
        ("update", "trainer-0", 0, 1, 0, 7.0, 10.0),
        ("step", "trainer-0", 0, -1, 0, 10.0, 10.5),
        ("sync", "generator-0", 0, -1, 1, 10.5, 11.0),
        ("sync", "trainer-0", 0, -1, 1, 10.5, 11.0),
    ]
    # TAG-made micro-batches go to a lane too, ahead of the generator's own: the trainer
    # makes mb1 while the generator makes mb0, both done at 2 s; the lane scores mb1 first
    tagged = simulate(costs, 2, 1, 1, StaticTAG(1), score_overlap=True)
    assert [
        (e.kind, e.worker, e.mb, e.t0) for e in tagged.events if e.kind in ("tag", "score")
    ] == [
        ("tag", "trainer-0", 1, 0.0),
        ("score", "scorer-0", 1, 2.0),
        ("score", "scorer-0", 0, 4.0),
    ]


def test_one_generator_one_trainer_one_tag() -> None:
    """Same case with one TAG: the trainer makes mb1 [0,2]; it is scored after mb0."""
    res = simulate(HAND, 2, 1, 1, StaticTAG(1))
    assert res.makespan == 10.0
    assert timeline(res.events) == [
        ("generate", "generator-0", 0, 0, 0, 0.0, 2.0),
        ("tag", "trainer-0", 0, 1, 0, 0.0, 2.0),
        ("score", "generator-0", 0, 0, 0, 2.0, 3.0),
        ("score", "generator-0", 0, 1, 0, 3.0, 4.0),
        ("update", "trainer-0", 0, 0, 0, 3.0, 6.0),
        ("update", "trainer-0", 0, 1, 0, 6.0, 9.0),
        ("step", "trainer-0", 0, -1, 0, 9.0, 9.5),
        ("sync", "generator-0", 0, -1, 1, 9.5, 10.0),
        ("sync", "trainer-0", 0, -1, 1, 9.5, 10.0),
    ]
    assert res.tag_count == 1


@pytest.mark.parametrize(
    ("k", "makespan"),
    [
        (0, 8.0),  # the generator makes all three: 3 x (2 + 0.5), then the last update 0.5
        (1, 6.0),
        (2, 5.5),  # TAG mb1 [0,2] and mb2 [2,4]; updates 4..5.5
        (3, 5.5),  # no third bubble has anything left to generate
    ],
)
def test_tag_shortens_a_generation_bound_step(k: int, makespan: float) -> None:
    res = simulate(Costs(gen=2, score=0.5, update=0.5), 3, 1, 1, StaticTAG(k))
    assert res.makespan == makespan
    assert res.tag_count == min(k, 2)


def test_gap_groups_enter_uq_together() -> None:
    """One generator, gen = score = update = 1, B = 2.

    Separate micro-batches: mb0 ready at 2, updated [2,3]; mb1 ready at 4, updated [4,5].
    One group of two: both ready at 4, updated [4,5] and [5,6].
    """
    c = Costs(gen=1, score=1, update=1)
    assert simulate(c, 2, 1, 1).makespan == 5.0
    res = simulate(c, 2, 1, 1, mbs_per_group=2)
    assert res.makespan == 6.0
    ups = [(e.mb, e.t0) for e in res.events if e.kind == "update"]
    assert ups == [(0, 4.0), (1, 5.0)]
    # A last, smaller group: B = 3 in groups of 2 -> {0, 1}, {2}; mb2 is trained alone.
    res = simulate(c, 3, 1, 1, mbs_per_group=2)
    ups = [(e.mb, e.t0) for e in res.events if e.kind == "update"]
    assert ups == [(0, 4.0), (1, 5.0), (2, 6.0)]


def test_same_instant_ties() -> None:
    """Generations ending together enter SQ in mb order; waiting trainers are served first.

    G = 1, T = 2, B = 2, gen = 1, gen_tag = 2, score = 1, update = 2, StaticTAG(1):
    t=0 generator-0 makes mb0, trainer-0 TAGs mb1, trainer-1 skips (waits). At t=2 mb0 is
    scored and trainer-0's TAG ends together: trainer-1, waiting longer, takes mb0.
    """
    res = simulate(Costs(gen=1, gen_tag=2, score=1, update=2), 2, 1, 2, StaticTAG(1))
    got = [(e.kind, e.worker, e.mb, e.t0, e.t1) for e in res.events if e.kind != "sync"]
    assert got == [
        ("generate", "generator-0", 0, 0.0, 1.0),
        ("tag", "trainer-0", 1, 0.0, 2.0),
        ("score", "generator-0", 0, 1.0, 2.0),
        ("score", "generator-0", 1, 2.0, 3.0),
        ("update", "trainer-1", 0, 2.0, 4.0),
        ("update", "trainer-0", 1, 3.0, 5.0),
        ("step", "trainer-0", -1, 5.0, 5.0),
        ("step", "trainer-1", -1, 5.0, 5.0),
    ]
    # Two generators finishing together: the lower micro-batch is scored by generator-0.
    res = simulate(Costs(gen=1, score=1, update=1), 2, 2, 1)
    scores = [(e.worker, e.mb) for e in res.events if e.kind == "score"]
    assert scores == [("generator-0", 0), ("generator-1", 1)]


class Recorder(TagPolicy):
    """Answers with a fixed sequence and keeps the states it was shown."""

    name = "recorder"

    def __init__(self, answers: list[bool]) -> None:
        self.answers = answers
        self.states: list[SchedState] = []

    def reset(self) -> None:
        self.states = []

    def decide(self, state: SchedState, costs: Costs) -> bool:
        self.states.append(state)
        return (
            self.answers[len(self.states) - 1] if len(self.states) <= len(self.answers) else False
        )


def test_policy_sees_the_runtime_state() -> None:
    pol = Recorder([False, True])
    simulate(Costs(gen=2, score=0.5, update=0.5), 3, 1, 1, pol)
    first, second = pol.states
    assert first.now == 0.0 and first.trainer == 0 and first.step == first.version == 0
    assert first.generators[0].kind == "generate" and first.generators[0].busy_until == 2.0
    assert first.trainers[0].kind is None and not first.trainers[0].waiting
    assert first.next_mb == (0, 1) and first.pending == 2 and first.can_start_next()
    assert (first.uq, first.updated, first.sq, first.tags, first.bubbles) == (0, 0, (), 0, 0)
    # Second bubble: t=3 after mb0's update; mb1 is being generated.
    assert second.now == 3.0 and second.updated == 1 and second.bubbles == 1
    assert second.generators[0].kind == "generate" and second.generators[0].mb == 1
    assert second.pending == 1 and second.in_flight == (("generate", 4.5),)


def test_events_are_runtime_events_and_trace_stats_work() -> None:
    res = simulate(Costs(gen=1, gen_tag=1.5, score=0.2, update=0.4, step=0.1, sync=0.1), 8, 2, 2,
                   StaticTAG(2), steps=2)  # fmt: skip
    assert all(isinstance(e, TraceEvent) for e in res.events)
    assert [e.t0 for e in res.events] == sorted(e.t0 for e in res.events)
    tr = res.trace
    assert tr.workers() == ["generator-0", "generator-1", "trainer-0", "trainer-1"]
    assert tr.steps() == [0, 1]
    st = tr.step_stats(1)
    assert st.wall_s == pytest.approx(res.step_times[1])
    assert 0 < st.utilisation <= 1
    assert Trace(res.events).step_boundaries()[0] <= res.step_ends[0]


def test_ideal_bound() -> None:
    c = Costs(gen=1, gen_tag=2, score=0.5, update=0.5, step=1, sync=1)
    # work = 4 * (1 + 0.5 + 0.5) + 1 * 1 + 2 * 1 = 11 over 2 workers = 5.5; path = 4
    assert ideal_bound(c, 4, 1, 1) == 5.5
    assert ideal_bound(c, 1, 1, 1) == 4.0
    # scoring on lanes: work = 4 * (1 + 0.5) + 1 + 2 = 9 over 2 = 4.5; the lane's 4 scores
    # then an update, step and sync = 2 + 2.5 = 4.5; path = 4
    assert ideal_bound(c, 4, 1, 1, score_overlap=True) == 4.5
    slow = Costs(gen=1, gen_tag=2, score=2, update=0.5, step=1, sync=1)
    assert ideal_bound(slow, 4, 1, 1, score_overlap=True) == 8 + 2.5  # the lane is the bound
    # and no simulated schedule beats it
    assert simulate(slow, 4, 1, 1, NoTAG(), score_overlap=True).makespan >= 10.5
    assert simulate(c, 4, 1, 1, StaticTAG(2), score_overlap=True).makespan >= 4.5


def random_costs(rng: random.Random) -> Costs:
    q = lambda lo, hi: rng.randint(int(lo * 4), int(hi * 4)) / 4  # noqa: E731 - exact floats
    return Costs(gen=q(0.5, 4), gen_tag=q(0.5, 6), score=q(0, 1.5), update=q(0.25, 4),
                 step=q(0, 1), sync=q(0, 1))  # fmt: skip


def check_invariants(res, b: int, steps: int, g: int, t: int, overlap: bool = False) -> None:
    """Every micro-batch made, scored and updated once; no worker does two things at once."""
    gens = Counter((e.step, e.mb) for e in res.events if e.kind in ("generate", "tag"))
    scores = Counter((e.step, e.mb) for e in res.events if e.kind == "score")
    ups = Counter((e.step, e.mb) for e in res.events if e.kind == "update")
    every = Counter((s, m) for s in range(steps) for m in range(b))
    assert gens == scores == ups == every
    assert all(e.worker.startswith("trainer") for e in res.events if e.kind in ("tag", "update"))
    scorer = "scorer" if overlap else "generator"
    assert all(e.worker.startswith(scorer) for e in res.events if e.kind == "score")
    by_worker: dict[str, list[TraceEvent]] = {}
    for e in res.events:
        by_worker.setdefault(e.worker, []).append(e)
    assert len(by_worker) == g + t + (len([w for w in by_worker if w.startswith("scorer")]))
    assert all(int(w.split("-")[1]) < g for w in by_worker if w.startswith("scorer"))
    for evs in by_worker.values():
        for a, nxt in zip(evs, evs[1:]):
            assert nxt.t0 >= a.t1
    first = {}
    for e in res.events:
        first.setdefault((e.kind, e.step, e.mb), e)
    for e in res.events:
        if e.kind == "score":
            assert e.t0 >= first["generate" if ("generate", e.step, e.mb) in first else "tag",
                                 e.step, e.mb].t1  # fmt: skip
        if e.kind == "update":
            assert e.t0 >= first[("score", e.step, e.mb)].t1
            assert e.version == e.step
    for s in range(steps):
        last_update = max(e.t1 for e in res.events if e.kind == "update" and e.step == s)
        step_evs = [e for e in res.events if e.kind == "step" and e.step == s]
        sync_evs = [e for e in res.events if e.kind == "sync" and e.step == s]
        assert len(step_evs) == t and len(sync_evs) == g + t
        assert min(e.t0 for e in step_evs) >= last_update
        assert min(e.t0 for e in sync_evs) >= max(e.t1 for e in step_evs)
        assert res.step_ends[s] == max(e.t1 for e in sync_evs)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_random_runs_keep_the_invariants(seed: int, overlap: bool) -> None:
    rng = random.Random(seed)
    for _ in range(25):
        b, g, t = rng.randint(1, 12), rng.randint(1, 3), rng.randint(1, 3)
        steps = rng.randint(1, 3)
        pol = rng.choice([NoTAG(), StaticTAG(rng.randint(1, 4)), Recorder([True] * 50)])
        res = simulate(random_costs(rng), b, g, t, pol, steps=steps,
                       mbs_per_group=rng.randint(1, 3), score_overlap=overlap)  # fmt: skip
        check_invariants(res, b, steps, g, t, overlap)


def test_bad_arguments() -> None:
    c = Costs(gen=1, update=1)
    with pytest.raises(ValueError, match="microbatches must be an integer >= 1, got 0"):
        simulate(c, 0, 1, 1)
    with pytest.raises(ValueError, match="generators must be an integer >= 1"):
        simulate(c, 4, 0, 1)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        simulate(c, 4, 1, 1, steps=0)
    with pytest.raises(ValueError, match="staleness_ratio must be in"):
        simulate(c, 4, 1, 1, staleness_ratio=1.5)
    with pytest.raises(ValueError, match="max_staleness must be an integer >= 0"):
        simulate(c, 4, 1, 1, max_staleness=-1)
