"""The schedule plan: derived once from the settings, read the same by the book, the search's
state and the simulator's engine."""

from __future__ import annotations

import math

import pytest

from digen.config import load_config, schedule_plan
from digen.errors import ConfigError
from digen.sched import Costs
from digen.sched._engine import Engine
from digen.sched.plan import plan_schedule
from digen.sched.scheduler import Scheduler
from digen.sched.tag import brute_force, search


def test_counts_of_a_gap_step() -> None:
    # 3 prompts x 8 samples on 3 generators: slices of ceil(8/3) = 3 -> 3 micro-batches a group
    plan = plan_schedule(prompts=3, group_size=8, generators=3, trainers=2)
    assert (plan.microbatches, plan.update_group, plan.trainers) == (9, 3, 2)
    assert not plan.whole_step
    mbs = plan.microbatches_of(4)
    assert len(mbs) == 9 and {m.step for m in mbs} == {4}
    assert [m.samples for m in mbs[:3]] == [(0, 1, 2), (3, 4, 5), (6, 7)]
    assert [m.prompt for m in mbs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    # default C_gen: one step, plus the early share for each version of staleness
    assert plan.admission.max_inflight == 9
    tcss = plan_schedule(
        prompts=3, group_size=8, generators=3, trainers=2, max_staleness=2, staleness_ratio=0.5
    )
    assert tcss.admission.stale_cap == 4 and tcss.admission.max_inflight == 9 + 2 * 4


@pytest.mark.parametrize(
    ("over", "whole"),
    [({}, False), ({"pipeline": False}, True), ({"batch_advantages": True}, True)],
)
def test_whole_step_rule(over: dict, whole: bool) -> None:
    plan = plan_schedule(prompts=2, group_size=4, generators=2, trainers=1, **over)
    assert plan.whole_step is whole
    assert plan.update_group == (4 if whole else 2)


def test_sharded_trainers_are_one_slot() -> None:
    plan = plan_schedule(prompts=2, group_size=4, generators=1, trainers=4, sharded_trainers=True)
    assert plan.trainers == 1


def test_a_bound_that_would_deadlock_is_refused_with_its_reason() -> None:
    kw = dict(prompts=2, group_size=4, generators=4, trainers=1)
    assert plan_schedule(**kw, max_inflight=4).admission.max_inflight == 4
    with pytest.raises(ConfigError, match=r"at least 4 micro-batches \(one GAP group"):
        plan_schedule(**kw, max_inflight=3)
    with pytest.raises(ConfigError, match=r"at least 8 micro-batches \(a whole step"):
        plan_schedule(**kw, pipeline=False, max_inflight=7)


def test_config_hands_its_settings_to_the_plan() -> None:
    cfg = load_config(
        model="flux",
        overrides=[
            "runtime.mode=disaggregated",
            "runtime.generators=2",
            "runtime.trainers=2",
            "runtime.schedule.max_staleness=1",
            "runtime.schedule.staleness_ratio=0.5",
            "runtime.schedule.tag=static",
            "runtime.schedule.tag_k=3",
            "data.train_batch_size=2",
            "rollout.n=4",
            "train.micro_batch_size=4",
            "steps=7",
        ],
    )
    plan = schedule_plan(cfg, first_step=2)
    assert (plan.microbatches, plan.update_group, plan.generators, plan.trainers) == (4, 2, 2, 2)
    rule = plan.admission
    assert (rule.max_staleness, rule.stale_cap, rule.schedule) == (1, 2, "fixed")
    assert (rule.max_inflight, rule.first_step, rule.last_step) == (4 + 2, 2, 6)
    assert (plan.tag, plan.tag_k) == ("static", 3)


def test_a_resumed_runs_first_step_is_on_policy_in_the_searchs_model() -> None:
    """Fixed TCSS makes the first micro-batches of every step one version early, except the
    first step of a run: a run resumed at step 3 has no version 2 to make them with. The state
    the search sees must carry that, or its model waits for a version that never comes."""
    plan = plan_schedule(
        prompts=2,
        group_size=4,
        generators=2,
        trainers=1,
        max_staleness=1,
        staleness_ratio=0.5,
        first_step=3,
        last_step=4,
    )
    assert plan.admission.quota(3) == 0 and plan.admission.quota(4) == 2
    sched = Scheduler(plan)
    assert sched.next_for(3) is not None  # the driver's book hands step 3 out on version 3
    costs = Costs(gen=1.0, score=0.1, update=0.5, step=0.1, sync=0.1)
    st = sched.sched_state(0, now=0.0, costs=costs)
    assert st.admission == plan.admission and st.admission.first_step == 3
    assert st.can_start_next()
    eng = Engine.from_state(st, costs)
    assert eng._admissible()  # the model agrees with the scheduler
    res = search(st, costs)
    assert res.exact and math.isfinite(res.makespan)
    assert res.makespan == brute_force(st, costs).makespan
