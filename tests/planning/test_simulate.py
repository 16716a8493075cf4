"""``digen simulate`` logic: cost loading, policy comparison, split recommendation, plot."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from digen.planning.simulate import (
    compare_policies,
    format_table,
    held_work_s,
    load_costs,
    plot_simulation,
    with_losses,
)
from digen.sched import BTS, Costs, NoTAG, OnlineProfiler, StaticTAG, simulate
from digen.sched.trace import TraceEvent

C = Costs(gen=1, score=0.1, update=0.4, step=0.2, sync=0.1)


def test_load_costs_from_every_source(tmp_path) -> None:
    assert load_costs(C) is C
    assert load_costs({"gen": 1, "update": 2}) == Costs(gen=1, update=2)
    plain = tmp_path / "costs.json"
    plain.write_text(json.dumps(C.to_dict()))
    assert load_costs(plain) == C
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"costs": {"gen": 3, "update": 1}}))
    assert load_costs(str(wrapped)) == Costs(gen=3, update=1)
    prof = OnlineProfiler(alpha=1.0)
    prof.observe(TraceEvent("generate", "generator-0", 0, 0, 0, 0.0, 2.0))
    prof.observe(TraceEvent("update", "trainer-0", 0, 0, 0, 0.0, 0.5))
    prof.observe(TraceEvent("sync", "driver", 0, -1, 1, 0.0, 0.25))
    path = prof.save(tmp_path / "profile.json")
    assert load_costs(path) == Costs(gen=2, update=0.5, sync=0.25)
    with pytest.raises(ValueError, match="does not exist"):
        load_costs(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ValueError, match="is not JSON"):
        load_costs(bad)


def test_compare_policies() -> None:
    out = compare_policies(C, 12, 2, 2, steps=3)
    assert list(out) == ["none", "static-2", "bts", "none+tcss", "static-2+tcss", "bts+tcss"]
    lanes = {"steps": 3, "score_overlap": True}  # as runs score by default
    assert out["none"]["makespan"] == simulate(C, 12, 2, 2, NoTAG(), **lanes).makespan
    assert out["static-2"]["makespan"] == simulate(C, 12, 2, 2, StaticTAG(2), **lanes).makespan
    tcss = simulate(C, 12, 2, 2, BTS(), max_staleness=1, staleness_ratio=0.25, **lanes)
    assert out["bts+tcss"]["makespan"] == tcss.makespan
    # scored by the generators, as the paper's Algorithm 1: slower, as they also score
    own = compare_policies(C, 12, 2, 2, steps=3, score_overlap=False)
    assert own["none"]["makespan"] == simulate(C, 12, 2, 2, NoTAG(), steps=3).makespan
    assert own["none"]["makespan"] > out["none"]["makespan"]
    for name, row in out.items():
        assert row["step_time"] == pytest.approx(row["makespan"] / 3)
        assert row["vs_bound"] >= 1.0
        assert ("search_ms" in row) == name.startswith("bts")
    assert out["bts"]["makespan"] <= min(out["none"]["makespan"], out["static-2"]["makespan"])
    assert out["bts"]["search_ms"] >= 0 and out["bts"]["decisions"] > 0
    assert out["none"]["stale"] == 0 and out["none+tcss"]["stale"] > 0
    table = format_table(out)
    assert table.splitlines()[0].startswith("| policy | step time (s)")
    assert len(table.splitlines()) == 2 + 6 and "| bts+tcss |" in table


def test_plot_simulation(tmp_path) -> None:
    res = simulate(C, 8, 2, 2, StaticTAG(2), steps=2, max_staleness=1, staleness_ratio=0.25)
    out = plot_simulation(res, tmp_path / "sim.png", title="simulated")
    with Image.open(out) as im:
        assert im.size == (1600, 600)


def test_held_work_is_the_time_average_of_what_generators_hold() -> None:
    """By hand: two generators over 10 s. Micro-batch (0, 0): made 0-2 s on generator 0,
    fetched at 5 s: 2 * 2 / 2 (in flight) + 3 s * gen 2 s held; (0, 1): made 1-3 s on
    generator 1, fetched at 3 s: 2 * 2 / 2. Area 2 + 6 + 2 = 10 over 10 s x 2 generators."""
    from digen.sched.simulator import SimResult

    events = [
        TraceEvent("generate", "generator-0", 0, 0, 0, 0.0, 2.0),
        TraceEvent("generate", "generator-1", 0, 1, 0, 1.0, 3.0),
        TraceEvent("update", "trainer-0", 0, 1, 0, 3.0, 4.0),
        TraceEvent("update", "trainer-0", 0, 0, 0, 5.0, 6.0),
    ]
    res = SimResult(10.0, events, [10.0], 0, 0, [], {0: 0})
    assert held_work_s(res, 2.0) == pytest.approx(10 / 20)


def test_with_losses_weights_each_pool_by_its_binomial_probability() -> None:
    got = with_losses(
        C,
        6,
        3,
        1,
        loss_rate_per_h=4,
        rejoin_s=450,
        generator_price=2.0,
        trainer_price=3.0,
        preemptible_price=0.5,
        steps=2,
    )
    up = 1 / (1 + 4 / 3600 * 450)  # 2/3
    assert got["availability"] == pytest.approx(2 / 3) == pytest.approx(up)
    probs = [r["probability"] for r in got["pools"]]
    assert probs == pytest.approx([3 * up * (1 - up) ** 2, 3 * up**2 * (1 - up), up**3])
    assert got["no_generator_probability"] == pytest.approx((1 - up) ** 3)
    for r in got["pools"]:
        k = r["generators_up"]
        alone = simulate(C, 6, k, 1, BTS(), steps=2, score_overlap=True)
        assert r["step_time"] == pytest.approx(alone.makespan / 2)
        assert r["losses_per_step"] == pytest.approx(4 / 3600 * k * r["step_time"])
        extra = r["losses_per_step"] * r["held_s"] / k
        assert r["step_time_with_remakes"] == pytest.approx(r["step_time"] + extra)
    live = 1 - (1 - up) ** 3
    want = sum(p * r["step_time_with_remakes"] for p, r in zip(probs, got["pools"])) / live
    assert got["step_time"] == pytest.approx(want)
    assert got["steady_step_time"] == got["pools"][-1]["step_time"]
    assert got["step_time"] > got["steady_step_time"]  # fewer generators are never faster here
    up_mean = sum(p * r["generators_up"] for p, r in zip(probs, got["pools"])) / live
    assert got["cost_per_step"] == pytest.approx((up_mean * 0.5 + 3.0) * got["step_time"] / 3600)
    assert got["steady_cost_per_step"] == pytest.approx(
        (3 * 2.0 + 3.0) * got["steady_step_time"] / 3600
    )


def test_with_no_losses_nothing_changes_and_bad_rates_are_refused() -> None:
    got = with_losses(C, 6, 2, 1, loss_rate_per_h=0, rejoin_s=300, steps=2)
    assert got["availability"] == 1 and got["no_generator_probability"] == 0
    assert got["step_time"] == pytest.approx(got["steady_step_time"])
    with pytest.raises(ValueError, match="must not be negative"):
        with_losses(C, 6, 2, 1, loss_rate_per_h=-1, rejoin_s=300)
