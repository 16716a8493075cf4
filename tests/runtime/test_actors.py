"""The actor layer with real worker processes and real RPC (no mocks).

Start-up dominates the run time (each worker imports torch), so most tests share one
two-worker system (class-scoped); the tests that kill workers or the driver start their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import types
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from actor_classes import Accumulator, Broken, echo, where_am_i
from helpers import JOIN_SECRET, digen_join, free_port, said_one_line

from digen.runtime.transport.actors import (
    ActorHandle,
    ActorSystem,
    ActorSystemClosed,
    ExternalLaunch,
    WorkerDied,
    WorkerSpec,
)
from digen.runtime.transport.actors._system import Payload
from digen.runtime.transport.actors._transport import payload_bytes
from digen.runtime.transport.join_secret import SECRET_ENV


def _gone(pid: int) -> bool:
    """No such process, or only its zombie (an orphan's is reaped by whoever adopts it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


_DRIVER_SCRIPT = """
import asyncio, json, sys
from digen.runtime.transport.actors import ActorSystem, WorkerSpec

async def main():
    async with ActorSystem([WorkerSpec("generator-0"), WorkerSpec("trainer-0")]) as system:
        print(json.dumps(system.pids()), flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


@pytest.mark.slow
def test_workers_exit_when_the_driver_is_killed() -> None:
    driver = subprocess.Popen(
        [sys.executable, "-c", _DRIVER_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        line = driver.stdout.readline() if driver.stdout else ""
        assert line, "the driver did not start its workers"
        pids = json.loads(line)
        assert sorted(pids) == ["generator-0", "trainer-0"]
        driver.kill()  # no stop(), no atexit: only the workers' watch on their parent
        deadline = time.monotonic() + 5.0
        while not all(_gone(pid) for pid in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(_gone(pid) for pid in pids.values())
    finally:
        driver.kill()
        driver.wait(10)
        if driver.stdout:
            driver.stdout.close()


@pytest.mark.slow
@pytest.mark.asyncio
async def test_dead_workers_fail_calls_and_stop_leaves_no_process() -> None:
    names = ["generator-0", "generator-1", "trainer-0"]
    system = ActorSystem([WorkerSpec(n) for n in names], stop_timeout_s=1.0)
    await system.start()
    try:
        pids = system.pids()
        g0 = system.actor("generator-0", Accumulator, 2)
        g1 = system.actor("generator-1", Accumulator, 2)
        trainer = system.actor("trainer-0", Accumulator, 2)
        assert await g1.call("pid") == pids["generator-1"]
        # Still running when stop() comes: stop must not wait for it.
        stuck = asyncio.create_task(trainer.call("sleep", 30.0))

        lost = asyncio.create_task(system.lost())  # whoever dies first, call or no call
        pending = asyncio.create_task(g1.call("sleep", 30.0))
        await asyncio.sleep(0.2)  # the call is running in the worker
        assert not lost.done()
        os.kill(pids["generator-1"], signal.SIGKILL)
        # both end well before the 30 s sleep could have: the loss ended them, not the call
        assert (await asyncio.wait_for(lost, 20.0)).worker == "generator-1"
        with pytest.raises(WorkerDied, match="'generator-1'") as info:
            await asyncio.wait_for(pending, 20.0)
        assert str(info.value) == (
            f"worker 'generator-1' (pid {pids['generator-1']}) was killed by signal SIGKILL."
        )
        with pytest.raises(WorkerDied, match="'generator-1'"):  # later calls fail at once
            await g1.call("ping")

        # The other worker is untouched until it exits by itself, from inside a method.
        assert (await g0.call("add", torch.ones(2))).tolist() == [1.0, 1.0]
        with pytest.raises(WorkerDied) as info:
            await asyncio.wait_for(g0.call("exit_now", 3), 20.0)
        assert str(info.value) == (
            f"worker 'generator-0' (pid {pids['generator-0']}) died with exit code 3."
        )
        assert sorted(system.dead()) == ["generator-0", "generator-1"]
        assert (await system.lost()).worker == "generator-1"  # the first stays the first
    finally:
        start = time.perf_counter()
        await system.stop()
        stop_s = time.perf_counter() - start
    assert stop_s < 20.0  # it did not wait for the call stuck in a 30 s sleep
    with pytest.raises(ActorSystemClosed):
        await stuck
    assert all(_gone(pid) for pid in pids.values())
    await system.stop()  # idempotent
    assert system.statistics()["state"] == "stopped"
    with pytest.raises(ActorSystemClosed):
        await g0.call("ping")


@contextlib.contextmanager
def _ghost_module() -> Iterator[type]:
    """A class importable in this process only (its module exists just in sys.modules)."""
    module = types.ModuleType("digen_test_ghost")
    ghost = type("Ghost", (), {"__module__": module.__name__})
    module.Ghost = ghost
    sys.modules[module.__name__] = module
    try:
        yield ghost
    finally:
        del sys.modules[module.__name__]


@pytest_asyncio.fixture(loop_scope="class", scope="class")
async def system() -> AsyncIterator[ActorSystem]:
    workers = [
        WorkerSpec("generator-0"),
        WorkerSpec("trainer-0", threads=2, env={"DIGEN_TEST_MARK": "trainer"}),
    ]
    async with ActorSystem(workers) as system:
        yield system
    assert all(_gone(pid) for pid in system.pids().values())


@pytest.mark.asyncio(loop_scope="class")
class TestSharedSystem:
    async def test_calls_keep_state_and_round_trip_tensors(self, system: ActorSystem) -> None:
        acc = system.actor("generator-0", Accumulator, 3, start=0.5)
        x = torch.tensor([1.0, 2.0, 3.0])
        assert (await acc.call("add", x)).tolist() == [1.5, 2.5, 3.5]
        assert (await acc.call("add", x)).tolist() == [2.5, 4.5, 6.5]
        big = torch.arange(100_000, dtype=torch.float32)
        other = system.actor("trainer-0", Accumulator, 100_000)
        assert torch.equal(await other.call("add", big), big)

    async def test_spec_sets_threads_and_env(self, system: ActorSystem) -> None:
        gen = system.actor("generator-0", Accumulator, 1)
        trainer = system.actor("trainer-0", Accumulator, 1)
        assert await gen.call("threads") == (1, None)
        assert await trainer.call("threads") == (2, "trainer")
        assert await trainer.call("pid") == system.pids()["trainer-0"]

    async def test_calls_to_one_actor_are_serialised(self, system: ActorSystem) -> None:
        acc = system.actor("generator-0", Accumulator, 1)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(acc.call("bump") for _ in range(8)))
        assert counts == list(range(1, 9))  # each read-sleep-write saw the one before
        assert time.perf_counter() - t0 >= 8 * 0.05

    async def test_actors_on_different_workers_run_in_parallel(
        self, system: ActorSystem, tmp_path: Path
    ) -> None:
        a = system.actor("generator-0", Accumulator, 1)
        b = system.actor("trainer-0", Accumulator, 1)
        here, there = str(tmp_path / "a"), str(tmp_path / "b")
        # each waits for the other to arrive: both meet only if the two calls run at once
        met = await asyncio.gather(
            a.call("meet", here, there, 60.0), b.call("meet", there, here, 60.0)
        )
        assert met == [True, True]

    async def test_a_busy_actor_leaves_its_worker_responsive(self, system: ActorSystem) -> None:
        busy = system.actor("generator-0", Accumulator, 1)
        other = system.actor("generator-0", Accumulator, 1)
        await asyncio.gather(busy.call("ping"), other.call("ping"))
        # the busy actor keeps its thread until the other one releases it, with more calls
        # queued behind than the worker has RPC threads: were the worker's actors served one
        # after another, the release could not arrive and the hold would time out (False)
        backlog = [asyncio.create_task(busy.call("hold", 60.0))]
        backlog += [asyncio.create_task(busy.call("bump")) for _ in range(24)]  # > RPC threads
        assert await other.call("holding", 60.0)
        await other.call("ping")
        await system.run("generator-0", where_am_i, 1, 1)
        await other.call("release")
        assert await asyncio.gather(*backlog) == [True, *range(1, 25)]

    async def test_remote_errors_keep_their_type(self, system: ActorSystem) -> None:
        acc = system.actor("trainer-0", Accumulator, 1)
        with pytest.raises(ValueError) as info:
            await acc.call("fail", "bad value 7")
        assert str(info.value) == "bad value 7"
        assert "Raised in worker 'trainer-0'" in info.value.__notes__[0]
        with pytest.raises(AttributeError, match="no_such_method"):
            await acc.call("no_such_method")
        broken = system.actor("generator-0", Broken)
        with pytest.raises(KeyError, match="no such thing"):
            await broken.call("anything")
        assert await acc.call("add", torch.ones(1)) == torch.ones(1)  # the actor lives on

    async def test_workers_call_each_other(self, system: ActorSystem) -> None:
        gen = system.actor("generator-0", Accumulator, 2)
        trainer = system.actor("trainer-0", Accumulator, 2, start=10.0)
        got = await gen.call("ask_peer", trainer, torch.tensor([1.0, 2.0]))
        assert got.tolist() == [11.0, 12.0]
        assert (await trainer.call("add", torch.zeros(2))).tolist() == [11.0, 12.0]
        assert await gen.call("run_on", "trainer-0", 6, 7) == (system.pids()["trainer-0"], 42)
        assert await system.run("generator-0", where_am_i, 2, 3) == (
            system.pids()["generator-0"],
            6,
        )

    async def test_handles_travel_as_addresses(self, system: ActorSystem) -> None:
        acc = system.actor("trainer-0", Accumulator, 1)
        copy = pickle.loads(pickle.dumps(acc))
        assert isinstance(copy, ActorHandle)
        assert (copy.worker, copy.actor_id) == (acc.worker, acc.actor_id)
        back = await system.run("generator-0", echo, acc)  # out to a worker and home again
        assert (back.worker, back.actor_id) == (acc.worker, acc.actor_id)
        assert (await back.call("add", torch.ones(1))).tolist() == [1.0]

    async def test_class_the_worker_cannot_import_fails_fast(self, system: ActorSystem) -> None:
        with _ghost_module() as ghost:
            handle = system.actor("generator-0", ghost)
            with pytest.raises(ModuleNotFoundError, match="digen_test_ghost"):
                await asyncio.wait_for(handle.call("anything"), 5.0)

    async def test_argument_the_worker_cannot_import_does_not_block_the_actor(
        self, system: ActorSystem, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        acc = system.actor("generator-0", Accumulator, 1)
        deaths = []  # a transport error makes the system wait for the worker's exit status
        real = system._death_of

        async def death_of(worker: str) -> Any:
            deaths.append(worker)
            return await real(worker)

        monkeypatch.setattr(system, "_death_of", death_of)
        with (
            _ghost_module() as ghost,
            pytest.raises(RuntimeError, match="No module named 'digen_test_ghost'"),
        ):
            await asyncio.wait_for(acc.call("add", ghost()), 5.0)
        assert deaths == []  # the caller's error, not mistaken for a dying worker
        # The lost call gave up its turn, so the next ones are not left waiting for it.
        assert await asyncio.wait_for(acc.call("add", torch.ones(1)), 5.0) == torch.ones(1)

    async def test_driver_calls_run_in_the_order_made(self, system: ActorSystem) -> None:
        acc = system.actor("trainer-0", Accumulator, 1)
        await asyncio.gather(*(acc.call("record", i) for i in range(40)))
        assert await acc.call("records") == list(range(40))

    async def test_unknown_worker_and_second_system_are_rejected(self, system: ActorSystem) -> None:
        with pytest.raises(KeyError, match="trainer-9"):
            system.actor("trainer-9", Accumulator, 1)
        with pytest.raises(RuntimeError, match="another ActorSystem is running"):
            await ActorSystem([WorkerSpec("generator-9")]).start()

    async def test_only_loopback_listens(self, system: ActorSystem) -> None:
        psutil = pytest.importorskip("psutil")
        pids = [os.getpid(), *system.pids().values()]
        listening = [
            c.laddr.ip
            for pid in pids
            for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening  # the store, TensorPipe and gloo listeners
        assert set(listening) == {"127.0.0.1"}

    async def test_statistics_count_calls(self, system: ActorSystem) -> None:
        before = system.statistics()["calls"]
        acc = system.actor("generator-0", Accumulator, 1)
        await asyncio.gather(*(acc.call("ping") for _ in range(5)))
        stats = system.statistics()
        assert stats["calls"] - before == 5 + 1  # five calls and one construction
        assert stats["pending"] == {"generator-0": 0, "trainer-0": 0}
        assert stats["state"] == "running" and stats["dead"] == []
        assert stats["payload"] == system.payload

    async def test_payload_counts_tensor_storage_apart_from_the_rest(
        self, system: ActorSystem
    ) -> None:
        acc = system.actor("generator-0", Accumulator, 250_000)
        await acc.call("ping")
        x = torch.ones(250_000)  # 1 MB of float32

        before = system.payload
        await acc.call("record", x)  # a tensor out, None back
        moved = system.payload - before
        assert (moved.sent_tensor_bytes, moved.received_tensor_bytes) == (1_000_000, 0)
        assert moved.sent_other_bytes > 0
        assert moved.received_other_bytes == len(pickle.dumps(None))

        before = system.payload
        await acc.call("add", x)  # and a 1 MB tensor back
        moved = system.payload - before
        assert (moved.sent_tensor_bytes, moved.received_tensor_bytes) == (1_000_000, 1_000_000)

        before = system.payload
        assert await system.run("generator-0", where_am_i, 2, 3) == (
            system.pids()["generator-0"],
            6,
        )
        moved = system.payload - before
        assert (moved.sent_tensor_bytes, moved.received_tensor_bytes) == (0, 0)
        assert moved.sent_other_bytes > 0
        assert moved.received_other_bytes == len(pickle.dumps((system.pids()["generator-0"], 6)))
        assert moved.megabytes == (moved.sent_other_bytes + moved.received_other_bytes) / 1e6

    async def test_payload_counts_tensors_as_they_cross(self, system: ActorSystem) -> None:
        async def echoed(value: object) -> tuple[object, Payload]:
            before = system.payload
            back = await system.run("generator-0", echo, value)
            return back, system.payload - before

        small = torch.arange(1000, dtype=torch.float32)
        # A view of a small storage ships the whole storage, once however many views share it.
        back, moved = await echoed(small[:10])
        assert (moved.sent_tensor_bytes, moved.received_tensor_bytes) == (4000, 4000)
        assert back.untyped_storage().nbytes() == 4000  # what the worker got, and sent back
        back, moved = await echoed({"a": small, "b": [small, small[10:20]]})
        assert (moved.sent_tensor_bytes, moved.received_tensor_bytes) == (4000, 4000)
        assert back["b"][1].untyped_storage().data_ptr() == back["a"].untyped_storage().data_ptr()

        # A small view of a big storage is copied before it is sent (torch's rule).
        big = torch.zeros(1_000_000)
        back, moved = await echoed(big[:10])
        assert (moved.sent_tensor_bytes, moved.received_tensor_bytes) == (40, 40)
        assert back.untyped_storage().nbytes() == 40
        view = big[:10]
        back, moved = await echoed((view, view, big[10:20]))  # one copy per view object
        assert (moved.sent_tensor_bytes, moved.received_tensor_bytes) == (80, 80)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_an_elastic_system_starts_a_lost_worker_again_under_its_name() -> None:
    """A dynamic RPC world: a killed worker is started again, a new process under its
    name, twice; the new one answers calls, the others keep their state, each loss is
    reported once, and stop leaves no process."""
    names = ["generator-0", "generator-1", "trainer-0"]
    system = ActorSystem([WorkerSpec(n) for n in names], stop_timeout_s=1.0, elastic=True)
    await system.start()
    pids = [system.pids()]
    try:
        keeper = system.actor("generator-0", Accumulator, 2)
        assert (await keeper.call("add", torch.ones(2))).tolist() == [1.0, 1.0]
        for again in (1, 2):
            victim = system.actor("generator-1", Accumulator, 2, 10.0 * again)
            assert await victim.call("pid") == pids[-1]["generator-1"]
            os.kill(pids[-1]["generator-1"], signal.SIGKILL)
            died = await asyncio.wait_for(system.next_loss(), 60)
            assert (died.worker, died.pid) == ("generator-1", pids[-1]["generator-1"])
            with pytest.raises(WorkerDied):
                await victim.call("ping")
            with pytest.raises(RuntimeError, match="not lost"):
                await system.respawn("generator-0")
            await asyncio.wait_for(system.respawn("generator-1"), 120)
            pids.append(system.pids())
            assert pids[-1]["generator-1"] != pids[-2]["generator-1"]
            assert pids[-1]["generator-0"] == pids[0]["generator-0"]
            reborn = system.actor("generator-1", Accumulator, 2, 100.0 * again)
            assert await reborn.call("pid") == pids[-1]["generator-1"]
            assert (await reborn.call("add", torch.ones(2))).tolist() == [100.0 * again + 1] * 2
            total = await keeper.call("add", torch.ones(2))  # untouched all along
            assert total.tolist() == [1.0 + again] * 2
        assert system.dead() == {}
        assert system._losses is not None and system._losses.empty()  # each loss once
    finally:
        await system.stop()
    assert all(_gone(pid) for p in pids for pid in p.values())


_JOINER_SCRIPT = """
import os, sys
from digen.runtime.transport.actors import join_world
wait = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
name = join_world(
    "127.0.0.1",
    int(sys.argv[1]),
    secret=os.environ["DIGEN_JOIN_SECRET"],
    wait_s=wait,
    on_joined=lambda n: print(n, flush=True),
)
print("served", name, flush=True)
os._exit(0)
"""


def _start_joiner(port: int, wait_s: float = 60.0) -> subprocess.Popen:
    """A process that joins the running world at ``port`` by itself with the join secret (as
    one started by hand on another machine would), with the test's classes importable."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, SECRET_ENV: JOIN_SECRET}
    cmd = [sys.executable, "-c", _JOINER_SCRIPT, str(port), str(wait_s)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_an_elastic_system_takes_workers_that_join_it_while_it_runs() -> None:
    """Processes started by someone else join the running world under the next free name
    of the offered pool, with its environment; they take actors and calls like any worker.
    A joiner's loss is reported like any other, and a later joiner still gets in (the lost
    member left the world); stop ends the one left."""
    joiner = WorkerSpec("generator", env={"DIGEN_TEST_OFFER": "joined"})
    specs = [WorkerSpec("generator-0"), WorkerSpec("trainer-0")]
    system = ActorSystem(
        specs, stop_timeout_s=1.0, elastic=True, joiners=joiner, join_secret=JOIN_SECRET
    )
    await system.start()
    procs: list[subprocess.Popen] = []
    try:
        keeper = system.actor("generator-0", Accumulator, 2)
        assert (await keeper.call("add", torch.ones(2))).tolist() == [1.0, 1.0]
        assert system.port is not None
        # a wrong secret is refused in one sentence, and takes no name (the next is -1)
        where = f"127.0.0.1:{system.port}"
        wrong = {SECRET_ENV: "not-the-secret-of-this-world"}
        done = await asyncio.to_thread(digen_join, where, env=wrong)
        said_one_line(done, 1, f"error: the run at {where} refused this process: its join secret")
        for n in (1, 2):
            procs.append(_start_joiner(system.port))
            arrival = await asyncio.wait_for(system.next_arrival(), 300)
            assert (arrival.name, arrival.pid) == (f"generator-{n}", procs[-1].pid)
            assert system.pids()[arrival.name] == procs[-1].pid
            acc = system.actor(arrival.name, Accumulator, 2, 10.0 * n)
            assert await acc.call("pid") == procs[-1].pid
            assert (await acc.call("add", torch.ones(2))).tolist() == [10.0 * n + 1] * 2
            assert await system.run(arrival.name, os.getenv, "DIGEN_TEST_OFFER") == "joined"
            if n == 1:
                os.kill(procs[0].pid, signal.SIGKILL)
                died = await asyncio.wait_for(system.next_loss(), 300)
                assert (died.worker, died.pid) == ("generator-1", procs[0].pid)
                with pytest.raises(WorkerDied):
                    await acc.call("ping")
                with pytest.raises(RuntimeError, match="not started here"):
                    await system.respawn("generator-1")
        total = await keeper.call("add", torch.ones(2))  # untouched all along
        assert total.tolist() == [2.0, 2.0]
        assert sorted(system.dead()) == ["generator-1"]
    finally:
        await system.stop()
    out, err = procs[1].communicate(timeout=120)
    assert procs[1].returncode == 0, err[-3000:]
    assert out.split() == ["generator-2", "served", "generator-2"]


HAS_SECRET = {SECRET_ENV: JOIN_SECRET}


@pytest.mark.parametrize(
    ("args", "env", "code", "said"),
    [
        (["nowhere"], HAS_SECRET, 2, "error: 'nowhere' is not ADDRESS:PORT (e.g. 10.0.0.5:29400)"),
        (["127.0.0.1:99999"], HAS_SECRET, 2, "error: '127.0.0.1:99999' is not ADDRESS:PORT"),
        (["127.0.0.1:{port}", "--threads", "0"], HAS_SECRET, 2, "error: --threads must be at"),
        (["127.0.0.1:{port}", "--device", "gpu0"], HAS_SECRET, 2, "error: --device 'gpu0' is not"),
        (["127.0.0.1:{port}", "--wait", "1"], HAS_SECRET, 1, "error: no run is listening at"),
        (
            ["127.0.0.1:{port}"],
            {},
            2,
            "error: digen join needs the run's join secret: pass --secret-file FILE",
        ),
        (["127.0.0.1:{port}"], {SECRET_ENV: "  "}, 2, "error: digen join needs the run's join"),
        (
            ["127.0.0.1:{port}"],
            {SECRET_ENV: "short"},
            2,
            f"error: {SECRET_ENV} holds a join secret of 5 characters; use at least 16",
        ),
        (
            ["127.0.0.1:{port}", "--secret-file", "{dir}/absent"],
            HAS_SECRET,  # a file named is read, whatever the environment holds
            2,
            "error: --secret-file '{dir}/absent' cannot be read: no such file or directory.",
        ),
        (
            ["127.0.0.1:{port}", "--secret-file", "{dir}/short"],
            {},
            2,
            "error: --secret-file '{dir}/short' holds a join secret of 3 characters",
        ),
    ],
)
def test_digen_join_says_what_is_wrong_in_one_line(
    tmp_path, args: list[str], env: dict[str, str], code: int, said: str
) -> None:
    (tmp_path / "short").write_text("abc\n")
    port = str(free_port())
    fill = lambda a: a.replace("{port}", port).replace("{dir}", str(tmp_path))  # noqa: E731
    said_one_line(digen_join(*map(fill, args), env=env), code, fill(said))


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_running_world_that_takes_no_joiners_refuses_one() -> None:
    async with ActorSystem([WorkerSpec("generator-0")], stop_timeout_s=1.0) as system:
        assert system.port is not None
        proc = _start_joiner(system.port, wait_s=3.0)  # no hello comes: it waits all of it
        _, err = await asyncio.to_thread(proc.communicate, timeout=300)
    assert proc.returncode == 1
    assert (
        "takes no joining workers (it must be started with runtime.elastic.accept_generators=true)"
        in err
    )


def test_worker_spec_checks_its_fields() -> None:
    with pytest.raises(ValueError, match="'driver'"):
        WorkerSpec("driver")
    with pytest.raises(ValueError, match="threads=0"):
        WorkerSpec("generator-0", threads=0)
    with pytest.raises(ValueError, match="repeated"):
        ActorSystem([WorkerSpec("a"), WorkerSpec("a")])
    joiners = WorkerSpec("generator")
    with pytest.raises(ValueError, match="needs a join secret"):
        ActorSystem([WorkerSpec("generator-0")], elastic=True, joiners=joiners)
    with pytest.raises(ValueError, match="join_secret holds a join secret of 5 characters"):
        ActorSystem([WorkerSpec("generator-0")], elastic=True, joiners=joiners, join_secret="short")


@dataclass
class _Batch:
    images: torch.Tensor
    steps: list


class _Slotted:
    __slots__ = ("latents", "name")

    def __init__(self, latents: torch.Tensor, name: str) -> None:
        self.latents, self.name = latents, name


def test_payload_bytes_sizes_tensors_as_tensorpipe_ships_them() -> None:
    x = torch.ones(250_000)  # 1 MB of float32
    assert payload_bytes(x)[0] == 1_000_000
    assert payload_bytes(torch.ones(10, dtype=torch.bfloat16))[0] == 20
    # Reachable anywhere, counted once per storage: dataclasses, slots, containers, views.
    small = torch.arange(1000, dtype=torch.float32)
    nested = {"batch": _Batch(small[:10], [small]), "slots": _Slotted(small[500:], "s")}
    assert payload_bytes([nested, (small, small.view(10, 100))])[0] == 4000
    assert payload_bytes((x, small, x))[0] == 1_004_000
    # Small views of big storages are copied before sending: their own bytes, per view.
    big = torch.zeros(1_000_000)
    assert payload_bytes(big[:10])[0] == 40
    view = big[:10]
    assert payload_bytes((view, view, big[10:20]))[0] == 80
    assert payload_bytes(big[:600_000])[0] == 4_000_000  # more than half of it: all of it
    assert payload_bytes(torch.ones(1).expand(5000))[0] == 4  # one element, seen 5000 times
    # No plain storage (sparse): its indices and values count.
    assert payload_bytes(torch.ones(3).to_sparse())[0] == 3 * 8 + 3 * 4


def test_payload_bytes_other_bytes_are_the_pickled_rest() -> None:
    plain = {"prompt": "a cat", "steps": list(range(40)), "cfg": 4.5}
    assert payload_bytes(plain) == (0, len(pickle.dumps(plain)))
    with_tensor = payload_bytes({**plain, "x": torch.ones(250_000)})
    assert with_tensor[0] == 1_000_000
    assert len(pickle.dumps(plain)) < with_tensor[1] < len(pickle.dumps(plain)) + 100
    # What cannot be pickled counts what came before it, and never raises.
    assert payload_bytes((torch.ones(10), lambda: 0))[0] == 40

    class Refuses:
        def __reduce__(self) -> tuple:
            raise ValueError("not today")

    assert payload_bytes([torch.ones(5), Refuses(), torch.ones(100)])[0] == 20


def test_payload_subtracts_and_sums_to_megabytes() -> None:
    later, earlier = Payload(4_000_000, 2_000, 1_000_000, 500), Payload(1_000_000, 1_000, 0, 0)
    assert later - earlier == Payload(3_000_000, 1_000, 1_000_000, 500)
    assert (later - earlier).megabytes == 4.0015
    assert earlier + (later - earlier) == later
    assert Payload().megabytes == 0.0


# --- external launch: workers someone else started (what torchrun does) -------------------

_EXTERNAL_WORKER = """
import os, sys
from digen.runtime.transport.actors import WorkerSpec, serve_worker

name, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
serve_worker(WorkerSpec(name), rank, world, "127.0.0.1", port, start_timeout_s=60.0)
print("served", flush=True)
os._exit(0)
"""

_EXTERNAL_DRIVER = """
import asyncio, sys
from digen.runtime.transport.actors import ActorSystem, ExternalLaunch, WorkerSpec

async def main():
    launch = ExternalLaunch("127.0.0.1", int(sys.argv[1]), 3)
    async with ActorSystem([WorkerSpec("generator-0"), WorkerSpec("trainer-0")], launch=launch):
        print("ready", flush=True)
        await asyncio.sleep(60)

asyncio.run(main())
"""


def _external_worker(name: str, rank: int, world: int, port: int) -> subprocess.Popen:
    here = os.path.dirname(os.path.abspath(__file__))  # actor_classes must import there
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(
        [sys.executable, "-c", _EXTERNAL_WORKER, name, str(rank), str(world), str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _reap(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.slow
@pytest.mark.asyncio
async def test_external_launch_serves_started_workers_and_reports_a_dead_one() -> None:
    port = free_port()
    names = ["generator-0", "trainer-0"]
    procs = {n: _external_worker(n, rank, 3, port) for rank, n in enumerate(names, start=1)}
    launch = ExternalLaunch("127.0.0.1", port, 3)
    system = ActorSystem([WorkerSpec(n) for n in names], launch=launch, stop_timeout_s=1.0)
    try:
        await system.start()
        assert system.pids() == {}  # nothing spawned here
        gen = system.actor("generator-0", Accumulator, 2)
        trainer = system.actor("trainer-0", Accumulator, 2)
        assert await gen.call("pid") == procs["generator-0"].pid
        assert await trainer.call("pid") == procs["trainer-0"].pid

        pending = asyncio.create_task(gen.call("sleep", 30.0))
        await asyncio.sleep(0.2)  # the call is running in the worker
        procs["generator-0"].kill()
        with pytest.raises(WorkerDied) as info:  # well before the 30 s sleep could end
            await asyncio.wait_for(pending, 20.0)
        assert str(info.value) == (
            "worker 'generator-0' (pid unknown: started by an external launcher) stopped answering."
        )
        with pytest.raises(WorkerDied, match="'generator-0'"):  # later calls fail at once
            await asyncio.wait_for(gen.call("ping"), 1.0)
        assert (await trainer.call("add", torch.ones(2))).tolist() == [1.0, 1.0]
    finally:
        start = time.perf_counter()
        await system.stop()
        stop_s = time.perf_counter() - start
        try:
            # the live worker got the stop handshake and returned from serve_worker
            out, err = procs["trainer-0"].communicate(timeout=10)
        finally:
            _reap(list(procs.values()))
    assert stop_s < 20.0  # it did not wait for the call stuck in a 30 s sleep
    assert procs["trainer-0"].returncode == 0 and out == "served\n", err


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_worker_lost_behind_another_workers_call_is_found_and_named() -> None:
    """generator-0's actor is inside a call to trainer-0 when trainer-0 is killed: the driver
    hears only generator-0's transport error, which names nobody. With external launch and a
    heartbeat too slow to have noticed, ``lost_behind`` probes the workers and names
    trainer-0; an error that is not the transport's is explained by no one."""
    port = free_port()
    names = ["generator-0", "trainer-0"]
    procs = {n: _external_worker(n, rank, 3, port) for rank, n in enumerate(names, start=1)}
    launch = ExternalLaunch("127.0.0.1", port, 3)
    system = ActorSystem(
        [WorkerSpec(n) for n in names], launch=launch, heartbeat_s=3600.0, stop_timeout_s=1.0
    )
    try:
        await system.start()
        gen = system.actor("generator-0", Accumulator, 2)
        trainer = system.actor("trainer-0", Accumulator, 2)
        assert await trainer.call("ping") is None
        with pytest.raises(ValueError, match="on purpose") as info:
            await gen.call("fail", "on purpose")
        assert await system.lost_behind(info.value) is None  # everyone answers

        relayed = asyncio.create_task(gen.call("ask_peer_to", trainer, "sleep", 600.0))
        await asyncio.sleep(0.5)  # the relayed call is running in trainer-0
        procs["trainer-0"].kill()
        with pytest.raises(Exception) as info:
            await asyncio.wait_for(relayed, 120.0)
        assert not isinstance(info.value, WorkerDied)  # generator-0 is alive and answered
        assert system.dead() == {}  # nothing has noticed trainer-0 yet
        died = await asyncio.wait_for(system.lost_behind(info.value), 120.0)
        assert died is not None and died.worker == "trainer-0", info.value
        assert list(system.dead()) == ["trainer-0"]
        assert (await gen.call("add", torch.ones(2))).tolist() == [1.0, 1.0]
    finally:
        await system.stop()
        _reap(list(procs.values()))


@pytest.mark.slow
def test_external_workers_exit_when_the_driver_is_gone() -> None:
    port = free_port()
    driver = subprocess.Popen(
        [sys.executable, "-c", _EXTERNAL_DRIVER, str(port)], stdout=subprocess.PIPE, text=True
    )
    workers = [
        _external_worker("generator-0", 1, 3, port),
        _external_worker("trainer-0", 2, 3, port),
    ]
    try:
        line = driver.stdout.readline() if driver.stdout else ""
        assert line == "ready\n", "the world did not form"
        driver.kill()  # no stop handshake: the workers must notice by themselves
        for proc in workers:
            out, err = proc.communicate(timeout=15)
            assert proc.returncode == 0 and out == "served\n"
            assert "the driver stopped answering" in err
    finally:
        driver.kill()
        driver.communicate(timeout=10)
        _reap(workers)


def test_external_launch_checks_its_world() -> None:
    with pytest.raises(ValueError, match="started 4 processes but this system needs 3"):
        ActorSystem([WorkerSpec("a"), WorkerSpec("b")], launch=ExternalLaunch("127.0.0.1", 1, 4))
    with pytest.raises(ValueError, match="port 0"):
        ExternalLaunch("127.0.0.1", 0, 2)
