"""`digen bench`: the ladder's JSON is complete and consistent with itself, bad options are
one sentence. Speed is never asserted here (docs/BENCHMARKS.md holds the measured ladder)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main
from digen.run.bench import utilisation
from digen.sched.trace import Trace, TraceEvent

RUNGS = ["colocated", "naive", "pipeline", "gap", "tsp", "tag", "tcss"]
WORDS = ["colocated", "naive", "pipelining", "GAP", "TSP", "TAG", "TCSS"]


@pytest.mark.slow
def test_bench_quick_json_is_complete_and_consistent(tmp_path: Path) -> None:
    report_path, plot_path, runs = (
        tmp_path / "bench.json",
        tmp_path / "bench.png",
        tmp_path / "runs",
    )
    args = ["bench", "--quick", "--size", "32", "--steps", "2", "--quiet"]
    args += ["--json", str(report_path), "--plot", str(plot_path), "--out", str(runs)]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    report = json.loads(report_path.read_text())
    modes = report["modes"]

    assert [m["key"] for m in modes] == RUNGS
    assert [m["rung"] for m in modes] == list(range(1, 8))
    for m, word in zip(modes, WORDS, strict=True):
        assert word in m["name"]
    colocated, naive = modes[0]["step_time_s"], modes[1]["step_time_s"]
    for m in modes:
        assert m["step_time_s"] > 0
        assert m["step_time_min_s"] <= m["step_time_s"] <= m["step_time_max_s"]
        assert m["speedup_vs_colocated"] == pytest.approx(colocated / m["step_time_s"])
        assert m["speedup_vs_naive"] == pytest.approx(naive / m["step_time_s"])
        assert m["samples_per_s"] == pytest.approx(16 / m["step_time_s"])  # 2 prompts x 8
        assert m["utilization"] and all(0.0 <= u <= 1.0 for u in m["utilization"].values())
        assert 0.0 <= m["bubble_fraction"] <= 1.0
        assert m["overhead_fraction"] >= 0.0
        assert m["bound_ratio"] > 0
        assert m["bound_ratio"] == pytest.approx(m["step_time_s"] / m["ideal_bound_s"])
        assert m["predicted_step_time_s"] > 0
        expect = (m["predicted_step_time_s"] - m["step_time_s"]) / m["step_time_s"]
        assert m["prediction_error"] == pytest.approx(expect)
    for m in modes[1:]:
        assert set(m["utilization"]) == {"generator", "trainer"}
    assert set(modes[0]["utilization"]) == {"worker"}  # colocated workers do both jobs
    assert modes[0]["overhead_fraction"] == 0.0  # no calls between processes to pay for
    assert all(m["overhead_fraction"] > 0.0 for m in modes[1:])

    # rung 1 is the fastest colocated variant; every variant is reported
    variants = report["colocated_variants"]
    assert len(variants) == 2 and sum(v["chosen"] for v in variants) == 1
    best = next(v for v in variants if v["chosen"])
    assert best["step_time_s"] == colocated == min(v["step_time_s"] for v in variants)
    assert modes[0]["variant"] == best["key"]
    assert report["machine"]["cores"] >= 1 and report["machine"]["torch"]
    assert report["command"].startswith("digen bench")

    # the data-parallel colocated run traces every worker, not only the first
    trace = Trace.load_jsonl(runs / "r1-colocated-2x1" / "trace.jsonl")
    assert {"worker-0", "worker-1"} <= set(trace.workers())
    assert not list((runs / "r1-colocated-2x1").glob("trace-rank-*"))

    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = [line for line in res.output.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + 7 + 1  # header, rule, 7 rungs, the other colocated variant


@pytest.mark.slow
def test_bench_sharded_measures_both_deals_and_predicts_terms_from_samples(
    tmp_path: Path,
) -> None:
    """``--sharded``: 1 generator and 2 FSDP trainers, samples dealt then terms dealt; the
    report's ratios and the planner's prediction are what its own numbers make them."""
    from digen.algos.train_step import terms_per_sample
    from digen.run.bench import BenchSettings, rung_configs

    report_path, plot_path, runs = (
        tmp_path / "bench.json",
        tmp_path / "bench.png",
        tmp_path / "runs",
    )
    args = ["bench", "--quick", "--sharded", "--size", "32", "--steps", "2", "--quiet"]
    args += ["--json", str(report_path), "--plot", str(plot_path), "--out", str(runs)]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    sh = json.loads(report_path.read_text())["sharded"]
    samples, terms, grouped = sh["rungs"]
    keys = [samples["key"], terms["key"], grouped["key"]]
    assert keys == ["sharded-samples", "sharded-terms", "sharded-grouped"]
    assert "runtime.placement.shard_deal=samples" in samples["overrides"]
    assert "runtime.placement.shard_deal=terms" in terms["overrides"]
    assert "runtime.schedule.group_updates=true" in grouped["overrides"]
    assert sh["speedup_grouped_vs_terms"] == pytest.approx(
        terms["step_time_s"] / grouped["step_time_s"]
    )
    for m in (samples, terms, grouped):
        assert m["step_time_min_s"] <= m["step_time_s"] <= m["step_time_max_s"]
        assert set(m["utilization"]) == {"generator", "trainer"}
        assert m["costs"]["update"] > 0
    assert sh["speedup_terms_vs_samples"] == pytest.approx(
        samples["step_time_s"] / terms["step_time_s"]
    )
    assert sh["update_speedup"] == pytest.approx(
        samples["costs"]["update"] / terms["costs"]["update"]
    )
    # the model: one sample of K trained timesteps over 2 members, passes of p x d terms
    cfg = rung_configs(BenchSettings(size=32, steps=2, repeats=1, workers=3, sharded=True))
    c = cfg["sharded-terms"]
    k = terms_per_sample(c, 0)
    size = c.train.micro_batch_size * c.runtime.schedule.tsp_degree
    mo = sh["model"]
    assert (mo["trainers"], mo["trained_timesteps"]) == (2, k)
    assert mo["passes_by_samples"] == math.ceil(k / c.runtime.schedule.tsp_degree)
    each = math.ceil(k / 2)  # a member's terms
    assert mo["passes_by_terms"] == math.ceil(each / size)
    assert mo["update_scale"] == pytest.approx(each / k)
    got = (mo["predicted_terms_step_time_s"] - terms["step_time_s"]) / terms["step_time_s"]
    assert mo["prediction_error"] == pytest.approx(got)
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "terms dealt vs samples dealt" in res.output
    # grouped: one update a prompt group (one sample a micro-batch, so n of them a group)
    g = cfg["sharded-grouped"]
    events = Trace.load_jsonl(runs / "r1-sharded-grouped" / "trace.jsonl").events
    for step in range(2):
        ups = [e for e in events if e.kind == "update" and e.step == step]
        assert len(ups) == g.data.train_batch_size
    ones = Trace.load_jsonl(runs / "r1-sharded-terms" / "trace.jsonl").events
    assert len([e for e in ones if e.kind == "update" and e.step == 0]) == (
        g.data.train_batch_size * g.rollout.n
    )


@pytest.mark.slow
def test_bench_sequence_measures_each_arm_and_predicts_the_split_ones(tmp_path: Path) -> None:
    """``--sequence``: one generator's sampling on one process (all of a micro-batch, and
    half), on two sharing its tokens and on two sharing its guidance branches; each split
    arm's prediction is the one-process arm's time outside the transformer, the half
    micro-batch's inside it and the traffic the planner prices."""
    from digen.planning.hardware import ModelSize, ulysses_s

    report_path = tmp_path / "sequence.json"
    args = ["bench", "--sequence", "--quick", "--size", "32", "--quiet"]
    res = CliRunner().invoke(main, [*args, "--json", str(report_path)], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    sq = json.loads(report_path.read_text())["sequence"]
    arms = {a["arm"]: a for a in sq["arms"]}
    assert list(arms) == ["one", "one-half", "sequence", "cfg"]
    assert [a["processes"] for a in arms.values()] == [1, 1, 2, 2]
    m = sq["model"]
    rest = arms["one"]["seconds"] - arms["one"]["inside_transformer_s"]
    assert m["outside_transformer_s"] == pytest.approx(rest)
    # the tiny flux: 3 attentions a pass span the group (1 double, 2 single blocks), over
    # 2 x 2 image tokens and the prompt's
    assert m["spanning_attention_a_pass"] == 3 and m["tokens"] > 4
    geometry = ModelSize(params=0.0, blocks=3, trained=0.0, hidden=m["width"], tokens=m["tokens"])
    trade = m["passes"] * ulysses_s(
        geometry, 4, 2, m["all_to_all_gb_s"], latency_s=m["all_to_all_latency_s"], value_bytes=4
    )
    assert m["all_to_all_s"] == pytest.approx(trade)
    half = arms["one-half"]["inside_transformer_s"]
    assert arms["sequence"]["predicted_s"] == pytest.approx(rest + half + trade)
    assert arms["cfg"]["predicted_s"] == pytest.approx(rest + half + m["exchange_s"])
    for a in (arms["sequence"], arms["cfg"]):
        err = (a["predicted_s"] - a["seconds"]) / a["seconds"]
        assert a["prediction_error"] == pytest.approx(err)
    assert "sequence-parallel, 2 processes" in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "1"], "--steps 1"),
        (["--size", "40"], "--size 40"),
        (["--repeats", "0"], "--repeats 0"),
        (["--model", "nope"], "--model 'nope'"),
        (["--algo", "nope"], "--algo 'nope'"),
        (["--workers", "1"], "--workers 1"),
        (["--plot", "timeline.jpg"], ".png"),
        (["--json", "no/such/dir/out.json"], "does not exist"),
        (["runtime.schedule.tsp_degree=0"], "runtime.schedule.tsp_degree"),
        (["--sharded", "--workers", "2"], "--workers 2 is not allowed with --sharded"),
        (["--sharded", "--quality"], "choose one"),
        (["--sequence", "--sharded"], "choose one"),
        (["--sequence", "--size", "40"], "--size 40"),
        (["--sequence", "rollout.guidance_scale=0.5"], "rollout.guidance_scale"),
        (["--sequence", "rollout.guidance_scale=1.0"], "above 1"),
    ],
)
def test_bad_options_are_one_sentence_and_exit_2(args: list[str], message: str) -> None:
    res = CliRunner().invoke(main, ["bench", "--quick", *args])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert lines[0].endswith(".")


def _ev(kind: str, worker: str, step: int, t0: float, t1: float) -> TraceEvent:
    return TraceEvent(kind, worker, step, 0, step, t0, t1)


def test_utilisation_counts_the_steps_after_the_first_per_pool() -> None:
    events = [
        _ev("generate", "generator-0", 0, 0.0, 1.0),
        _ev("update", "trainer-0", 0, 1.0, 2.0),
        _ev("step", "trainer-0", 0, 2.0, 2.0),  # step 0 ends at 2.0: the window starts there
        _ev("generate", "generator-0", 1, 2.0, 3.0),
        _ev("score", "generator-0", 1, 2.5, 3.5),  # overlaps its own generate: counted once
        _ev("update", "trainer-0", 1, 3.5, 4.0),
        _ev("step", "trainer-0", 1, 4.0, 4.0),
    ]
    util, bubble = utilisation(events, first=1)
    assert util == pytest.approx({"generator": 0.75, "trainer": 0.25})
    assert bubble == pytest.approx(0.5)
