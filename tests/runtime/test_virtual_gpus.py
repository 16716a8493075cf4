"""GPU launches on virtual GPUs (tests/vgpu.py): every process believes its host has N CUDA
devices while tensors live on the CPU, so placement, process groups, device maps, FSDP and
the actors run their GPU paths here, and a device mix-up fails as it would on GPUs.

The mode's own checks first (each must bite), then three launches users run: a local
8-device disaggregated run with sharded trainers and broadcast weight sync, a torchrun
launch over 2 hosts x 4 devices with HSDP trainers, and (tests/runtime/test_elastic.py's
hold) a run that loses a generator and takes it back.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import vgpu
from helpers import free_port, torchrun_nodes

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--flavour", "tiny", "--quiet", "model.device=cuda", "rollout.n=2"]
SMALL += ["train.micro_batch_size=2", "rollout.num_inference_steps=3"]

_CHECKS = r"""
import json, torch
import vgpu

def refused(fn):
    try:
        fn()
    except vgpu.VirtualDeviceError as e:
        return str(e)
    return None

a = torch.ones(2, 3, device="cuda:1")
lin = torch.nn.Linear(3, 3).to("cuda:1")
torch.cuda.set_device(2)
out = {
    "count": torch.cuda.device_count(),
    "device": str(a.device),
    "moved": str(torch.zeros(2).to("cuda:3").device),
    "current": str(torch.zeros(2, device="cuda").device),
    "module": str(lin(a).device),
    "grad": None,
    "mix": refused(lambda: a + torch.ones(2, 3, device="cuda:0")),
    "host": refused(lambda: a * torch.ones(2, 3).cpu()),
    "other_module": refused(lambda: lin(torch.ones(2, 3, device="cuda:0"))),
    "missing": refused(lambda: torch.ones(2, device="cuda:4")),
    "scalar": refused(lambda: a * torch.tensor(2.0).cpu()),
    "index": refused(lambda: a[torch.tensor([1, 0]).cpu()]),
    "moved_back": str(a.cpu().device),
    "left_alone": str(torch.ones(2).device),
}
lin(a).sum().backward()
out["grad"] = str(lin.weight.grad.device)
print(json.dumps(out))
"""


def _python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_virtual_devices_answer_as_gpus_and_refuse_what_cuda_refuses() -> None:
    done = _python(_CHECKS, vgpu.env(4))
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["count"] == 4
    assert (got["device"], got["moved"], got["current"]) == ("cuda:1", "cuda:3", "cuda:2")
    assert got["module"] == got["grad"] == "cuda:1"
    assert got["moved_back"] == got["left_alone"] == "cpu"
    assert "cuda:0, cuda:1" in got["mix"]
    assert "cpu, cuda:1" in got["host"]
    assert "cuda:0, cuda:1" in got["other_module"]
    assert "cuda:4 does not exist" in got["missing"]
    assert got["scalar"] is None  # a 0-dim CPU tensor meets any device, as in torch
    assert got["index"] is None  # and CPU indices index a GPU tensor


_RPC = r"""
import json, os, sys, torch
import torch.distributed.rpc as rpc
import vgpu

def ones(device):
    return torch.ones(2, device=device)

def where(t):
    return str(t.device)

rank, port, case = int(sys.argv[1]), sys.argv[2], sys.argv[3]
names = ["a", "b"]
opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=60)
if case == "mapped" and rank == 0:
    opts.set_device_map("b", {"cuda:0": "cuda:1"})
if case == "unknown" and rank == 0:
    opts.set_device_map("c", {"cuda:0": "cuda:1"})
torch.cuda.set_device(rank)
try:
    rpc.init_rpc(names[rank], rank=rank, world_size=2, rpc_backend_options=opts)
except vgpu.VirtualDeviceError as e:
    print(json.dumps({"init": str(e)}))
if case == "unknown":  # the world never forms as one: both leave at once
    sys.stdout.flush()
    os._exit(0)
