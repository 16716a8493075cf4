"""TCSS: bounded staleness, one version per trajectory, and W = 0 is the synchronous schedule."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from digen.sched import BTS, Costs, NoTAG, StaticTAG, simulate, stale_cap


def q(rng: random.Random, lo: float, hi: float) -> float:
    return rng.randint(int(lo * 4), int(hi * 4)) / 4


def random_costs(rng: random.Random) -> Costs:
    return Costs(gen=q(rng, 0.5, 4), gen_tag=q(rng, 0.5, 6), score=q(rng, 0, 1.5),
                 update=q(rng, 0.25, 4), step=q(rng, 0, 1), sync=q(rng, 0, 1))  # fmt: skip


def test_hand_case() -> None:
    """G = T = 1, B = 2, two steps; gen 1, score 0.5, update 2, step 0.5, sync 0.5.

    Synchronous: step 0 ends at 6.5 (updates [1.5,3.5] and [3.5,5.5], step, sync) and step 1
    repeats it: 13. With W = 1 and ratio 0.5 (one stale micro-batch per step) the idle
    generator makes step 1's mb0 on version 0 at [3,4] and scores it [4,4.5]; step 1 then
    starts with an update at 6.5 and ends at 11.5.
    """
    c = Costs(gen=1, score=0.5, update=2, step=0.5, sync=0.5)
    sync = simulate(c, 2, 1, 1, steps=2)
    assert sync.makespan == 13.0 and sync.step_ends == [6.5, 13.0]
    res = simulate(c, 2, 1, 1, steps=2, max_staleness=1, staleness_ratio=0.5)
    assert res.makespan == 11.5 and res.step_ends == [6.5, 11.5]
    assert res.stale == {0: 0, 1: 1}
    step1 = [(e.kind, e.mb, e.version, e.t0, e.t1) for e in res.events if e.step == 1]
    assert step1 == [
        ("generate", 0, 0, 3.0, 4.0),
        ("score", 0, 0, 4.0, 4.5),
        ("generate", 1, 1, 6.5, 7.5),
        ("update", 0, 1, 6.5, 8.5),
        ("score", 1, 1, 7.5, 8.0),
        ("update", 1, 1, 8.5, 10.5),
        ("step", -1, 1, 10.5, 11.0),
        ("sync", -1, 2, 11.0, 11.5),
        ("sync", -1, 2, 11.0, 11.5),
    ]


def test_sync_waits_for_a_running_generation() -> None:
    """Weights change only between micro-batches: sync starts when the stale generation ends."""
    c = Costs(gen=3, score=0.5, update=0.5, step=0.5, sync=0.5)
    res = simulate(c, 2, 2, 1, steps=2, max_staleness=1, staleness_ratio=1.0)
    step0_end = res.step_ends[0]
    syncs0 = [e for e in res.events if e.kind == "sync" and e.step == 0]
    stale = [e for e in res.events if e.kind == "generate" and e.step == 1 and e.version == 0]
    assert stale, "a generator should start step 1 early"
    assert min(e.t0 for e in syncs0) >= max(e.t1 for e in stale)
    assert step0_end == syncs0[0].t1


@pytest.mark.parametrize("seed", range(3))
def test_zero_staleness_is_the_synchronous_schedule(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(15):
        c = random_costs(rng)
        b, g, t, steps = rng.randint(1, 10), rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 3)
        pol = rng.choice([NoTAG, lambda: StaticTAG(2), BTS])
        base = simulate(c, b, g, t, pol(), steps=steps)
        assert base.stale == dict.fromkeys(range(steps), 0)
        for w, ratio in ((0, 0.5), (0, 1.0), (3, 0.0)):
            other = simulate(c, b, g, t, pol(), steps=steps, max_staleness=w, staleness_ratio=ratio)
            assert other.events == base.events
            assert other.makespan == base.makespan


@pytest.mark.parametrize("seed", range(4))
def test_long_runs_keep_the_tcss_invariants(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(8):
        c = random_costs(rng)
        b, g, t = rng.randint(2, 16), rng.randint(1, 4), rng.randint(1, 4)
        steps = rng.randint(10, 20)
        w = rng.choice([1, 2])
        ratio = rng.choice([0.25, 0.5, 1.0])
        pol = rng.choice([NoTAG(), StaticTAG(rng.randint(1, 3)), BTS()])
        res = simulate(c, b, g, t, pol, steps=steps, max_staleness=w, staleness_ratio=ratio,
                       mbs_per_group=rng.choice([1, 2]))  # fmt: skip
        cap = stale_cap(b, ratio)
        gens = [e for e in res.events if e.kind in ("generate", "tag")]
        # Every micro-batch of every step generated once and updated once.
        every = Counter((s, m) for s in range(steps) for m in range(b))
        assert Counter((e.step, e.mb) for e in gens) == every
        assert Counter((e.step, e.mb) for e in res.events if e.kind == "update") == every
        # Version lag within W; stale micro-batches per step within the ratio.
        assert all(0 <= e.step - e.version <= w for e in gens)
        stale = Counter(e.step for e in gens if e.version < e.step)
        assert all(n <= cap for n in stale.values())
        assert res.stale == {s: stale.get(s, 0) for s in range(steps)}
        # Updates use the step's own version; scores report the generating version.
        made = {(e.step, e.mb): e.version for e in gens}
        for e in res.events:
            if e.kind == "update":
                assert e.version == e.step
            if e.kind == "score":
                assert e.version == made[(e.step, e.mb)]
        # One version per trajectory: no generation spans a weight change (a sync's end).
        for end in res.step_ends:
            assert not any(e.t0 < end < e.t1 for e in gens)
        # Syncs happen in order, every worker takes part, and the version goes up by one.
        for s in range(steps):
            syncs = [e for e in res.events if e.kind == "sync" and e.step == s]
            assert len(syncs) == g + t and {e.version for e in syncs} == {s + 1}
            assert all(e.t1 == res.step_ends[s] for e in syncs)


def test_tcss_fills_the_step_boundary() -> None:
    """Generation-bound pools idle at every step boundary; TCSS fills it (never slower here)."""
    c = Costs(gen=1, score=0.1, update=0.6, step=0.3, sync=0.2)
    base = simulate(c, 16, 2, 2, StaticTAG(2), steps=4).makespan
    tcss = simulate(c, 16, 2, 2, StaticTAG(2), steps=4, max_staleness=1, staleness_ratio=0.25)
    assert tcss.makespan < base
    assert all(n <= 4 for n in tcss.stale.values()) and sum(tcss.stale.values()) > 0
