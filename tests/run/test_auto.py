"""``digen run --mode auto``: the probe, the costs it measures, the layout it writes, and the
whole command (probe, plan, run) as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from helpers import tiny_config

from cli.main import main
from digen.planning.layouts import Candidate
from digen.run.auto import PROBE_STEPS, apply_layout, measured_costs, probe_config
from digen.sched.trace import TraceEvent

SMALL = ["rollout.n=4", "train.micro_batch_size=4", "rollout.num_inference_steps=4"]
SMALL += ["model.flavour=tiny", "model.height=32", "model.width=32"]


def test_the_probe_is_one_generator_and_one_trainer_with_one_tag_a_step() -> None:
    cfg = tiny_config("flux", "flowgrpo", [*SMALL, "steps=50", "runtime.schedule.max_staleness=1"])
    probe = probe_config(cfg)
    rt = probe.runtime
    assert (rt.mode, rt.generators, rt.trainers, rt.schedule.tag, rt.schedule.tag_k) == (
        "disaggregated",
        1,
        1,
        "static",
        1,
    )
    assert rt.schedule.max_staleness == 0 and probe.steps == PROBE_STEPS and probe.eval.every == 0
    assert probe.rollout == cfg.rollout and probe.algo == cfg.algo  # the same work


def test_measured_costs_are_medians_after_the_first_step_plus_call_overhead() -> None:
    def ev(kind: str, worker: str, step: int, seconds: float) -> TraceEvent:
        return TraceEvent(kind, worker, step, 0, step, 10.0 * step, 10.0 * step + seconds)

    events = [
        ev("generate", "generator-0", 0, 9.0),  # the warm-up step: left out
        *(ev("generate", "generator-0", s, t) for s, t in ((1, 1.0), (1, 3.0), (2, 2.0))),
        *(ev("update", "trainer-0", s, t) for s, t in ((0, 5.0), (1, 0.5), (2, 0.7), (2, 0.6))),
        ev("tag", "trainer-0", 1, 1.5),
        ev("score", "scorer-0", 1, 0.1),
    ]
    rows = [
        {"overhead_ms/generate": 500.0, "overhead_ms/update": 500.0},  # step 0: left out
        {"overhead_ms/generate": 10.0, "overhead_ms/update": 20.0, "overhead_ms/score": 1.0},
        {"overhead_ms/generate": 30.0, "overhead_ms/update": 40.0, "overhead_ms/score": 3.0},
    ]
    c = measured_costs(events, rows)
    assert c.gen == pytest.approx(2.0 + 0.020)
    assert c.update == pytest.approx(0.6 + 0.030)
    assert c.gen_tag == pytest.approx(1.5 + 0.020)
    assert c.score == pytest.approx(0.1 + 0.002)


def test_a_candidate_becomes_the_run_settings() -> None:
    cfg = tiny_config("flux", "flowgrpo", [*SMALL, "train.micro_batch_size=4"])
    co = apply_layout(cfg, Candidate(layout="colocated", generators=0, trainers=2), size=4)
    assert co.runtime.mode == "colocated" and co.train.num_devices == 2
    # 4 samples a mini-batch over 2 devices: micro-batches of 2, not the 4 given
    assert co.train.micro_batch_size == 2
    split = apply_layout(
        cfg, Candidate(layout="split", generators=3, trainers=1, policy="static-2"), size=4
    )
    rt = split.runtime
    assert (rt.mode, rt.generators, rt.trainers, rt.schedule.tag, rt.schedule.tag_k) == (
        "disaggregated",
        3,
        1,
        "static",
        2,
    )
    assert rt.schedule.samples_per_microbatch == 4 and rt.schedule.max_staleness == 0
    stale = tiny_config("flux", "flowgrpo", [*SMALL, "runtime.schedule.max_staleness=1"])
    kept = apply_layout(
        stale, Candidate(layout="split", generators=1, trainers=1, policy="bts", tcss=True), 4
    )
    assert kept.runtime.schedule.max_staleness == 1 and kept.runtime.schedule.tag == "bts"


@pytest.mark.slow
def test_mode_auto_times_plans_and_runs_its_choice(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["run", "--mode", "auto", "--devices", "2", "--model", "flux", "--steps", "2"]
    args += ["--out", str(out)]
    res = CliRunner().invoke(main, [*args, "--quiet", *SMALL])
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    # one line says what was chosen and why, the same as plan.json and the run's log
    said = [line for line in res.stderr.splitlines() if line.startswith("mode auto: ")]
    assert said[-1] == f"mode auto: {plan['line']}"
    choice, ranked = plan["choice"], plan["candidates"]
    assert plan["line"].startswith(choice["label"] + ": predicted ")
    assert {c["layout"] for c in ranked} == {"colocated", "split"}  # both were weighed
    assert choice == ranked[0] or plan["refused"]  # the fastest, unless the config refused it
    assert choice["step_time"] == min(c["step_time"] for c in ranked[len(plan["refused"]) :])
    assert plan["devices"] == 2 and all(plan["costs"][k] > 0 for k in ("gen", "update"))
    assert not any(c["tcss"] for c in ranked)  # the config allows no staleness
    # the choice is the run's config, as written to config.yaml
    cfg = yaml.safe_load((out / "config.yaml").read_text())
    rt = cfg["runtime"]
    if choice["layout"] == "colocated":
        assert rt["mode"] == "colocated" and cfg["train"]["num_devices"] == choice["trainers"]
    else:
        assert rt["mode"] == "disaggregated"
        assert (rt["generators"], rt["trainers"]) == (choice["generators"], choice["trainers"])
        assert rt["schedule"]["tag"] == choice["policy"].split("-")[0]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    log = [json.loads(x) for x in (out / "trainer.log").read_text().splitlines()]
    assert any(e.get("text") == f"mode auto chose {plan['line']}" for e in log)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "auto", "--devices", "1"], "--devices = 1 is not allowed"),
        (["--devices", "4"], "add --mode auto"),
    ],
)
def test_mode_auto_bad_input_is_one_sentence(tmp_path: Path, args, message) -> None:
    res = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "o"), *args])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]


def test_mode_auto_does_not_resume(tmp_path: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    (out / "config.yaml").write_text("steps: 2\n")
    res = CliRunner().invoke(main, ["run", "--resume", str(out), "--mode", "auto"])
    assert res.exit_code == 2 and "a resumed run keeps the one" in res.output


def _memory(model: str, lora_rank: int):
    from digen.planning.hardware import ModelSize, load_hardware
    from digen.run.auto import RunMemory

    hardware = load_hardware({"device": {"kind": "h100", "memory_gb": 80}})
    return RunMemory(hardware, ModelSize.of(model, lora_rank=lora_rank))


@pytest.mark.parametrize("lora_rank", [0, 64], ids=["full", "lora"])
def test_auto_probes_and_plans_only_layouts_that_fit_the_devices_memory(lora_rank: int) -> None:
    """FLUX.1 (12B) on 8 devices of 80 GB: a full fine-tune's training state (16 bytes a
    parameter, 190 GB) fits no device, so the probe shards it over the fewest trainers whose
    shards fit and the plan ranks no replicated trainer; a LoRA's (27 GB) fits one device,
    so the probe is one replicated trainer and replicated layouts are ranked."""
    from digen.errors import ConfigError
    from digen.planning.hardware import train_state_bytes
    from digen.run.auto import probe_trainers, rank_layouts
    from digen.sched.costs import Costs

    memory = _memory("flux", lora_rank)
    fits = memory.hardware.trainer.fits
    cfg = tiny_config("flux", "flowgrpo", [*SMALL, "steps=4", f"train.lora_rank={lora_rank}"])
    trainers = probe_trainers(8, memory)
    probe = probe_config(cfg, trainers)
    costs = Costs(gen=2.0, gen_tag=2.0, score=0.1, update=1.0, step=0.2, sync=0.0)
    ranked, _, skipped = rank_layouts(cfg, probe, costs, 8, memory)
    assert ranked
    layouts = []
    for c in ranked:
        try:
            layouts.append(apply_layout(cfg, c, 4).runtime)
        except ConfigError:  # a layout this small config does not divide into (so is skipped)
            continue
    assert layouts
    if lora_rank == 0:
        assert trainers > 1 and fits(train_state_bytes(memory.model, trainers))
        assert not fits(train_state_bytes(memory.model, trainers - 1))
        assert probe.runtime.trainers == trainers
        assert probe.runtime.placement.trainer_parallel == "fsdp"
        assert all(c.strategy and c.strategy != "replicated" for c in ranked)
        assert {rt.placement.trainer_parallel for rt in layouts} == {"fsdp"}
        assert any("cannot hold" in why for why in skipped)
    else:
        assert trainers == 1 and probe.runtime.placement.trainer_parallel == "replicate"
        assert any(c.strategy == "replicated" for c in ranked)
        assert "replicate" in {rt.placement.trainer_parallel for rt in layouts}


def test_auto_refuses_a_model_no_split_of_the_devices_can_hold() -> None:
    from digen.errors import DigenError
    from digen.run.auto import probe_trainers

    with pytest.raises(DigenError, match="cannot hold the training state"):
        probe_trainers(2, _memory("qwenimage", 0))  # 327 GB of state on one 80 GB trainer
