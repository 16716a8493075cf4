"""The scheduler the driver and the simulator run, against the TAG search's model (the engine).

The engine logs every transition; replaying the log into a ``Scheduler`` (as the driver
reports transitions) must give the same decision at every start (which micro-batch a free
generator makes or scores, what a lane scores, which update a trainer takes, whether an
empty UQ is a bubble) and, at every bubble, exactly the ``SchedState`` the engine gave the
TAG policy. The simulator (a clock around the scheduler) and the engine must give the same
schedule, event for event, over a seeded grid of random runs. Partial GAP groups with 3 and
4 micro-batches per group are in the grid: the scheduler counts scored *micro-batches* per
group, which is what the model expects.
"""

from __future__ import annotations

import random

import pytest

from digen.sched import BTS, Costs, NoTAG, StaticTAG, TagPolicy
from digen.sched._engine import GEN, SCORE, TAG, UPDATE, Engine, Model
from digen.sched.admission import Admission, stale_cap
from digen.sched.names import Pool, worker_name
from digen.sched.plan import SchedulePlan, StepLayout
from digen.sched.scheduler import Scheduler
from digen.sched.simulator import simulate_plan
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
    costs, b, g, t, policy, *, steps, gsize, w, ratio, schedule, inflight, overlap=False,
    grouped=False,
):  # fmt: skip
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
        group_updates=grouped,
    )
    model = Model(plan, costs)
    eng = Engine(model, horizon=steps, log=True)
    while (j := eng.run()) >= 0:
        eng.decide(j, policy.decide(eng.to_state(j), costs))
    return model, eng.log


def _replay(model: Model, log: list[tuple], costs: Costs, seen: list[SchedState]) -> int:
    """Feed the engine's history to a Scheduler, asking it every decision the engine took
    (what each free worker ran, whether a trainer's empty UQ was a bubble) and comparing the
    two; at every bubble, compare the state the policy saw. Returns bubbles compared."""
    names = model.names
    book = Scheduler(model.plan)
    compared = 0
    now = 0.0
    taken: tuple[int, int] | None = None  # the engine's last hand-out, not yet started
    tagged = None  # the micro-batch the scheduler handed a TAG, not yet started
    updating: dict[int, list[int]] = {}  # trainer lane -> the micro-batches of its update
    for entry in log:
        op = entry[0]
        if op == "take":
            _, s, m, version = entry
            taken = (s, m)
            assert tagged is None or (tagged.step, tagged.mb) == taken
        elif op == "start":
            _, i, kind, s, m, now = entry
            if kind == GEN:  # the scheduler hands the same micro-batch to the same generator
                work = book.generator_work(i)
                assert work is not None and (work.mb.step, work.mb.mb) == (s, m) == taken
            elif kind == TAG:
                assert tagged is not None and (tagged.step, tagged.mb) == (s, m)
                tagged = None
            elif kind == SCORE and i >= model.workers:  # a lane: SQ first, then its own
                work = book.lane_work(i - model.workers)
                assert work is not None and (work.mb.step, work.mb.mb) == (s, m)
            elif kind == SCORE and (s, m) in book.sq:  # a free generator scores SQ's head
                work = book.generator_work(i)
                assert work is not None and work.kind == "score"
                assert (work.mb.step, work.mb.mb) == (s, m)
            elif kind == UPDATE:
                updating[i] = book.take_updates(s)
                assert updating[i][0] == m  # UQ's head (and its group's others, grouped)
            if kind in (GEN, TAG, SCORE, UPDATE):
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
                for one in updating.pop(i):
                    book.trained(s, one, None)
        elif op == "wait":
            assert not book.at_bubble(entry[1], book.version)  # and it now waits
            assert entry[1] in book.waiting
        elif op == "bubble":
            _, j, insert = entry
            assert book.at_bubble(j, book.version)
            assert book.sched_state(j, now, costs) == seen[compared]
            compared += 1
            tagged = book.answer(j, insert)
            assert (tagged is not None) == insert
        elif op == "version":
            book.advance(entry[1])
            book.gen_version = [entry[1]] * model.generators
    assert compared == len(seen)
    return compared


@pytest.mark.parametrize(
    ("g", "t", "gsize", "w", "schedule", "inflight", "grouped"),
    [
        (1, 1, 1, 0, "fixed", None, False),
        (2, 1, 2, 0, "fixed", None, False),
        (3, 1, 3, 0, "fixed", None, False),  # 3 micro-batches per GAP group
        (2, 1, 3, 0, "fixed", None, False),  # 3 per group on 2 generators: groups stay partial
        (3, 2, 4, 0, "fixed", None, False),  # 4 per group, two trainers
        (3, 2, 3, 1, "fixed", None, False),  # TCSS, fixed schedule
        (3, 1, 4, 1, "eager", None, False),  # TCSS, eager schedule
        (2, 2, 2, 0, "fixed", 3, False),  # C_gen back-pressure
        (3, 2, 4, 0, "fixed", None, True),  # a group's 4 micro-batches, one update
        (2, 2, 3, 0, "fixed", None, True),  # grouped, two trainers
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
    grouped: bool,
    policy: str,
    overlap: bool,
) -> None:
    # overlapped, scoring is slow enough to be still running at some bubbles
    score = 0.8 if overlap else 0.15
    fixed = 0.2 if grouped else 0.0  # a grouped update: 0.2 s once, 0.1 s a micro-batch
    costs = Costs(
        gen=1.0, gen_tag=1.3, score=score, update=0.3, step=0.2, sync=0.1, update_fixed=fixed
    )
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
        grouped=grouped,
    )
    compared = _replay(model, log, costs, rec.states)
    assert compared >= 2
    # the comparison saw partial groups and running work, so equality says something
    if grouped:  # updates took whole groups: fewer of them than micro-batches
        assert 0 < sum(e[0] == "start" and e[2] == UPDATE for e in log) < b * 3
    elif gsize > g:
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
    book = Scheduler(plan)
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


