"""TAG policies and the bubble-triggered search: BTS equals brute force on small instances."""

from __future__ import annotations

import random

import pytest

from digen.sched import (
    BTS,
    Costs,
    NoTAG,
    SchedState,
    StaticTAG,
    TagPolicy,
    WorkerClock,
    brute_force,
    search,
    simulate,
)
from digen.sched.admission import Admission, stale_cap
from digen.sched.plan import SchedulePlan

EXACT = 10**6
"""A budget the small instances never reach: these tests check the algorithm, not the budget."""


def q(rng: random.Random, lo: float, hi: float) -> float:
    """A random multiple of 1/4: sums stay exact, so ties are real ties."""
    return rng.randint(int(lo * 4), int(hi * 4)) / 4


def random_costs(rng: random.Random) -> Costs:
    return Costs(gen=q(rng, 0.5, 4), gen_tag=q(rng, 0.5, 6), score=q(rng, 0, 1.5),
                 update=q(rng, 0.25, 4), step=q(rng, 0, 1), sync=q(rng, 0, 1))  # fmt: skip


class Capture(TagPolicy):
    """Answers at random (seeded) and keeps every state it was shown."""

    name = "capture"

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.reset()

    def reset(self) -> None:
        self.rng = random.Random(self.seed)
        self.states: list[SchedState] = []

    def decide(self, state: SchedState, costs: Costs) -> bool:
        self.states.append(state)
        return self.rng.random() < 0.5


class Replay(TagPolicy):
    name = "replay"

    def __init__(self, plan: tuple[bool, ...]) -> None:
        self.plan = plan
        self.i = 0

    def reset(self) -> None:
        self.i = 0

    def decide(self, state: SchedState, costs: Costs) -> bool:
        self.i += 1
        return self.plan[self.i - 1] if self.i <= len(self.plan) else False


def counts(b: int, g: int = 1, t: int = 1, *, group: int = 1) -> SchedulePlan:
    """A plan of ``b`` micro-batches a step on ``g`` generators and ``t`` trainers, no TCSS."""
    return SchedulePlan(
        microbatches=b, update_group=group, generators=g, trainers=t, admission=Admission()
    )


def first_bubble(costs: Costs, b: int, g: int, t: int, **kw) -> SchedState | None:
    pol = Capture(0)
    simulate(costs, b, g, t, pol, **kw)
    return pol.states[0] if pol.states else None


def test_static_and_no_tag_rules() -> None:
    st = SchedState(now=0.0, trainer=0, plan=counts(4), step=0, next_mb=(0, 1), tags=2,
                    generators=(WorkerClock("generate", 1.0, 0, 0),),
                    trainers=(WorkerClock(),))  # fmt: skip
    c = Costs(gen=1, update=1)
    assert NoTAG().decide(st, c) is False
    assert StaticTAG(3).decide(st, c) is True
    assert StaticTAG(2).decide(st, c) is False
    with pytest.raises(ValueError, match="StaticTAG k must be an integer >= 0"):
        StaticTAG(-1)
    assert StaticTAG(2).name == "static-2" and NoTAG().name == "none" and BTS().name == "bts"


def test_hand_case_optimum() -> None:
    """B = 3 on one generator and one trainer (see test_simulator): TAG twice is best, 5.5."""
    c = Costs(gen=2, score=0.5, update=0.5)
    st = first_bubble(c, 3, 1, 1)
    bf = brute_force(st, c)
    assert bf.makespan == 5.5 and bf.plan == (True, True) and bf.exact
    res = search(st, c)
    assert (res.makespan, res.insert, res.plan, res.exact) == (5.5, True, (True, True), True)
    assert res.nodes <= BTS().node_limit and res.exact
    assert simulate(c, 3, 1, 1, BTS()).makespan == 5.5


