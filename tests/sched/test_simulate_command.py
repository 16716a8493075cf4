"""`digen simulate`: the command over the simulator, as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli.main import main


def _run(*args: str):
    return CliRunner().invoke(main, ["simulate", *args])


def test_json_has_every_policy_with_makespan_and_search_time() -> None:
    res = _run("--microbatches", "32", "--update-gen-ratio", "0.1", "-g", "2", "-t", "2", "--json")
    assert res.exit_code == 0, res.output
    table = json.loads(res.output)
    assert set(table) == {"none", "static-2", "bts", "none+tcss", "static-2+tcss", "bts+tcss"}
    for entry in table.values():
        assert entry["makespan"] > 0 and entry["vs_bound"] >= 1.0 - 1e-9
    assert table["bts"]["search_ms"] > 0 and "search_ms" not in table["none"]
    # 32 micro-batches, 2 generators at 1 s each: without TAG the generators bound the step
    assert table["none"]["step_time"] >= 32 / 2
    assert table["bts"]["makespan"] <= table["none"]["makespan"] + 1e-9
    assert table["none"]["tag_count"] == 0 and table["bts"]["tag_count"] > 0


def test_recommend_ranks_colocated_and_every_split_best_first(tmp_path: Path) -> None:
    res = _run("--recommend", "--devices", "4", "-b", "8", "--json", "--update-tsp", "0.3")
    got = json.loads(res.stdout)  # progress lines go to stderr
    ranked = got["candidates"]
    splits = {(c["generators"], c["trainers"]) for c in ranked if c["layout"] == "split"}
    assert splits == {(1, 3), (2, 2), (3, 1)}
    colocated = [c for c in ranked if c["layout"] == "colocated"]
    assert [(c["trainers"], c["tsp"]) for c in colocated] in ([(4, True), (4, False)],)
    rounded = [round(c["step_time"], 9) for c in ranked]  # equal times rank by simplicity
    assert rounded == sorted(rounded) and len(ranked) == 2 + 3 * 6
    assert got["choice"].startswith(ranked[0]["label"] + ": predicted ")
    assert got["left_out"] == []


def test_recommend_shows_progress_on_stderr_unless_quiet() -> None:
    res = _run("--recommend", "--devices", "3", "-b", "2", "--steps", "1")
    assert res.exit_code == 0, res.output
    lines = res.stderr.splitlines()
    assert lines[0] == "simulating colocated and the splits of 3 devices"
    assert lines[1].startswith("G=1 T=2: best 1G+2T ")
    assert lines[2].startswith("G=2 T=1: best 2G+1T ")
    assert len(lines) == 3 and "| layout |" in res.stdout
    assert res.stdout.splitlines()[-1].startswith("choice: ")
    quiet = _run("--recommend", "--devices", "3", "-b", "2", "--steps", "1", "--quiet")
    assert quiet.exit_code == 0 and quiet.stderr == "" and quiet.stdout == res.stdout


def test_recommend_on_gpus_prices_and_leaves_out_what_does_not_fit(tmp_path: Path) -> None:
    hw = tmp_path / "hw.yaml"
    hw.write_text(
        "generator: {kind: l4, count: 2, price_h: 0.8}\ntrainer: {kind: h100, count: 2, price_h: 3}\n"
    )
    args = ["--recommend", "-b", "8", "--steps", "2", "--hardware", str(hw), "--quiet"]
    # hunyuanvideo's 13B in bf16 (26 GB) does not fit a 24 GB l4: only colocated is left
    res = _run(*args, "--model", "hunyuanvideo")
    assert res.exit_code == 0, res.output
    assert "left out: 2G+2T: a l4 generator cannot hold the model (26 GB" in res.stdout
    # with its progress shown, a split that fits nowhere is a line of its own, not a crash
    shown = _run(*args[:-1], "--model", "hunyuanvideo")
    assert shown.exit_code == 0, shown.output
    assert shown.stderr.splitlines()[1:] == ["G=2 T=2: does not fit"]
    assert shown.stdout == res.stdout
    assert "| 1 | colocated on 2 devices |" in res.stdout and "per 1k samples" in res.stdout
    # on l40s (48 GB) it fits: the split is ranked too, and --by cost puts the cheapest first
    hw.write_text(
        "generator: {kind: l40s, count: 2, price_h: 0.8}\ntrainer: {kind: h100, count: 2, price_h: 3}\n"
    )
    res = _run(*args, "--model", "hunyuanvideo", "--by", "cost", "--json")
    got = json.loads(res.stdout)
    costs = [c["cost_per_1k"] for c in got["candidates"]]
    assert costs == sorted(costs) and {c["layout"] for c in got["candidates"]} == {
        "colocated",
        "split",
    }
    split = next(c for c in got["candidates"] if c["layout"] == "split")
    assert split["price_h"] == 2 * 0.8 + 2 * 3 and split["terms"]["weight sync"] > 0


def test_profile_and_plot(tmp_path: Path) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"gen": 2.0, "update": 0.5, "score": 0.1}))
    png = tmp_path / "sim.png"
    res = _run("--profile", str(profile), "-b", "4", "-g", "1", "-t", "1", "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert "| bts |" in res.output and png.stat().st_size > 5_000


def test_bad_input_is_one_sentence() -> None:
    for args, msg in (
        (["--trainers", "0"], "--trainers = 0 is not allowed"),
        (["--recommend"], "needs --devices"),
        (["--recommend", "--devices", "4", "--device", "h100"], "need --model"),
        (["--recommend", "--devices", "4", "--model", "sd3"], "needs --hardware or --device"),
        (["--recommend", "--hardware", "/no/hw.yaml", "--model", "sd3"], "does not exist"),
        (["--recommend", "--device", "tpu", "--model", "sd3", "--devices", "2"], "not a known"),
        (["--profile", "/no/such.json"], "does not exist"),
        (["--gen", "-1"], "costs.gen"),
    ):
        res = _run(*args)
        assert res.exit_code == 2, (args, res.output)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and msg in lines[0], (args, res.output)


def test_loss_rate_prices_generators_that_come_and_go() -> None:
    args = ["--microbatches", "6", "--generators", "3", "--trainers", "1", "--steps", "2"]
    args += ["--loss-rate", "4", "--rejoin-s", "450", "--generator-price", "2"]
    args += ["--preemptible-price", "0.5", "--trainer-price", "3"]
    res = _run(*args)
    assert res.exit_code == 0, res.output
    assert "up 66.7% of the time" in res.output
    assert "| 3 | 0.2963 |" in res.output  # (2/3)^3 of the time all three are up
    got = json.loads(_run(*args, "--json").output)
    assert got["availability"] == pytest.approx(2 / 3)
    assert f"step time {got['step_time']:.3f} s" in res.output


def test_each_job_is_a_command_and_the_flags_alone_still_work() -> None:
    """`simulate policies / recommend / losses` give what the flags alone (the earlier
    form, which stays) give; each command takes only its own options."""
    shape = ["-b", "6", "-g", "2", "-t", "1", "--steps", "2", "--json"]
    for command, extra in (
        ("policies", ["--update-gen-ratio", "0.3"]),
        ("recommend", ["--devices", "3", "--quiet"]),
        ("losses", ["--loss-rate", "2", "--generator-price", "1"]),
    ):
        old = ["--recommend"] if command == "recommend" else []
        by_command = _run(command, *shape, *extra)
        by_flags = _run(*shape, *old, *extra)
        assert by_command.exit_code == 0, (command, by_command.output)
        got, want = json.loads(by_command.stdout), json.loads(by_flags.stdout)
        for table in (got, want):  # how long the search took is not a result
            for entry in table.values() if command == "policies" else ():
                entry.pop("search_ms", None)
                entry.pop("search_ms_max", None)
        assert got == want, command
    assert _run("policies", "--devices", "3").exit_code == 2  # a recommend option
    assert "--loss-rate" not in _run("recommend", "--help").output
    listed = _run("--help").output
    assert all(f"digen simulate {c}" in listed for c in ("policies", "recommend", "losses"))
    assert "--update-tsp" not in listed  # the flags of the earlier form are not listed


def test_a_command_refuses_options_before_it_and_losses_needs_a_rate() -> None:
    for args, msg in (
        (["-g", "2", "policies"], "--generators must come after the command (digen simulate"),
        (["losses", "-g", "2"], "digen simulate losses needs --loss-rate"),
    ):
        res = _run(*args)
        assert res.exit_code == 2, (args, res.output)
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1 and msg in lines[0], (args, res.output)
