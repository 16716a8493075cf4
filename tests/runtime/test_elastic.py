"""Elastic generators: a run that loses a generator goes on without it, makes again what it
held from the same keys, and ends with the parameters and metrics of a run that never lost
it; losing every generator ends the run as a lost trainer does.

A reward hook holds the run at a known point: generator 1's scoring process holds in its
second scoring call, so generator 1 is killed holding work (the micro-batch being scored,
maybe more made behind it), and the run cannot end without remaking it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
from actor_classes import Accumulator, knows, pid_of
from helpers import digen_join, process_alive, read_jsonl, run_config, said_one_line
from safetensors.torch import load_file

from digen.runtime.transport.actors import ActorSystem, WorkerSpec
from digen.runtime.transport.actors import _system as system_module
from digen.runtime.transport.actors._transport import _TOKEN_KEY, wire

# whole runs of worker processes, one of them killed: minutes in all
# slow; one worker of `pytest -n` runs them all, so the module's reference run is made once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_elastic")]

STEPS = 3
_HOLD_HOOK = '''
import os, time
from pathlib import Path
from digen.rewards.builtin import jpeg_incompressibility

class HoldIn:
    """JPEG incompressibility. In the process named HOLD_IN (its role), call number HOLD_AT
    (from 0) writes HOLD_MARK and waits there, once per run (a process started again under
    that name does not), so a test acts on a run paused at a known point of one worker. In
    the process named PAUSE_IN, a call made while the file PAUSE exists writes PAUSED and
    waits until PAUSE is gone."""

    calls = 0

    def __call__(self, samples, prompts, metadata):
        me = Path("/proc/self/comm").read_text().strip()
        mark = Path(os.environ.get("HOLD_MARK", "/nonexistent"))
        at = int(os.environ.get("HOLD_AT", "-1"))
        if me == os.environ.get("HOLD_IN") and HoldIn.calls == at and not mark.exists():
            mark.write_text(str(os.getpid()))
            time.sleep(600)
        pause = Path(os.environ.get("PAUSE", "/nonexistent"))
        if me == os.environ.get("PAUSE_IN") and pause.exists():
            Path(os.environ["PAUSED"]).write_text(str(os.getpid()))
            while pause.exists():
                time.sleep(0.05)
        HoldIn.calls += 1
        return jpeg_incompressibility(samples, prompts, metadata)
'''

COMPARED = ("reward_mean", "reward_std", "reward_min", "reward_max", "loss", "grad_norm")


def _args(hook: Path, *extra: str) -> list[str]:
    args = ["--model", "sd3", "--mode", "disaggregated", "--steps", str(STEPS), "--quiet"]
    args += ["rollout.num_inference_steps=4", "runtime.generators=2", "runtime.schedule.tag=bts"]
    return [*args, "train.lr=1e-3", f"rewards=[{{name: '{hook}:HoldIn'}}]", *extra]


def _final(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step-{STEPS:06d}" / "weights.safetensors"))


@pytest.fixture(scope="module")
def hook(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hook") / "hold_in_hook.py"
    path.write_text(_HOLD_HOOK)
    return path


@pytest.fixture(scope="module")
def uninterrupted(hook: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list]:
    """The same run with no generator lost, through the API: final weights, metrics rows."""
    from digen import load_config

    overrides = [a for a in _args(hook) if "=" in a]
    cfg = load_config(None, overrides, {"steps": STEPS}, model="sd3", mode="disaggregated")
    out = tmp_path_factory.mktemp("whole") / "run"
    run_config(cfg, out)
    return _final(out), read_jsonl(out / "metrics.jsonl")


def _as_uninterrupted(out: Path, uninterrupted: tuple[dict, list]) -> list[dict]:
    """Check that the run in ``out`` ended with the parameters of the run that lost nothing,
    and every step's reward and loss statistics, bit for bit; its metrics rows."""
    want, rows_want = uninterrupted
    got = _final(out)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))
    for row, other in zip(rows, rows_want, strict=True):
        assert {k: row[k] for k in COMPARED} == {k: other[k] for k in COMPARED}
    return rows