out = {}
if rank == 0:
    try:
        out["arrived"] = rpc.rpc_sync("b", where, args=(torch.ones(2, device="cuda:0"),))
    except vgpu.VirtualDeviceError as e:
        out["sent"] = str(e)
    out["staged"] = rpc.rpc_sync("b", where, args=(torch.ones(2, device="cuda:0").cpu(),))
    print(json.dumps(out))
rpc.shutdown()
"""


@pytest.mark.parametrize("case", ["mapped", "none", "unknown"])
def test_tensors_cross_rpc_only_where_a_device_map_says(tmp_path: Path, case: str) -> None:
    """A GPU tensor sent over RPC lands on the device the sender's map names for it; with no
    map it is refused (TensorPipe sends only CPU tensors then); a map naming a worker the
    world does not know is refused when the world forms."""
    script = tmp_path / "rpc_case.py"
    script.write_text(_RPC)
    port, env = str(free_port()), vgpu.env(2)
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), port, case],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in (0, 1)
    ]
    # What is tested is what rank 0 sees. Rank 1 only answers; how it leaves afterwards is a
    # race in torch, not here: rank 0 hosts the rendezvous store, and once it has left
    # (refusing the world at once, or done and shut down first) rank 1 may wait on the store
    # in vain, or fail to read its last reply. It is given a while, then stopped.
    try:
        out = procs[0].communicate(timeout=180)
        try:
            procs[1].communicate(timeout=30)
        except subprocess.TimeoutExpired:
            procs[1].kill()
            procs[1].communicate()
    finally:
        for p in procs:
            p.kill()
    first = json.loads(out[0].strip().splitlines()[-1])
    if case == "unknown":
        assert "name c, which the RPC world" in first["init"], out[1][-2000:]
        return
    assert procs[0].returncode == 0, out[1][-2000:]
    assert first["staged"] == "cpu"
    if case == "mapped":
        assert first["arrived"] == "cuda:1" and "sent" not in first
    else:
        assert "a sends a tensor on cuda:0 to b with no device map" in first["sent"]


def _by_worker(log: Path) -> dict[str, dict]:
    """Each worker's host, devices it set, and the groups it asked for (from the log)."""
    rows = vgpu.read_log(log)
    names = {r["pid"]: r["name"] for r in rows if r["kind"] == "world"}
    out: dict[str, dict] = defaultdict(lambda: {"hosts": set(), "devices": set(), "groups": []})
    for r in rows:
        name = names.get(r["pid"])
        if name is None:
            continue
        out[name]["hosts"].add(r["host"])
        if r["kind"] == "set_device":
            out[name]["devices"].add(r["device"])
        elif r["kind"] == "group":
            out[name]["groups"].append(r["backend"])
        elif r["kind"] == "world":
            assert r["unknown"] == [], r  # every device map names a worker of the world
    return dict(out)


