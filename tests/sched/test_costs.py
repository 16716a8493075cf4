"""Costs validation and the online profiler's estimates, worked out by hand."""

from __future__ import annotations

import json
import math

import pytest

from digen.sched.costs import Costs, OnlineProfiler, pool_of
from digen.sched.trace import TraceEvent


def ev(kind: str, worker: str, t0: float, t1: float) -> TraceEvent:
    return TraceEvent(kind, worker, 0, 0 if kind not in ("step", "sync") else -1, 0, t0, t1)


def test_costs_defaults_and_round_trip() -> None:
    c = Costs(gen=2, update=3)
    assert c.gen_tag == 2.0 and c.score == c.step == c.sync == 0.0
    assert isinstance(c.gen, float)
    d = c.to_dict()
    assert d == {"gen": 2.0, "update": 3.0, "gen_tag": 2.0, "score": 0.0, "step": 0.0, "sync": 0.0}
    assert Costs.from_dict(d) == c
    assert Costs(gen=1, update=1, gen_tag=1.5).gen_tag == 1.5
    assert c.as_tuple() == (2.0, 2.0, 0.0, 3.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gen": -1, "update": 1}, r"costs\.gen must be a finite number of seconds >= 0, got -1"),
        ({"gen": 1, "update": math.inf}, r"costs\.update .* got inf"),
        ({"gen": 1, "update": 1, "score": math.nan}, r"costs\.score"),
        ({"gen": 1, "update": 1, "gen_tag": -0.5}, r"costs\.gen_tag"),
        ({"gen": "1", "update": 1}, r"costs\.gen .* got '1'"),
        ({"gen": True, "update": 1}, r"costs\.gen"),
    ],
)
def test_costs_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Costs(**kwargs)


def test_costs_from_dict_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown cost key.*genn"):
        Costs.from_dict({"genn": 1, "update": 1})


def test_pool_of() -> None:
    assert pool_of("generator-3") == "generator"
    assert pool_of("trainer-h100-12") == "trainer-h100"
    assert pool_of("driver") == "driver"


def test_ema_and_window_estimates() -> None:
    p = OnlineProfiler(alpha=0.5, window=2)
    for t in (2.0, 4.0, 8.0):  # generate durations on generator-0/1
        p.observe(ev("generate", "generator-1", 10.0, 10.0 + t))
    # EMA: 2 -> 2 + 0.5 * (4 - 2) = 3 -> 3 + 0.5 * (8 - 3) = 5.5; window of 2: (4 + 8) / 2 = 6
    assert p.estimate("gen", "generator") == pytest.approx(5.5)
    assert OnlineProfiler.from_dict({**p.to_dict(), "method": "window"}).estimate(
        "gen"
    ) == pytest.approx(6.0)
    # the median of the window ignores one slow sample: 3 samples of 4 kept, 30 an outlier
    m = OnlineProfiler(window=4, method="median")
    for t in (2.0, 4.0, 30.0):
        m.observe(ev("generate", "generator-0", 0.0, t))
    assert m.estimate("gen") == 4.0 and m.costs(defaults=Costs(gen=1, update=1)).gen == 4.0
    assert p.count("gen") == 3 and p.seen("gen") and p.seen("generate")
    assert not p.seen("update") and p.estimate("update") is None


def test_pools_keep_separate_estimates() -> None:
    p = OnlineProfiler(alpha=1.0)  # alpha 1: the estimate is the last sample
    p.observe(ev("generate", "gen-a100-0", 0, 4))
    p.observe(ev("generate", "gen-h100-0", 0, 2))
    p.observe(ev("update", "trainer-0", 0, 1))
    p.observe(ev("tag", "trainer-1", 0, 3))
    p.observe(ev("score", "gen-a100-1", 0, 0.5))
    assert p.pools("gen") == ["gen-a100", "gen-h100"]
    assert p.estimate("gen", "gen-a100") == 4.0
    assert p.estimate("gen", "gen-h100") == 2.0
    assert p.estimate("gen") == 3.0  # mean of the two pools' estimates
    c = p.costs(generator_pool="gen-h100")
    assert (c.gen, c.gen_tag, c.update) == (2.0, 3.0, 1.0)
    assert c.score == 0.0  # the h100 pool has not scored yet: nothing measured, no default


def test_step_and_sync_take_the_slowest_pool() -> None:
    p = OnlineProfiler(alpha=1.0)
    p.observe(ev("sync", "generator-0", 0, 0.2))
    p.observe(ev("sync", "driver", 0, 0.5))
    p.observe(ev("step", "trainer-0", 0, 0.3))
    assert p.estimate("sync") == 0.5
    assert p.estimate("step") == 0.3


def test_fallbacks() -> None:
    p = OnlineProfiler(tag_scale=1.5)
    with pytest.raises(ValueError, match="no gen time measured yet"):
        p.costs()
    assert not p.ready()
    p.observe(ev("generate", "generator-0", 0, 2))
    p.observe(ev("update", "trainer-0", 0, 1))
    assert p.ready()
    c = p.costs()
    assert c.gen_tag == pytest.approx(3.0)  # unseen TAG: gen * tag_scale
    assert (c.score, c.step, c.sync) == (0.0, 0.0, 0.0)
    d = p.costs(defaults=Costs(gen=9, update=9, gen_tag=4, score=0.25, sync=0.1))
    assert (d.gen, d.update, d.gen_tag, d.score, d.sync) == (2.0, 1.0, 4.0, 0.25, 0.1)
    only_defaults = OnlineProfiler().costs(defaults=Costs(gen=1, update=2))
    assert (only_defaults.gen, only_defaults.update) == (1.0, 2.0)


def test_profile_file_round_trip(tmp_path) -> None:
    p = OnlineProfiler(alpha=0.25, window=3)
    for i in range(5):
        p.observe(ev("generate", "generator-0", i, i + 1 + 0.1 * i))
        p.observe(ev("update", "trainer-0", i, i + 0.5))
    path = p.save(tmp_path / "run" / "profile.json")
    data = json.loads(path.read_text())
    assert data["costs"]["gen"] == pytest.approx(p.estimate("gen"))
    q = OnlineProfiler.load(path)
    assert (q.alpha, q.window, q.method) == (0.25, 3, "ema")
    assert q.costs() == p.costs()
    assert q.to_dict() == p.to_dict()
    assert OnlineProfiler.from_json(p.to_json()).count("gen") == 5


def test_profiler_rejects_bad_settings_and_samples() -> None:
    with pytest.raises(ValueError, match="alpha"):
        OnlineProfiler(alpha=0)
    with pytest.raises(ValueError, match="window"):
        OnlineProfiler(window=0)
    with pytest.raises(ValueError, match="method"):
        OnlineProfiler(method="mode")
    with pytest.raises(ValueError, match="unknown cost"):
        OnlineProfiler().add("train", "trainer", 1.0)
    with pytest.raises(ValueError, match="finite"):
        OnlineProfiler().add("gen", "generator", -1.0)
