"""`digen run` under torchrun: ranks mapped to roles, one real single-machine launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import free_port, read_jsonl, torchrun_nodes

from digen import load_config
from digen.errors import DigenError
from digen.presets import preset
from digen.runtime.transport.torchrun import role_for_rank, torchrun_world

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=3"]
SMALL.append("model.flavour=tiny")  # digen run's own default for flux is the shapes model


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
    # generators of 2 devices: each generator's processes in turn, then the trainers
    roles = [role_for_rank(r, generators=2, trainers=1, group=2) for r in range(6)]
    assert roles == [
        "driver",
        "generator-0",
        "generator-0:1",
        "generator-1",
        "generator-1:1",
        "trainer-0",
    ]


def test_rendezvous_is_master_addr_at_master_port_plus_one() -> None:
    cfg = load_config(
        base=preset("flux", "flowgrpo", mode="disaggregated"), overrides=["runtime.generators=2"]
    )
    env = {"RANK": "3", "WORLD_SIZE": "4", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    assert torchrun_world(env, cfg) == (3, 4, "127.0.0.1", 29501)
    env |= {"MASTER_ADDR": "10.0.0.5", "DIGEN_RPC_PORT": "31000"}
    assert torchrun_world(env, cfg) == (3, 4, "10.0.0.5", 31000)
    colocated = load_config(base=preset("flux", "flowgrpo", mode="colocated"))
    with pytest.raises(DigenError, match="--mode disaggregated"):
        torchrun_world(env, colocated)


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


@pytest.mark.slow
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
    events = read_jsonl(out / "trace.jsonl")
    done = Counter((e["kind"], e["worker"]) for e in events)
    # 2 prompts x 2 samples, one group per micro-batch with one generator: 2 of each; the
    # run's first trainer bubble makes one of them on trainer-0 (the TAG probe)
    assert done[("generate", "generator-0")] + done[("tag", "trainer-0")] == 2
    assert done[("tag", "trainer-0")] == 1
    assert done[("score", "scorer-0")] == 2  # on the scoring lane beside generator-0
    assert done[("update", "trainer-0")] == 2
    assert done[("step", "trainer-0")] == 2  # one per mini-batch (the preset's two)
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.slow
def test_a_worker_killed_on_another_node_stops_both_nodes_leaving_no_process(
    tmp_path: Path,
) -> None:
    """Two torchrun agents as two nodes (driver and generator-0 on node 0; generator-1 and
    trainer-0 on node 1). SIGKILL of trainer-0 on node 1: the driver names it and exits 1,
    both agents end, and no worker process of either node is left."""
    import signal
    import time

    from helpers import process_alive

    out = tmp_path / "out"
    run = ["-m", "cli.main", "run", "--mode", "disaggregated", "--steps", "200"]
    run += ["--out", str(out), "--quiet", *SMALL, "runtime.generators=2", "runtime.trainers=1"]
    run += ["save_every=1", "runtime.schedule.tag=none"]
    env = _env(DIGEN_RPC_PORT=str(free_port()))
    nodes = torchrun_nodes(run, nodes=2, per_node=2, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 240
        first = out / "checkpoints" / "step-000001"
        while not ((out / "workers.json").is_file() and first.is_dir()):
            for p in nodes:
                assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run did not reach its first checkpoint"
            time.sleep(0.1)
        workers = json.loads((out / "workers.json").read_text())
        assert set(workers) == {"driver", "generator-0", "generator-1", "trainer-0"}
        victim = workers["trainer-0"]["pid"]
        os.kill(victim, signal.SIGKILL)
        results = [p.communicate(timeout=120) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert nodes[0].returncode != 0 and nodes[1].returncode != 0
    lines = [x for x in results[0][1].splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, results[0][1][-3000:]
    assert "worker 'trainer-0'" in lines[0] and f"--resume {out}" in lines[0]
    deadline = time.monotonic() + 15
    while any(process_alive(w["pid"]) for w in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r for r, w in workers.items() if process_alive(w["pid"])]  # no orphan, either node