@pytest.mark.slow
def test_eight_local_gpus_sharded_trainers_broadcast_sync(tmp_path: Path) -> None:
    """4 generators and 4 FSDP trainers on 8 virtual GPUs of one host, weights broadcast:
    each worker computes on the GPU placement gives it, GPU to GPU over device maps between
    every pair, the sharded group and the broadcast on NCCL, and nothing meets a tensor of
    another device."""
    from digen import load_config
    from digen.presets import preset
    from digen.runtime.placement import all_devices

    log, out = tmp_path / "virtual.jsonl", tmp_path / "out"
    extra = [
        "runtime.generators=4",
        "runtime.trainers=4",
        "runtime.placement.trainer_parallel=fsdp",
    ]
    extra += ["runtime.transport.weight_sync=broadcast"]
    args = [sys.executable, "-m", "cli.main", "run", "--mode", "disaggregated", "--steps", "2"]
    args += ["--out", str(out), *SMALL, *extra]
    done = subprocess.run(
        args, capture_output=True, text=True, env=vgpu.env(8, log), cwd=ROOT, timeout=900
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["steps"] == 2

    overrides = [a for a in SMALL + extra if "=" in a]
    cfg = load_config(base=preset("flux", "flowgrpo", mode="disaggregated"), overrides=overrides)
    want = all_devices(cfg, visible_gpus=8)
    assert sorted(set(want.values())) == [f"cuda:{i}" for i in range(8)]
    got = _by_worker(log)
    assert {w: info["devices"] for w, info in got.items() if w != "driver"} == {
        w: {d} for w, d in want.items()
    }
    maps = [r for r in vgpu.read_log(log) if r["kind"] == "device_map"]
    assert len(maps) == 8 * 7  # every worker to every other
    # the sharded group (the trainers' default group), and the broadcast group of trainer 0
    # (it sends) and the generators
    for w in want:
        sharded = ["cpu:gloo,cuda:nccl"] if w.startswith("trainer") else []
        broadcast = ["nccl"] if w == "trainer-0" or w.startswith("generator") else []
        assert sorted(got[w]["groups"]) == sorted(sharded + broadcast), (w, got[w])


@pytest.mark.slow
def test_torchrun_two_hosts_of_four_gpus_hsdp(tmp_path: Path) -> None:
    """Two torchrun agents as two hosts of 4 virtual GPUs (8 ranks: the driver, 1 generator,
    6 HSDP trainers sharded in pairs). Each rank takes its own node's ``cuda:LOCAL_RANK``:
    the generator and trainers 0-1 on host 0, trainers 2-5 on host 1 (the same device
    numbers on two hosts are two GPUs); the trainers' group is NCCL."""
    log, out = tmp_path / "virtual.jsonl", tmp_path / "out"
    extra = [
        "runtime.generators=1",
        "runtime.trainers=6",
        "runtime.placement.trainer_parallel=hsdp",
    ]
    extra += ["runtime.placement.shard_size=2"]
    run = ["-m", "cli.main", "run", "--mode", "disaggregated", "--steps", "1"]
    run += ["--out", str(out), *SMALL, *extra]
    env = vgpu.env(4, log, DIGEN_RPC_PORT=str(free_port()))
    nodes = torchrun_nodes(run, nodes=2, per_node=4, env=env, cwd=ROOT)
    try:
        results = [p.communicate(timeout=900) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in nodes] == [0, 0], results[0][1][-4000:]
    assert json.loads(results[0][0].strip().splitlines()[-1])["steps"] == 1

    got = _by_worker(log)
    placed = {w: (min(info["hosts"]), info["devices"]) for w, info in got.items()}
    assert placed == {
        "driver": ("vhost-0", set()),
        "generator-0": ("vhost-0", {"cuda:1"}),
        "trainer-0": ("vhost-0", {"cuda:2"}),
        "trainer-1": ("vhost-0", {"cuda:3"}),
        "trainer-2": ("vhost-1", {"cuda:0"}),
        "trainer-3": ("vhost-1", {"cuda:1"}),
        "trainer-4": ("vhost-1", {"cuda:2"}),
        "trainer-5": ("vhost-1", {"cuda:3"}),
    }
    assert all(len(info["hosts"]) == 1 for info in got.values())
    for t in range(6):
        assert got[f"trainer-{t}"]["groups"] == ["cpu:gloo,cuda:nccl"]


@pytest.mark.slow
def test_an_elastic_run_loses_a_generator_and_takes_it_back(tmp_path: Path) -> None:
    """``runtime.elastic.respawn_generators`` on virtual GPUs (2 generators and a trainer over 4
    devices): generator 1, killed holding work, starts again on the device placement gives
    it, joins, and the run ends; a dynamic world has no device maps, so every tensor crosses
    through the CPU (a GPU tensor sent would be refused)."""
    import os
    import signal

    import test_elastic
    from test_elastic import _start_held, _wait_for

    hook = tmp_path / "hold_in_hook.py"
    hook.write_text(test_elastic._HOLD_HOOK)
    log, out = tmp_path / "virtual.jsonl", tmp_path / "run"
    pause, paused = tmp_path / "pause", tmp_path / "paused"
    env = {k: v for k, v in vgpu.env(4, log).items() if os.environ.get(k) != v}
    env |= {"PAUSE_IN": "generator-0", "PAUSE": str(pause), "PAUSED": str(paused)}
    extra = (
        "model.device=cuda",
        "runtime.elastic.respawn_generators=true",
        "runtime.elastic.respawn_after_s=0.1",
    )
    proc, workers = _start_held(hook, out, *extra, hold_in="generator-1", hold_at=0, env=env)
    pause.write_text("")
    old = workers["generator-1"]["pid"]
    os.kill(old, signal.SIGKILL)
    _wait_for("generator 0 to pause", paused.is_file, proc)
    trainer_log = out / "trainer.log"
    _wait_for(
        "generator 1 to start again", lambda: "started again" in trainer_log.read_text(), proc
    )
    pause.unlink()
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "generator-1 is back. The run goes on with 2 generator(s)." in err

    rows = vgpu.read_log(log)
    assert not [r for r in rows if r["kind"] == "device_map"]
    worlds = {r["pid"]: r["name"] for r in rows if r["kind"] == "world"}
    devices = defaultdict(list)  # logical worker -> the device each of its processes set
    for r in rows:
        if r["kind"] == "set_device" and r["pid"] in worlds:
            name = worlds[r["pid"]]
            devices[name.split(":")[0].replace("_", "-")].append((r["pid"], r["device"]))
    gen1 = {pid: d for pid, d in devices["generator-1"]}
    assert old in gen1 and len(gen1) == 2  # the lost process and the one started again
    assert set(gen1.values()) == {"cuda:1"}  # both on the device placement gives it
    assert {d for _, d in devices["generator-0"]} == {"cuda:0"}
    assert {d for _, d in devices["trainer-0"]} == {"cuda:3"}


_EVAL_COPY = r"""
import json, torch
import vgpu
from digen.presets import preset
from digen import load_config
from digen.runtime.worker.policy import Policy

cfg = load_config(base=preset("flux", "nft", mode="disaggregated"),
                  overrides=["model.flavour=tiny", "model.device=cuda:1"])
policy = Policy(cfg, trainable=False)
named = policy.synced_parameters()
live = {n: p.detach().cpu().clone() for n, p in named}
average = {n: v + 1 for n, v in live.items()}
policy.set_eval_weights(average)
out = {"kept_on": sorted({str(vgpu.tag_of(t)) for t in policy.eval_weights})}
with policy.evaluation_weights():
    out["inside"] = all(torch.equal(p.detach().cpu(), average[n].to(p.dtype)) for n, p in named)
    out["device"] = sorted({str(p.device) for _, p in named})
out["after"] = all(torch.equal(p.detach().cpu(), live[n]) for n, p in named)
print(json.dumps(out))
"""


def test_a_generator_keeps_the_evaluation_average_on_the_host() -> None:
    """The moving average a generator evaluates with (``eval.ema``) waits on the host and is
    copied into the weights for each evaluation batch, the weights aside on the host: the
    GPU holds one copy of the model, not two; after the batch the weights are back, bit for
    bit."""
    done = _python(_EVAL_COPY, vgpu.env(2), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got == {"kept_on": ["cpu"], "inside": True, "device": ["cuda:1"], "after": True}


@pytest.mark.slow
def test_the_gpu_check_runs_its_gpu_paths_on_two_virtual_gpus(tmp_path: Path) -> None:
    """``benchmarks/gpu_check.py --device cuda`` as on a 2-GPU machine: its generators and
    trainers on GPUs of their own, the FSDP load's device peak in its verdict, and 2 FSDP
    trainers on the two GPUs trained alike with one (what only 2 GPUs show)."""
    args = [sys.executable, "benchmarks/gpu_check.py", "--quick", "--device", "cuda"]
    args += ["--out", str(tmp_path / "check")]
    done = subprocess.run(
        args, capture_output=True, text=True, env=vgpu.env(2), cwd=ROOT, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "check" / "report.json").read_text())
    assert report["passed"] is True
    assert report["equality"]["passed"] and report["logprob_drift"]["terms_over_bound"] == 0
    assert report["collectives"]["fsdp_load"]["passed"] is True
    sharded = report["sharded"]
    assert sharded["passed"] is True and 0 <= sharded["relative_difference"] <= 1e-2