def _start_held(
    hook: Path, out: Path, *extra: str, hold_in: str, hold_at: int = 1, env: dict | None = None
) -> tuple[subprocess.Popen, dict]:
    """Start a run and wait until ``hold_in``'s scoring process holds in its call number
    ``hold_at`` (from 0)."""
    mark = out.parent / "held"
    env = {**(env or {}), "HOLD_IN": hold_in, "HOLD_MARK": str(mark), "HOLD_AT": str(hold_at)}
    return _start(hook, out, *extra, env=env, until=mark)


def _start(
    hook: Path, out: Path, *extra: str, env: dict, until: Path
) -> tuple[subprocess.Popen, dict]:
    """Start a run (``env`` on top of this one's) and wait until it wrote its workers.json
    and the file ``until`` exists (a hold or a pause reached)."""
    cmd = [sys.executable, "-m", "cli.main", "run", "--out", str(out), *_args(hook, *extra)]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **env}
    )
    _wait_for("the hold", lambda: (out / "workers.json").is_file() and until.is_file(), proc)
    return proc, json.loads((out / "workers.json").read_text())


def test_a_run_that_loses_a_generator_ends_as_if_it_had_not(
    tmp_path: Path, hook: Path, uninterrupted: tuple[dict, list]
) -> None:
    out = tmp_path / "run"
    proc, workers = _start_held(hook, out, hold_in="generator-1")
    assert set(workers) == {"driver", "generator-0", "generator-1", "trainer-0"}
    os.kill(workers["generator-1"]["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    pid = workers["generator-1"]["pid"]
    assert f"worker 'generator-1' (pid {pid}) was killed by signal SIGKILL." in err
    assert "The run goes on with 1 generator(s)" in err
    rows = _as_uninterrupted(out, uninterrupted)
    rows_want = uninterrupted[1]
    # the loss as the metrics and the log tell it
    assert [r["generators_alive"] for r in rows_want] == [2] * STEPS
    alive = [r["generators_alive"] for r in rows]
    assert alive[-1] == 1 and alive == sorted(alive, reverse=True)
    assert sum(r["remade_microbatches"] for r in rows) >= 1  # at least the one held
    assert sum(r["remade_microbatches"] for r in rows_want) == 0
    events = [json.loads(line) for line in (out / "trainer.log").read_text().splitlines()]
    lost = [e for e in events if e.get("event") == "generator_lost"]
    assert len(lost) == 1 and lost[0]["worker"] == "generator-1"
    assert lost[0]["remade"] >= 1 and lost[0]["generators"] == 1
    assert _marks(out) == [("lost", "generator-1")]  # where its timeline lane ends


def test_losing_the_last_generator_ends_the_run_with_a_checkpoint(
    tmp_path: Path, hook: Path
) -> None:
    """One generator and no TAG: nothing is left to generate and score. Held in step 2's
    first scoring call, with the checkpoint of the first two steps written."""
    from digen import load_config
    from digen.config import schedule_plan

    out = tmp_path / "run"
    extra = ("runtime.generators=1", "runtime.schedule.tag=none", "save_every=1")
    overrides = [a for a in _args(hook, *extra) if "=" in a]
    cfg = load_config(None, overrides, {"steps": STEPS}, model="sd3", mode="disaggregated")
    hold_at = 2 * schedule_plan(cfg).microbatches
    proc, workers = _start_held(hook, out, *extra, hold_in="generator-0", hold_at=hold_at)
    _wait_for("step 2's checkpoint", (out / "checkpoints" / "step-000002").is_dir, proc)
    os.kill(workers["generator-0"]["pid"], signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    pid = workers["generator-0"]["pid"]
    assert f"worker 'generator-0' (pid {pid}) was killed by signal SIGKILL" in lines[0]
    assert "0 generator(s) left, fewer than runtime.elastic.min_generators (1)" in lines[0]
    assert "The last checkpoint is step-000002 (2 steps)" in lines[0]
    assert lines[0].endswith(f"continue with: digen run --resume {out}")


def _wait_for(what: str, ready, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 300
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"waited 300 s for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("sig", "extra"),
    [
        (signal.SIGKILL, ()),
        # a hung generator, lost to its heartbeat: its process is ended before the new one.
        # A live worker answers the pings on its RPC threads, which its compute does not
        # hold up for long: 10 s, as test_failures' 4 s, is far more than load delays them.
        (signal.SIGSTOP, ("runtime.transport.heartbeat_s=10",)),
    ],
)
def test_a_lost_generator_started_again_joins_and_the_run_ends_as_if_nothing_happened(
    tmp_path: Path, hook: Path, uninterrupted: tuple[dict, list], sig, extra
) -> None:
    """``runtime.elastic.respawn_generators``: generator 1, killed (or hung) holding work in its
    first scoring call, is started again and joins at a step boundary. Generator 0's
    scoring pauses from the loss (it must score what generator 1 held) until the new
    generator 1 is up, so the step cannot end, nor the run, before it joins, however loaded
    the machine is."""
    out, pause, paused = tmp_path / "run", tmp_path / "pause", tmp_path / "paused"
    env = {"PAUSE_IN": "generator-0", "PAUSE": str(pause), "PAUSED": str(paused)}
    extra = (
        "runtime.elastic.respawn_generators=true",
        "runtime.elastic.respawn_after_s=0.1",
        *extra,
    )
    proc, workers = _start_held(hook, out, *extra, hold_in="generator-1", hold_at=0, env=env)
    pause.write_text("")
    old = workers["generator-1"]["pid"]
    os.kill(old, sig)
    _wait_for("generator 0 to pause", paused.is_file, proc)
    log = out / "trainer.log"
    _wait_for("generator 1 to start again", lambda: "started again" in log.read_text(), proc)
    listed = json.loads((out / "workers.json").read_text())  # rewritten at the loss
    assert set(listed) == {"driver", "generator-0", "trainer-0"}, listed
    pause.unlink()
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "generator-1 is back. The run goes on with 2 generator(s)." in err
    rows = _as_uninterrupted(out, uninterrupted)
    assert rows[-1]["generators_alive"] == 2
    events = [json.loads(line) for line in log.read_text().splitlines()]
    lost = [e for e in events if e.get("event") == "generator_lost"]
    joined = [e for e in events if e.get("event") == "generator_joined"]
    assert [e["worker"] for e in lost] == ["generator-1"] and lost[0]["generators"] == 1
    assert [e["worker"] for e in joined] == ["generator-1"] and joined[0]["generators"] == 2
    # the new process made micro-batches with the weights it joined with, or later ones
    trace = read_jsonl(out / "trace.jsonl")
    after = [
        e
        for e in trace
        if e["worker"] == "generator-1"
        and e["kind"] == "generate"
        and e["version"] >= joined[0]["version"]
    ]
    assert after or joined[0]["version"] == STEPS, "the generator that joined made nothing"
    assert not process_alive(old)  # the lost process is gone, hung or not


def test_a_generator_that_joins_a_running_run_ends_it_as_if_it_had_been_there_all_along(
    tmp_path: Path, hook: Path, uninterrupted: tuple[dict, list]
) -> None:
    """``runtime.elastic.accept_generators``: a run started with one generator (micro-batches of the
    two-generator run's size) pauses in generator 0's first scoring call; a second process
    joins it by hand (``digen join`` with the rendezvous from workers.json) and joins the
    pool at the next step boundary. The run ends with the parameters and metrics of the run
    that had two generators all along, and the joiner ends with it.

    Joining takes the run's join secret, which the run made, wrote to ``join-secret``
    (readable by its owner only) and showed once: a process with another secret is refused
    in one sentence and takes no name."""
    out, pause, paused = tmp_path / "run", tmp_path / "pause", tmp_path / "paused"
    pause.write_text("")
    env = {"PAUSE_IN": "generator-0", "PAUSE": str(pause), "PAUSED": str(paused)}
    extra = (
        "runtime.generators=1",
        "runtime.schedule.samples_per_microbatch=4",  # the two-generator plan's micro-batches
        "runtime.elastic.accept_generators=true",
    )
    proc, workers = _start(hook, out, *extra, env=env, until=paused)
    rendezvous = workers["driver"]["rendezvous"]
    secret_file = out / "join-secret"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    secret = secret_file.read_text().strip()
    wrong = digen_join(rendezvous, env={"DIGEN_JOIN_SECRET": secret[::-1]})
    said_one_line(wrong, 1, f"error: the run at {rendezvous} refused this process: its join")
    joiner = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "join", rendezvous, "--secret-file", str(secret_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        log = out / "trainer.log"
        _wait_for("the joiner", lambda: "generator-1 (host " in log.read_text(), proc)
        pause.unlink()
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        _, joined_err = joiner.communicate(timeout=120)
    finally:
        joiner.kill()
    assert joiner.returncode == 0, joined_err[-3000:]
    assert f"joined the run at {rendezvous} as generator-1" in joined_err
    how = f"generators may join this run: digen join {rendezvous} --secret-file {secret_file}"
    assert how in err
    assert err.count(secret) == 1 and f"the run's join secret is {secret} " in err
    assert secret not in log.read_text()  # shown once, on the terminal; the log has its file
    refusals = [
        e["text"] for e in read_jsonl(log) if "without its join secret" in e.get("text", "")
    ]
    assert len(refusals) == 1, refusals
    assert "generator-1 joined. The run goes on with 2 generator(s)." in err
    rows = _as_uninterrupted(out, uninterrupted)
    # counted after each step's weight sync, where the joiner came in at the first
    assert [r["generators_alive"] for r in rows] == [2] * STEPS
    events = read_jsonl(log)
    joined = [e for e in events if e.get("event") == "generator_joined"]
    assert [(e["worker"], e["version"], e["restart"]) for e in joined] == [("generator-1", 1, 0)]
    trace = read_jsonl(out / "trace.jsonl")
    made = [e for e in trace if e["worker"] == "generator-1" and e["kind"] == "generate"]
    assert all(e["version"] >= 1 for e in made)
    assert _marks(out) == ([("joined", "generator-1")] if made else [])


def _marks(out: Path) -> list[tuple[str, str]]:
    """The lost / joined marks of the run's Chrome trace: (what, worker lane)."""
    doc = json.loads((out / "trace.json").read_text())["traceEvents"]
    lanes = {e["pid"]: e["args"]["name"] for e in doc if e["name"] == "process_name"}
    return [(e["name"], lanes[e["pid"]]) for e in doc if e["ph"] == "i"]


# --------------------------------------------------------------------------------------
# The elastic world under the runs
# --------------------------------------------------------------------------------------

GENERATORS = ["generator-0", "generator-1"]


def _members() -> list[str]:
    """The wire names on the dynamic world's list of members (what a joiner greets), as the
    driver's agent (this process's) keeps it in its store."""
    names = dist.PrefixStore("names", rpc.api._get_current_rpc_agent().store)
    entries = names.get("_ALL_WORKER_INFOS").decode().split(",")
    return sorted(entry.rsplit("-", 1)[0] for entry in entries if entry)


@pytest.mark.asyncio
async def test_each_process_of_a_worker_has_its_own_wire_name_and_none_is_forgotten() -> None:
    """A killed worker started twice: each process joins under a wire name of its own, so
    no name is taken again while a member still has tables for it; every member keeps the
    tables of the lost processes (nothing takes the leave path that erases them), the lost
    ones are off the list a joiner greets, and a worker's call by name reaches the newest."""
    system = ActorSystem([WorkerSpec(n) for n in GENERATORS], stop_timeout_s=1.0, elastic=True)
    await system.start()
    try:
        assert [wire(n) for n in GENERATORS] == ["generator_0:0", "generator_1:0"]
        for again in (1, 2):
            old, gone = system.pids()["generator-1"], wire("generator-1")
            os.kill(old, signal.SIGKILL)
            died = await asyncio.wait_for(system.next_loss(), 120)
            assert (died.worker, died.pid) == ("generator-1", old)
            await asyncio.wait_for(system.respawn("generator-1"), 300)
            new = system.pids()["generator-1"]
            assert wire("generator-1") == f"generator_1:{again}" != gone
            acc = system.actor("generator-1", Accumulator, 2)
            assert await acc.call("pid") == new != old
            lost = [f"generator_1:{n}" for n in range(again)]
            assert all(knows(name) for name in lost)  # the driver's tables
            for name in lost:  # and a worker's
                assert await system.run("generator-0", knows, name)
            assert await system.run("generator-0", pid_of, "generator-1") == new
            assert _members() == ["driver", "generator_0:0", f"generator_1:{again}"]
    finally:
        await system.stop()


@pytest.mark.asyncio
async def test_a_hung_worker_leaves_the_list_only_once_its_process_is_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker that stops answering (SIGSTOP) is lost to its heartbeat while its process
    still exists: it is killed and reaped first, and only then taken off the list of
    members; a restart then joins. The heartbeat is generous (the live worker is idle)."""
    unlisted: list[tuple[str, bool]] = []
    unlist = system_module._unlist

    def recorded(gone: str) -> None:
        unlisted.append((gone, process_alive(victim)))
        unlist(gone)

    monkeypatch.setattr(system_module, "_unlist", recorded)
    specs = [WorkerSpec(n) for n in GENERATORS]
    system = ActorSystem(specs, stop_timeout_s=1.0, elastic=True, heartbeat_s=10.0)
    await system.start()
    try:
        victim = system.pids()["generator-1"]
        os.kill(victim, signal.SIGSTOP)
        died = await asyncio.wait_for(system.next_loss(), 300)
        assert (died.worker, died.exitcode, died.silent_s) == ("generator-1", None, 10.0)
        await asyncio.wait_for(system.respawn("generator-1"), 300)
        assert unlisted == [("generator_1:0", False)]
        assert not process_alive(victim)
        acc = system.actor("generator-1", Accumulator, 2)
        assert await acc.call("pid") == system.pids()["generator-1"] != victim
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        await system.stop()


@pytest.mark.asyncio
async def test_a_failure_while_holding_the_membership_token_releases_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The list of members is edited holding the world's membership token, which every
    join takes too. An edit that fails (injected) is said by the restart that needed it,
    and leaves the token free: the next restart unlists and joins."""
    failing = True
    without = system_module._without

    def broken(members: str, gone: str) -> str:
        if failing:
            raise OSError("injected failure")
        return without(members, gone)

    monkeypatch.setattr(system_module, "_without", broken)
    system = ActorSystem([WorkerSpec(n) for n in GENERATORS], stop_timeout_s=1.0, elastic=True)
    await system.start()
    try:
        os.kill(system.pids()["generator-1"], signal.SIGKILL)
        await asyncio.wait_for(system.next_loss(), 120)
        with pytest.raises(RuntimeError, match=r"off the RPC world's list \(OSError: injected"):
            await asyncio.wait_for(system.respawn("generator-1"), 300)
        agent = rpc.api._get_current_rpc_agent()
        assert agent.store.get(_TOKEN_KEY) == b""  # free: joins are not blocked
        failing = False
        await asyncio.wait_for(system.respawn("generator-1"), 300)
        acc = system.actor("generator-1", Accumulator, 2)
        assert await acc.call("pid") == system.pids()["generator-1"]
        assert _members() == ["driver", "generator_0:0", "generator_1:1"]
    finally:
        await system.stop()


def test_an_elastic_world_stages_tensors_through_the_cpu() -> None:
    """Joins rewrite the agents' device tables while RPC threads read them, and a joiner
    has no map: an elastic world takes no device maps, and a run's cluster sets none."""
    from digen import load_config
    from digen.runtime.driver.cluster import Cluster

    mapped = WorkerSpec("generator-0", device_maps={"generator-1": {"cuda:0": "cuda:1"}})
    with pytest.raises(ValueError, match=r"stages tensors through the CPU.*\['generator-0'\]"):
        ActorSystem([mapped, WorkerSpec("generator-1")], elastic=True)
    ActorSystem([mapped, WorkerSpec("generator-1")])  # a static world may map devices
    for flag in (
        "runtime.elastic.respawn_generators=true",
        "runtime.elastic.accept_generators=true",
    ):
        overrides = ["runtime.generators=2", flag]
        cfg = load_config(None, overrides, {}, model="sd3", mode="disaggregated")
        cluster = Cluster(cfg, join_secret="0123456789abcdef")
        assert cluster.direct is False and cluster.system.elastic
        assert all(not w.device_maps for w in cluster.system.workers)
