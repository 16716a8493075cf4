"""A soak test of the driver's schedule: random settings, costs and jitter over thousands of
micro-batches, and failures injected at random calls.

The real :class:`~digen.runtime.driver.loop.Driver` runs against fake actors (``fakes.py``) whose
calls cost a seeded-random number of event-loop iterations (a virtual clock: no wall time,
and the same interleaving for a seed on any machine). Every run is checked for what the
schedule promises: no micro-batch lost or made, scored or trained twice; the dependency
order (score after generation, update after its group's scores, on the step's weights);
TCSS's staleness bounds; ``C_gen``; and that an injected failure anywhere ends the run with
that failure and nothing left running.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from fakes import FakeCluster, InjectedFailure, VirtualClock, World

from digen.config import DigenConfig, load_config, schedule_plan
from digen.errors import DigenError
from digen.prompts import PromptSet
from digen.runtime.driver.loop import Driver
from digen.sched.admission import stale_cap
from digen.sched.trace import Trace

# thousands of micro-batches a test; test_driver_logic.py is the quick check of the driver
pytestmark = pytest.mark.slow

RUNS = 24
LIMIT = 2_000_000
"""Virtual ticks a run may take: reaching it means the driver stalled."""

_BASE = {"generate": 40, "score": 8, "update": 25, "step": 4, "load_weights": 3}


def _settings(rng: random.Random, extra: tuple[str, ...] = ()) -> DigenConfig:
    """A random, valid combination of the settings that shape the schedule (``extra``:
    overrides on top)."""
    while True:
        over = [
            "runtime.mode=disaggregated",
            "rollout.num_inference_steps=3",
            f"steps={rng.randint(8, 16)}",
            f"data.train_batch_size={rng.choice([2, 4, 8])}",
            f"rollout.n={rng.choice([2, 4, 6, 8])}",
            f"runtime.generators={rng.randint(1, 4)}",
            f"runtime.trainers={rng.randint(1, 3)}",
            f"runtime.schedule.microbatch_axis={rng.choice(['generation', 'prompt'])}",
            f"runtime.schedule.pipeline={rng.choice(['true', 'true', 'false'])}",
            f"runtime.schedule.tag={rng.choice(['none', 'static', 'bts'])}",
            f"runtime.schedule.tag_k={rng.randint(1, 3)}",
            f"runtime.schedule.max_staleness={rng.choice([0, 0, 1, 2])}",
            f"runtime.schedule.staleness_ratio={rng.choice([0.25, 0.5, 1.0])}",
            f"runtime.schedule.staleness_schedule={rng.choice(['fixed', 'eager'])}",
            f"algo.adv_std={rng.choice(['group', 'group', 'global'])}",
        ]
        if rng.random() < 0.3:
            over.append(f"runtime.schedule.max_inflight={rng.randint(1, 6)}")
        if rng.random() < 0.3:
            over.append(f"runtime.schedule.samples_per_microbatch={rng.choice([1, 2])}")
        if rng.random() < 0.25:
            over += ["algo.name=dancegrpo", "algo.best_of_n=2"]
        over.append(f"runtime.schedule.score_overlap={rng.choice(['true', 'false'])}")
        over += extra
        try:
            cfg = load_config(overrides=over)
        except DigenError:
            continue
        return cfg


def _world(
    seed: int,
    clock: VirtualClock,
    fail_at: int | None = None,
    kill_at: frozenset = frozenset(),
    join_at: frozenset = frozenset(),
) -> World:
    rng = random.Random(seed)
    speed = {}  # each worker its own speed, each call its own jitter, now and then a straggler

    def cost(rng: random.Random, worker: str, method: str) -> float:
        factor = speed.setdefault(worker, rng.uniform(0.5, 2.0))
        tail = 5.0 if rng.random() < 0.03 else 1.0
        return _BASE[method] * factor * rng.uniform(0.6, 1.4) * tail

    return World(
        rng,
        fail_at=fail_at,
        kill_at=kill_at,
        join_at=join_at,
        cost=cost,
        sleep=clock.sleep,
        now=clock.seconds,
    )


async def _drive(cfg, world: World, clock: VirtualClock, stop_at: int | None = None):
    """Run ``cfg`` on fake actors; ``stop_at``: the tick a stop is asked for."""
    cluster = FakeCluster(cfg.runtime.generators, cfg.runtime.trainers, world)
    driver = Driver(cfg, None, PromptSet.builtin(), Trace(), cluster=cluster, clock=clock.seconds)
    ticker = asyncio.create_task(clock.run())
    run = asyncio.create_task(driver.run(cfg.steps))
    if stop_at is not None:

        async def stop() -> None:
            await clock.sleep(stop_at)
            driver.request_stop()

        stopper = asyncio.create_task(stop())
    await asyncio.wait({ticker, run}, return_when=asyncio.FIRST_COMPLETED)
    ticker.cancel()
    if stop_at is not None:
        stopper.cancel()
    assert run.done(), f"the driver made no progress in {LIMIT} ticks"
    return run.result(), cluster


def _check_schedule(cfg, results, world: World, cluster: FakeCluster) -> int:
    """Every promise of the schedule on one finished run; returns its micro-batch count."""
    rt, steps = cfg.runtime, range(cfg.steps)
    mbs = {s: schedule_plan(cfg).microbatches_of(s) for s in steps}
    everything = {(s, mb.mb) for s in steps for mb in mbs[s]}
    calls = {
        kind: Counter((a[2], a[3]) for a in world.log if a[1] == kind)
        for kind in ("generate", "score", "update", "release")
    }
    # none lost, none twice: each made and scored once, then trained once or released once
    assert calls["generate"] == dict.fromkeys(everything, 1)
    assert calls["score"] == dict.fromkeys(everything, 1)
    assert calls["update"] + calls["release"] == dict.fromkeys(everything, 1)
    if not cfg.algo.best_of_n:
        assert not calls["release"]
    # dependencies: scored after made; trained after every score of its group
    at = {(a[1], a[2], a[3]): i for i, a in enumerate(world.log) if len(a) == 4}
    for s in steps:
        for mb in mbs[s]:
            assert at[("generate", s, mb.mb)] < at[("score", s, mb.mb)]
            if ("update", s, mb.mb) not in at:
                continue
            group = [m.mb for m in mbs[s] if m.prompt == mb.prompt]
            if cfg.algo.adv_std == "global" or not rt.schedule.pipeline:
                group = [m.mb for m in mbs[s]]
            assert all(at[("score", s, g)] < at[("update", s, mb.mb)] for g in group)
    # staleness: within max_staleness versions, at most the cap per step, as reported
    per_step = schedule_plan(cfg).microbatches
    cap = stale_cap(per_step, rt.schedule.staleness_ratio) if rt.schedule.max_staleness else 0
    stale = Counter(s for (s, m), v in world.made.items() if v < s)
    for (s, m), v in world.made.items():
        assert s - rt.schedule.max_staleness <= v <= s, (s, m, v)
        if v < s and rt.schedule.staleness_schedule == "fixed":
            assert v == s - 1 and m < cap, (s, m, v)
    assert all(stale[s] <= cap for s in steps)
    if rt.schedule.staleness_schedule == "fixed":
        assert [stale[s] for s in steps] == [0] + [cap] * (cfg.steps - 1)
    assert [r.metrics["stale_microbatches"] for r in results] == [stale[s] for s in steps]
    # C_gen: generated but not yet trained (or dropped) never above max_inflight
    assert world.untrained_max <= schedule_plan(cfg).admission.max_inflight
    assert world.untrained == 0
    assert [r.metrics["policy_version"] for r in results] == [s + 1 for s in steps]
    return len(everything)


@pytest.mark.asyncio
async def test_soak_random_settings_costs_and_jitter() -> None:
    total, kinds = 0, Counter()
    for seed in range(RUNS):
        cfg = _settings(random.Random(1000 + seed))
        clock = VirtualClock(LIMIT)
        world = _world(seed, clock)
        results, cluster = await _drive(cfg, world, clock)
        try:
            total += _check_schedule(cfg, results, world, cluster)
            # each step's time runs from the previous step's end: together, the whole run
            spent = sum(r.metrics["step_time_s"] for r in results)
            assert spent == pytest.approx(clock.seconds(), abs=0.01), (spent, clock.seconds())
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}, settings {cfg.runtime}: {exc}") from exc
        kinds.update(a[0].split("-")[0] + ":" + a[1] for a in world.log)
        kinds["stale"] += sum(r.metrics["stale_microbatches"] for r in results)
    assert total >= 2000, total  # the soak's size: thousands of micro-batches
    # what the settings were drawn to exercise did happen: TAG, best-of-N drops, TCSS
    assert kinds["trainer:generate"] and kinds["generator:release"] and kinds["stale"]
    print(f"soak: {RUNS} runs, {total} micro-batches, {dict(kinds)}")


@pytest.mark.asyncio
async def test_soak_an_injected_failure_anywhere_ends_the_run_with_it() -> None:
    for seed in range(RUNS):
        cfg = _settings(random.Random(2000 + seed))
        clock = VirtualClock(LIMIT)
        world = _world(seed, clock)
        await _drive(cfg, world, clock)
        fail_at = random.Random(seed).randrange(world.calls)  # the same run, failing there
        clock = VirtualClock(LIMIT)
        world = _world(seed, clock, fail_at)
        with pytest.raises(InjectedFailure) as got:
            await _drive(cfg, world, clock)
        assert str(got.value) == world.failed and f"(call {fail_at})" in world.failed
        calls = world.calls
        quiet = VirtualClock(2_000)  # time goes on: nothing of the run is still working
        world.sleep, world.now = quiet.sleep, quiet.seconds
        await quiet.run()
        assert world.calls == calls, f"seed {seed}: calls went on after the failure"
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("loop-")]


@pytest.mark.asyncio
async def test_soak_a_stop_at_any_moment_ends_at_a_micro_batch_boundary() -> None:
    """A stop asked at a random moment: calls running then finish, no generation, score or
    update starts after it, and the run returns the steps completed, promptly."""
    stopped_inside = 0
    for seed in range(RUNS):
        cfg = _settings(random.Random(3000 + seed))
        clock = VirtualClock(LIMIT)
        world = _world(seed, clock)
        await _drive(cfg, world, clock)
        end = clock.now
        # the last optimizer step's start: a stop after it lets the run end complete
        last_step = max(t for t, m in world.starts if m == "step") * 1e3
        stop_at = random.Random(seed).randrange(1, end)
        clock = VirtualClock(LIMIT)
        world = _world(seed, clock)
        results, _ = await _drive(cfg, world, clock, stop_at)
        done = [r.metrics["step"] for r in results]
        assert done == list(range(len(done))), (seed, done)
        assert len(done) < cfg.steps or stop_at >= last_step, (seed, done, stop_at)
        late = {m for t, m in world.starts if t * 1e3 > stop_at + 1}
        assert late <= {"step", "load_weights"}, (seed, late)
        assert world.running == 0  # what ran when the stop came has finished
        assert clock.now - stop_at < 3000, (seed, clock.now - stop_at)  # promptly
        stopped_inside += any(s == len(done) for (s, m) in world.made)
    assert stopped_inside > RUNS // 2  # most stops came inside a step, which was left


@pytest.mark.asyncio
async def test_soak_generators_lost_and_joining_at_random_calls_nothing_lost_nothing_twice() -> (
    None
):
    """Generators lost at random calls (one the run started with always left), and new ones
    joining at others (lost too, now and then, before or after they join the pool): every
    run ends, every micro-batch is trained exactly once on the version of its step, a scored
    one made again with the version that made it (the fakes check both), and the metrics
    count the pool as it was."""
    remade = losses = joins = newcomer_work = for_update = 0
    for seed in range(RUNS):
        over = random.Random(4000 + seed)
        joining = ("runtime.elastic.accept_generators=true", "runtime.transport.weight_sync=rpc")
        cfg = _settings(over, joining)
        while cfg.runtime.generators < 2:
            cfg = _settings(over, joining)
        clock = VirtualClock(LIMIT)
        world = _world(seed, clock)
        await _drive(cfg, world, clock)
        pick = random.Random(seed)
        kill_at = frozenset(pick.randrange(world.calls) for _ in range(pick.randint(1, 3)))
        join_at = frozenset(pick.randrange(world.calls) for _ in range(pick.randint(0, 2)))
        clock = VirtualClock(LIMIT)
        world = _world(seed, clock, kill_at=kill_at, join_at=join_at)
        try:
            results, _ = await _drive(cfg, world, clock)
            steps = range(cfg.steps)
            everything = {(s, mb.mb) for s in steps for mb in schedule_plan(cfg).microbatches_of(s)}
            updated = Counter((a[2], a[3]) for a in world.log if a[1] == "update")
            released = Counter((a[2], a[3]) for a in world.log if a[1] == "release")
            lost = {k for k in everything if k not in updated and k not in released}
            assert updated + released + Counter(lost) == dict.fromkeys(everything, 1)
            per_step = [r.metrics["lost_microbatches"] for r in results]
            assert per_step == [sum(s == k[0] for k in lost) for s in steps]
            if lost:  # only stale work of a lost generator, whose version is gone
                assert cfg.runtime.schedule.max_staleness > 0
                assert all(world.holders[k] in world.dead and world.made[k] < k[0] for k in lost)
            assert world.trained == set(updated)
            assert world.untrained == len(lost)  # the fakes count a drop at its release
            assert [r.metrics["policy_version"] for r in results] == [s + 1 for s in steps]
            # the pool after the last step's weight sync: those that started or joined it
            # (a joiner loads weights only to join), less the lost
            joined = {a[0] for a in world.log if a[1] == "load_weights" and a[0] in world.newcomers}
            first = {a[0] for a in world.log if a[0] not in world.newcomers}
            pool = {g for g in first | joined if g.startswith("generator")} - set(world.dead)
            assert results[-1].metrics["generators_alive"] == len(pool)
            if not world.newcomers:
                alive = [r.metrics["generators_alive"] for r in results]
                assert alive == sorted(alive, reverse=True)
            assert sum(r.metrics["remade_microbatches"] for r in results) >= world.remade
        except AssertionError as exc:
            raise AssertionError(
                f"seed {seed}, kills {sorted(kill_at)}, joins {sorted(join_at)}, "
                f"{cfg.runtime}: {exc}"
            ) from exc
        remade += world.remade
        losses += len(world.dead)
        joins += len(joined)
        newcomer_work += sum(a[0] in world.newcomers for a in world.log if a[1] == "generate")
        # made again after being scored (for its update only): the last make follows a score
        at = {(a[1], a[2], a[3]): i for i, a in enumerate(world.log) if len(a) == 4}
        for_update += sum(
            i > at.get(("score", *k[1:]), len(world.log))
            for k, i in at.items()
            if k[0] == "generate"
        )
    assert losses >= RUNS and remade > RUNS  # the losses did happen, with work in hand
    assert for_update > 0  # and some of that work was already scored
    assert joins > 0 and newcomer_work > 0  # generators joined the pool, and made some
    print(
        f"soak: {RUNS} runs, {losses} generators lost, {joins} joined, {remade} micro-batches "
        f"made again, {for_update} of them after their scoring; {newcomer_work} made by joiners"
    )
