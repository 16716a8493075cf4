"""The driver's loops with fake actors and injected timings: no processes, no models.

Fake actors sleep a scripted, seeded-random time per call on the event loop and return
made-up results, so these tests check the schedule itself — every micro-batch generated,
scored and trained once, updates only after their group is scored, TCSS's fixed schedule,
``C_gen`` back-pressure, TAG, and one clear error when an actor fails — whatever the timing.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from fakes import FakeCluster, InjectedFailure, World

from digen.config import load_config, schedule_plan
from digen.prompts import PromptSet
from digen.runtime.driver.loop import Driver
from digen.sched.trace import Trace


def _driver(overrides: list[str], seed: int = 0, fail_on=None):
    cfg = load_config(
        overrides=["runtime.mode=disaggregated", "rollout.num_inference_steps=3", *overrides]
    )
    world = World(random.Random(seed), fail_on)
    cluster = FakeCluster(cfg.runtime.generators, cfg.runtime.trainers, world)
    loop_time = lambda: asyncio.get_running_loop().time()  # noqa: E731
    driver = Driver(cfg, None, PromptSet.builtin(), Trace(), cluster=cluster, clock=loop_time)
    return cfg, driver, world


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "overrides",
    [
        ["runtime.generators=2", "runtime.schedule.tag=static", "runtime.schedule.tag_k=2"],
        ["runtime.generators=3", "runtime.trainers=2", "rollout.n=6"],
        ["runtime.generators=4", "runtime.trainers=2", "runtime.schedule.microbatch_axis=prompt"],
        ["runtime.generators=2", "runtime.schedule.pipeline=false", "runtime.schedule.tag=none"],
        ["runtime.generators=2", "algo.adv_std=global"],  # a batch-wide std waits for all
    ],
)
@pytest.mark.asyncio
async def test_every_microbatch_once_and_in_dependency_order(overrides, seed) -> None:
    cfg, driver, world = _driver(["steps=3", *overrides], seed)
    results = await driver.run(3)
    mbs = schedule_plan(cfg).microbatches
    for kind in ("generate", "score", "update"):
        counts = Counter((a[2], a[3]) for a in world.log if a[1] == kind)
        assert counts == {(s, m): 1 for s in range(3) for m in range(mbs)}, kind
    # on-policy: every trajectory made with its step's version, and trained in that step
    assert all(world.made[(s, m)] == s for s, m in world.made)
    order = {(a[1], a[2], a[3]): i for i, a in enumerate(world.log) if len(a) == 4}
    per_group = mbs // cfg.data.train_batch_size
    for s in range(3):
        for m in range(mbs):
            group = range(m // per_group * per_group, (m // per_group + 1) * per_group)
            assert all(order[("score", s, g)] < order[("update", s, m)] for g in group)
        if not cfg.runtime.schedule.pipeline or cfg.algo.adv_std == "global":  # every score first
            last_score = max(order[("score", s, m)] for m in range(mbs))
            assert last_score < min(order[("update", s, m)] for m in range(mbs))
    assert [r.metrics["policy_version"] for r in results] == [1, 2, 3]
    # rewards are the fake scores: mb index + row, so the metrics read the right rows
    assert results[0].metrics["reward_max"] == float(mbs - 1 + cfg.rollout.n // per_group - 1)
    if cfg.runtime.schedule.tag == "static":
        assert any(a[0].startswith("trainer") and a[1] == "generate" for a in world.log)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.asyncio
async def test_fixed_tcss_makes_exactly_the_first_share_stale(seed) -> None:
    over = ["steps=4", "runtime.generators=2", "runtime.schedule.max_staleness=1"]
    over += [
        "runtime.schedule.staleness_ratio=0.5",
        "runtime.schedule.tag=static",
        "runtime.schedule.tag_k=1",
    ]
    cfg, driver, world = _driver(over, seed)
    results = await driver.run(4)
    mbs = schedule_plan(cfg).microbatches
    cap = mbs // 2
    for (s, m), version in world.made.items():
        assert version == (s - 1 if s >= 1 and m < cap else s), (s, m, version)
    assert [r.metrics["stale_microbatches"] for r in results] == [0, cap, cap, cap]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.asyncio
async def test_eager_tcss_stays_within_its_bounds(seed) -> None:
    over = ["steps=4", "runtime.generators=3", "runtime.schedule.max_staleness=1", "rollout.n=6"]
    over += ["runtime.schedule.staleness_ratio=0.5", "runtime.schedule.staleness_schedule=eager"]
    cfg, driver, world = _driver(over, seed)
    results = await driver.run(4)
    cap = schedule_plan(cfg).microbatches // 2
    stale = Counter(s for (s, m), version in world.made.items() if version < s)
    assert all(s - version in (0, 1) for (s, m), version in world.made.items())
    assert all(count <= cap for count in stale.values()) and sum(stale.values()) > 0
    assert [r.metrics["stale_microbatches"] for r in results] == [stale[s] for s in range(4)]
    # only a step's first micro-batches can go out early: they are handed out in order
    assert all(m < cap for (s, m), version in world.made.items() if version < s)


@pytest.mark.asyncio
async def test_back_pressure_bounds_generated_but_untrained() -> None:
    over = ["steps=2", "runtime.generators=4", "rollout.n=8", "runtime.schedule.max_inflight=4"]
    _, driver, world = _driver([*over, "runtime.schedule.tag=none"], seed=1)
    await driver.run(2)
    assert world.untrained_max <= 4
    _, driver, world = _driver([*over[:-1], "runtime.schedule.tag=none"], seed=1)
    await driver.run(2)
    assert world.untrained_max > 4  # without the bound the generators run further ahead


@pytest.mark.asyncio
async def test_best_of_n_drops_and_releases_untrained_microbatches() -> None:
    over = ["steps=1", "algo.name=dancegrpo", "rollout.n=4", "algo.best_of_n=2"]
    over += ["runtime.generators=4", "runtime.schedule.tag=none"]
    _, driver, world = _driver(over)
    results = await driver.run(1)
    updates = [a for a in world.log if a[1] == "update"]
    assert len(updates) == 2 * 2  # 2 prompts x (best + worst), one sample per micro-batch
    assert sum(len(keys) for _, keys in driver.cluster.released) == 2 * 2
    assert results[0].metrics["trained_samples"] == 4


@pytest.mark.asyncio
async def test_a_failing_actor_is_one_error_and_nothing_keeps_running() -> None:
    _, driver, world = _driver(["steps=3", "runtime.generators=2"], fail_on=("trainer-0", "update"))
    with pytest.raises(InjectedFailure, match="update on trainer-0 .* failed on purpose"):
        await driver.run(3)
    await asyncio.sleep(0.02)
    before = len(world.log)
    await asyncio.sleep(0.05)
    assert len(world.log) == before  # every loop was cancelled with the run
    others = [t for t in asyncio.all_tasks() if t.get_name().startswith("loop-")]
    assert others == []


@pytest.mark.asyncio
async def test_a_failure_behind_which_a_worker_was_lost_names_the_lost_worker() -> None:
    """A trainer's call fails because a generator it was fetching from was killed: the run's
    error is the generator's loss, with the failed call as its cause."""
    from digen.runtime.transport.actors import WorkerDied

    _, driver, _ = _driver(["steps=3", "runtime.generators=2"], fail_on=("trainer-0", "update"))
    driver.cluster.lost_worker = WorkerDied("generator-1", 4242, -9)
    with pytest.raises(WorkerDied) as info:
        await driver.run(3)
    assert str(info.value) == "worker 'generator-1' (pid 4242) was killed by signal SIGKILL."
    assert isinstance(info.value.__cause__, InjectedFailure)


