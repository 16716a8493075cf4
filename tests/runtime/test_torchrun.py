"""`digen run` under torchrun: ranks mapped to roles, one real single-machine launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cli.main import _torchrun_world, role_for_rank
from digen import load_config
from digen.errors import DigenError
from digen.presets import preset

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=3"]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.pop("DIGEN_RPC_PORT", None)
    return {**env, **extra}


def test_ranks_map_to_driver_then_generators_then_trainers() -> None:
    roles = [role_for_rank(r, generators=3, trainers=2) for r in range(6)]
    assert roles == [
        "driver",
        "generator-0",
        "generator-1",
        "generator-2",
        "trainer-0",
        "trainer-1",
    ]
    with pytest.raises(ValueError, match="rank 6 has no role"):
        role_for_rank(6, generators=3, trainers=2)


def test_rendezvous_is_master_addr_at_master_port_plus_one() -> None:
    cfg = load_config(
        base=preset("flux", "flowgrpo", mode="disaggregated"), overrides=["runtime.generators=2"]
    )
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    assert _torchrun_world(env, cfg) == (3, 4, "127.0.0.1", 29501)
    env |= {"MASTER_ADDR": "10.0.0.5", "DIGEN_RPC_PORT": "31000"}
    assert _torchrun_world(env, cfg) == (3, 4, "10.0.0.5", 31000)
    colocated = load_config(base=preset("flux", "flowgrpo", mode="colocated"))
    with pytest.raises(DigenError, match="--mode disaggregated"):
        _torchrun_world(env, colocated)


def test_world_size_that_does_not_fit_the_config_is_one_sentence() -> None:
    from click.testing import CliRunner

    from cli.main import main

    # what torchrun gives every rank; the check runs before any process joins anything
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    args = ["run", "--mode", "disaggregated", "--quiet"]
    args += ["runtime.generators=2", "runtime.trainers=1"]
    res = CliRunner().invoke(main, args, env=env)
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    assert res.stderr.splitlines() == [
        "error: torchrun started WORLD_SIZE=3 processes but runtime.generators=2 and "
        "runtime.trainers=1 need 1 + 2 + 1 = 4 (one driver, one per generator, one per trainer)."
    ]


def test_torchrun_launch_runs_a_disaggregated_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"]
    args += ["-m", "cli.main", "run", "--mode", "disaggregated", "--steps", "1"]
    args += ["--out", str(out), "--quiet", *SMALL, "runtime.generators=1", "runtime.trainers=1"]
    res = subprocess.run(args, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    summary = json.loads(res.stdout.strip().splitlines()[-1])  # only rank 0 prints
    assert summary["steps"] == 1 and summary["weights"] == str(out / "lora")

    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 1 and json.loads(rows[0])["policy_version"] == 1
    events = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    done = Counter((e["kind"], e["worker"]) for e in events)
    # 2 prompts x 2 samples, one group per micro-batch with one generator: 2 of each; the
    # run's first trainer bubble makes one of them on trainer-0 (the TAG probe)
    assert done[("generate", "generator-0")] + done[("tag", "trainer-0")] == 2
    assert done[("tag", "trainer-0")] == 1
    assert done[("score", "generator-0")] == 2
    assert done[("update", "trainer-0")] == 2
    assert done[("step", "trainer-0")] == 1
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