@pytest.mark.parametrize("seed", range(6))
def test_bts_equals_brute_force_from_the_start(seed: int) -> None:
    """60 random instances per seed (360 in all): B <= 8, G and T in 1..3, GAP groups."""
    rng = random.Random(1000 + seed)
    checked = 0
    for _ in range(60):
        b, g, t = rng.randint(1, 8), rng.randint(1, 3), rng.randint(1, 3)
        c = random_costs(rng)
        group = rng.choice([1, 1, 2, 3])
        st = first_bubble(c, b, g, t, mbs_per_group=group)
        if st is None:
            continue
        bf = brute_force(st, c)
        res = search(st, c, node_limit=EXACT)
        assert res.exact
        assert res.makespan == bf.makespan, (b, g, t, group, c)
        # The predicted plan really achieves it, and so does BTS re-planning at every bubble.
        assert simulate(c, b, g, t, Replay(res.plan), mbs_per_group=group).makespan == bf.makespan
        bts = BTS(node_limit=EXACT)
        assert simulate(c, b, g, t, bts, mbs_per_group=group).makespan == bf.makespan
        assert bts.stats.inexact == 0
        checked += 1
    assert checked > 40


@pytest.mark.parametrize("seed", range(3))
def test_bts_equals_brute_force_with_scoring_overlapped(seed: int) -> None:
    """Scoring on its own lanes: first bubbles and bubbles two steps deep (TCSS on)."""
    rng = random.Random(3000 + seed)
    checked = 0
    for case in range(40):
        b, g, t = rng.randint(1, 7), rng.randint(1, 3), rng.randint(1, 3)
        c = random_costs(rng)
        w, ratio = rng.choice([(0, 0.0), (1, 0.5)])
        group = rng.choice([1, 2])
        pol = Capture(case)
        kw = dict(mbs_per_group=group, max_staleness=w, staleness_ratio=ratio, score_overlap=True)
        simulate(c, b, g, t, pol, steps=2, **kw)
        for st in rng.sample(pol.states, min(2, len(pol.states))):
            assert len(st.scorers) == g
            bf = brute_force(st, c)
            res = search(st, c, node_limit=EXACT)
            assert res.exact and res.makespan == bf.makespan, (case, st)
            checked += 1
    assert checked > 40


@pytest.mark.parametrize("seed", range(3))
def test_bts_equals_brute_force_mid_run_with_tcss(seed: int) -> None:
    """From bubbles deep in random two-step runs (TCSS on): the search sees stale work too."""
    rng = random.Random(2000 + seed)
    checked = 0
    for case in range(40):
        b, g, t = rng.randint(2, 7), rng.randint(1, 3), rng.randint(1, 3)
        c = random_costs(rng)
        w, ratio = rng.choice([(0, 0.0), (1, 0.5), (2, 1.0)])
        pol = Capture(case)
        simulate(c, b, g, t, pol, steps=2, max_staleness=w, staleness_ratio=ratio)
        for st in rng.sample(pol.states, min(2, len(pol.states))):
            assert st.admission.stale_cap == stale_cap(b, ratio) and st.admission.last_step == 1
            bf = brute_force(st, c)
            res = search(st, c, node_limit=EXACT)
            assert res.exact and res.makespan == bf.makespan, (case, st)
            checked += 1
    assert checked > 60


@pytest.mark.parametrize("seed", range(3))
def test_bts_never_worse_than_static_or_none(seed: int) -> None:
    rng = random.Random(3000 + seed)
    for _ in range(30):
        b, g, t = rng.randint(1, 10), rng.randint(1, 3), rng.randint(1, 3)
        c = random_costs(rng)
        group = rng.choice([1, 2])
        bts = simulate(c, b, g, t, BTS(), mbs_per_group=group).makespan
        for pol in (NoTAG(), *(StaticTAG(k) for k in range(1, 6))):
            assert bts <= simulate(c, b, g, t, pol, mbs_per_group=group).makespan, pol.name