MINI = [
    "steps=3",
    "data.train_batch_size=4",
    "train.mini_batch_size=2",
    "runtime.generators=2",
    "runtime.trainers=2",
    "runtime.schedule.tag=static",
    "runtime.schedule.tag_k=2",
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "stale", [[], ["runtime.schedule.max_staleness=1", "runtime.schedule.staleness_ratio=0.5"]]
)
@pytest.mark.asyncio
async def test_mini_batches_train_in_turn_with_an_optimizer_step_after_each(seed, stale) -> None:
    """Two mini-batches a step: every trainer updates mini-batch 0's micro-batches, steps on
    exactly them, then mini-batch 1's; the version moves once per train step; a trainer
    generates (TAG) only while it holds the step's own weights."""
    cfg, driver, world = _driver([*MINI, *stale], seed)
    results = await driver.run(3)
    assert [r.metrics["policy_version"] for r in results] == [1, 2, 3]
    assert [r.metrics["optimizer_steps"] for r in results] == [2, 2, 2]
    mbs = schedule_plan(cfg).microbatches_of(0)
    mini_of = {m.mb: m.prompt // 2 for m in mbs}
    assert driver.mini_ids == [range(0, 4), range(4, 8)]  # 2 prompts x 2 micro-batches each
    assert sorted(set(mini_of.values())) == [0, 1]
    for trainer in ("trainer-0", "trainer-1"):
        ministeps, steps, updates = 0, 0, 0
        for _, method, *args in (e for e in world.log if e[0] == trainer):
            if method == "update":
                assert mini_of[args[1]] == ministeps, (trainer, args)
                updates += 1
            elif method == "step":
                ids, last = args
                assert ids == driver.mini_ids[ministeps] and last == (ministeps == 1)
                ministeps, steps = (0, steps + 1) if last else (ministeps + 1, steps)
            elif method == "generate":  # TAG
                assert ministeps == 0, (trainer, args)
        assert steps == 3 and ministeps == 0
        assert updates > 0
    trained = Counter((e[2], e[3]) for e in world.log if e[1] == "update")
    assert set(trained.values()) == {1} and len(trained) == 3 * len(mbs)


@pytest.mark.asyncio
async def test_a_stop_after_a_steps_first_optimizer_step_waits_for_the_steps_end() -> None:
    """Mid-step weights belong to no version: a stop asked for between a step's two optimizer
    steps lets the step finish, so the run ends on a whole step."""
    _, driver, world = _driver(MINI)

    async def stop_mid_step() -> None:
        while not any(e[1] == "step" for e in world.log):
            await asyncio.sleep(0)
        driver.request_stop()

    stopper = asyncio.create_task(stop_mid_step())
    results = await driver.run(3)
    await stopper
    assert [r.metrics["policy_version"] for r in results] == [1]
    steps = [e for e in world.log if e[1] == "step"]
    assert [e[3] for e in steps] == [False, False, True, True]  # two trainers, two mini-batches
