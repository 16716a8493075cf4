"""The one-GPU check script, run as CI runs it: ``--device cpu --quick``.

One subprocess: colocated and disaggregated runs (four worker processes in all), the
equality of their parameters after one fp32 step, bf16 runs, and the cost curves written as a
profile. About 30 s on two idle cores; a minute when other jobs share them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from digen.planning.simulate import load_costs

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
pytestmark = pytest.mark.xdist_group("test_gpu_check")  # one worker builds the module's run


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    data = json.loads((out / "report.json").read_text())
    assert json.loads(done.stdout) == data  # stdout carries the report and nothing else
    return data, out


@pytest.mark.slow
def test_disaggregated_equals_colocated_after_one_fp32_step(report) -> None:
    eq = report[0]["equality"]
    assert eq["passed"] is True
    # on a CPU with one thread per worker the two modes compute the same bits
    assert eq["max_abs_diff"] < 1e-7
    assert eq["moved"] > 1e-4  # the step moved the weights (lr 1e-3), so equality says something
    assert eq["params"] > 0


@pytest.mark.slow
def test_runs_report_step_times_memory_and_rewards(report) -> None:
    data = report[0]
    runs = data["runs"]
    assert set(runs) == {
        "fp32_colocated",
        "fp32_disaggregated",
        "bf16_colocated",
        "bf16_disaggregated",
    }
    for name, run in runs.items():
        assert run["steps"] == len(run["step_time_s"]) >= 1, name
        assert all(t > 0 for t in run["step_time_s"]), name
        assert run["median_step_time_s"] > 0, name
        assert all(math.isfinite(r) for r in run["reward_mean"]), name
    assert runs["bf16_disaggregated"]["steps"] == data["plan"]["steps"]
    mem = data["memory_peak_gb"]
    assert all(mem[f"{d}/{p}"] > 0 for d in ("fp32", "bf16") for p in ("generator", "trainer"))
    learn = data["learning"]
    assert learn["checked"] is False and learn["passed"] is True  # --quick reports only
    assert learn["reward_mean_per_step"] == runs["bf16_disaggregated"]["reward_mean"]
    # the bf16 trainer recomputes the generator's log-probs within bf16's rounding (bit for
    # bit here; a CPU whose kernels change with the batch size may round them apart)
    drift = data["logprob_drift"]
    assert drift["terms_over_bound"] == 0 and drift["passed"] is True and drift["max"] >= 0
    env = data["environment"]
    assert env["torch"] and env["cuda_available"] in (True, False) and env["device_name"]
    assert data["wall_s"] > 0 and data["passed"] is True


@pytest.mark.slow
def test_profile_holds_the_measured_points_and_loads(report) -> None:
    data, out = report
    path = out / "profile.json"
    costs = load_costs(path)
    assert costs.gen > 0 and costs.update > 0 and costs.gen_tag > 0 and costs.step > 0
    profile = json.loads(path.read_text())
    curves = profile["curves"]
    assert [p["microbatch"] for p in curves["generate"]] == [1, 2]
    pairs = {(p["microbatch"], p["tsp_degree"]) for p in curves["train"]}
    assert pairs == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(p["seconds"] > 0 for p in curves["generate"] + curves["train"])
    # the costs are the measured points at the operating point
    point = profile["operating_point"]
    gen = next(p for p in curves["generate"] if p["microbatch"] == point["microbatch"])
    update = next(
        p
        for p in curves["train"]
        if (p["microbatch"], p["tsp_degree"]) == (point["microbatch"], point["tsp_degree"])
    )
    assert costs.gen == pytest.approx(gen["seconds"]) and costs.update == pytest.approx(
        update["seconds"]
    )
    assert data["profile"]["loaded_back"] is True
    assert data["profile"]["costs"] == pytest.approx(costs.to_dict())


@pytest.mark.slow
def test_every_collective_path_runs_once(report) -> None:
    c = report[0]["collectives"]
    assert c["passed"] is True
    assert c["default_group"] == {"backend": "gloo", "cpu_and_device_tensors": True}
    assert c["fsdp_load"]["transformer_gb"] > 0  # a full fine-tune policy through a mesh
    assert c["broadcast_group"]["ran"] is True
    # one scoring process (the generator's), on the generator's device
    assert [r["worker_device"] for r in c["reward_threads"]] == ["cpu"]
    assert c["rewards_on_the_generators_device"] is True