def test_runtime_style_state() -> None:
    """A state the driver could fill: overdue tasks, a waiting trainer, queues, groups."""
    st = SchedState(
        now=10.0,
        trainer=1,
        plan=counts(6, 2, 3, group=2),
        step=3,
        generators=(
            WorkerClock("generate", 9.5, 3, 4),  # overdue: read as finishing now
            WorkerClock("score", 10.5, 3, 2),
        ),
        trainers=(WorkerClock("update", 11.0, 3, 0), WorkerClock(), WorkerClock(waiting=True)),
        next_mb=(3, 5),
        sq=((3, 3),),
        updated=1,
        partial_groups=((3, 1, 1),),  # group 1 = mbs 2, 3: mb2 is being scored... mb3 waits
    )
    assert st.pending == 1 and st.version == 3
    c = Costs(gen=2, gen_tag=2, score=0.5, update=1, step=0.5, sync=0.5)
    bf = brute_force(st, c)
    res = search(st, c)
    assert res.exact and res.makespan == bf.makespan and res.makespan > st.now
    assert BTS().decide(st, c) == res.insert


def test_budget_makes_the_search_anytime() -> None:
    c = Costs(gen=1, score=0.05, update=0.1, step=0.1, sync=0.1)
    st = first_bubble(c, 64, 4, 4)
    small = search(st, c, node_limit=1)
    assert not small.exact
    none = simulate(c, 64, 4, 4, NoTAG()).makespan
    assert small.makespan < none  # the first complete dive is always kept
    assert simulate(c, 64, 4, 4, Replay(small.plan)).makespan == small.makespan
    more = search(st, c, node_limit=300, incumbent=small.plan[1:])
    assert more.makespan <= small.makespan
    timed = search(st, c, node_limit=10**9, time_limit_ms=1.0)
    assert not timed.exact and timed.makespan < none
    with pytest.raises(ValueError, match="node_limit"):
        BTS(node_limit=0)


def test_bts_replanning_matches_its_first_prediction() -> None:
    """With fixed costs, re-planning at each bubble keeps (or beats) the first plan."""
    c = Costs(gen=1, score=0.1, update=0.3, step=0.2, sync=0.1)
    st = first_bubble(c, 24, 3, 3)
    predicted = search(st, c).makespan
    pol = BTS()
    res = simulate(c, 24, 3, 3, pol)
    assert res.makespan <= predicted
    assert pol.stats.decisions == res.bubble_count == len(pol.stats.ms)
    assert pol.last is not None


def test_brute_force_guard() -> None:
    c = Costs(gen=1, score=0.05, update=0.1)
    st = first_bubble(c, 16, 2, 2)
    with pytest.raises(ValueError, match="more than max_leaves=8"):
        brute_force(st, c, max_leaves=8)


def test_nothing_to_decide() -> None:
    """No micro-batch left to hand out: the search just reports when the step ends."""
    st = SchedState(now=0.0, trainer=0, plan=counts(1), step=0, next_mb=(1, 0),
                    generators=(WorkerClock("generate", 1.0, 0, 0),),
                    trainers=(WorkerClock(),))  # fmt: skip
    c = Costs(gen=1, score=1, update=1)
    assert not st.can_start_next()
    res = search(st, c)
    assert (res.makespan, res.insert, res.plan) == (3.0, False, ())
    assert brute_force(st, c).makespan == 3.0


def test_state_checks() -> None:
    kw = dict(now=0.0, plan=counts(2), step=0, next_mb=(0, 0),
              generators=(WorkerClock(),), trainers=(WorkerClock(),))  # fmt: skip
    with pytest.raises(ValueError, match="trainer 1 is not an index of the 1 trainers"):
        SchedState(trainer=1, **kw)
    with pytest.raises(ValueError, match="at least one generator"):
        SchedState(trainer=0, **{**kw, "generators": ()})
    with pytest.raises(ValueError, match="not one of"):
        search(SchedState(trainer=0, **{**kw, "generators": (WorkerClock("train", 1.0),)}),
               Costs(gen=1, update=1))  # fmt: skip