@pytest.mark.parametrize("grouped", [False, True])
def test_grouped_updates_take_a_groups_queued_micro_batches_of_one_version(
    grouped: bool,
) -> None:
    """Two prompts of 4 one-sample micro-batches; prompt 0's made by versions 0, 0, 1, 1
    (as TCSS may make them). Grouped, a trainer takes prompt 0's version-0 pair, then its
    version-1 pair, then prompt 1's four; else one at a time, in UQ order."""
    plan = SchedulePlan(
        microbatches=8,
        update_group=4,
        generators=1,
        trainers=1,
        admission=Admission(),
        layout=StepLayout(2, 4, 1),
        group_updates=grouped,
    )
    book = Scheduler(plan)
    for mb, version in zip(plan.microbatches_of(0), [0, 0, 1, 1, 0, 0, 0, 0], strict=True):
        book.generated(mb, "generator-0", version)
        book.queued(0, mb.mb)
    taken = []
    while got := book.take_updates(0):
        taken.append(got)
    if grouped:
        assert taken == [[0, 1], [2, 3], [4, 5, 6, 7]]
    else:
        assert taken == [[m] for m in range(8)]
    # a mini-batch's ids bound what is taken
    again = Scheduler(plan)
    for mb in plan.microbatches_of(0):
        again.generated(mb, "generator-0", 0)
        again.queued(0, mb.mb)
    assert again.take_updates(0, range(4, 8)) == ([4, 5, 6, 7] if grouped else [4])


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


def _engine_schedule(plan: SchedulePlan, costs: Costs, policy: TagPolicy) -> tuple:
    """What the engine alone makes of ``plan``: the simulator's result fields, its way."""
    policy.reset()
    eng = Engine(Model(plan, costs), horizon=plan.admission.last_step + 1, record=True)
    decisions = []
    while (j := eng.run()) >= 0:
        d = bool(policy.decide(eng.to_state(j), costs))
        decisions.append(d)
        eng.decide(j, d)
    order = {name: i for i, name in enumerate(eng.model.names)}
    events = sorted(eng.events, key=lambda e: (e.t0, order[e.worker], e.t1))
    return eng.now, events, decisions, eng.step_ends, eng.tag_total, eng.bubble_total


def test_the_simulator_and_the_search_model_make_the_same_schedule() -> None:
    """200 seeded random runs (pools, groups, TCSS fixed and eager, C_gen, scoring lanes,
    grouped updates, costs with ties, plans with and without a sample layout), each under
    three policies: the simulator, a clock around the scheduler, gives the engine's schedule
    event for event, with the same answers."""
    rng = random.Random(7)
    runs = 0
    for _ in range(200):
        b = rng.randint(1, 12)
        gsize = min(rng.choice([1, 2, 3, 4, b]), b)
        w, ratio = rng.choice([0, 0, 1, 2]), rng.choice([0.0, 0.25, 0.5])
        schedule, steps = rng.choice(["fixed", "eager"]), rng.randint(1, 3)
        cap = stale_cap(b, ratio)
        need = max(gsize, cap if w and schedule == "fixed" else 0)
        plan = SchedulePlan(
            microbatches=b,
            update_group=gsize,
            generators=rng.randint(1, 4),
            trainers=rng.randint(1, 3),
            admission=Admission(
                max_staleness=w,
                stale_cap=cap,
                schedule=schedule,
                max_inflight=rng.choice([None, need + rng.randint(0, 3)]),
                last_step=steps - 1,
            ),
            score_overlap=rng.random() < 0.5,
            # a run's plan says which samples each micro-batch holds; a planner's counts only
            layout=StepLayout(b // gsize, gsize, 1)
            if b % gsize == 0 and rng.random() < 0.5
            else None,
            # grouped updates, on-policy (under TCSS the scheduler also splits a group by
            # the version that made it, which the engine does not model)
            group_updates=w == 0 and rng.random() < 0.5,
        )
        update = rng.choice([0.5, 1.0, 2.0])
        costs = Costs(
            gen=rng.choice([1.0, 2.0, 3.5]),
            gen_tag=rng.choice([1.0, 2.5, 4.0]),
            score=rng.choice([0.0, 0.5, 1.0]),
            update=update,
            step=rng.choice([0.0, 0.3]),
            sync=rng.choice([0.0, 0.2]),
            update_fixed=rng.choice([0.0, update / 2]),
        )
        for make in (NoTAG, lambda: StaticTAG(2), BTS):
            sim = simulate_plan(plan, costs, policy=make())
            got = (sim.makespan, sim.events, sim.decisions, sim.step_ends)
            want = _engine_schedule(plan, costs, make())
            assert got + (sim.tag_count, sim.bubble_count) == want, (plan, costs)
            runs += 1
    assert runs == 600
