"""The planner: the colocated model, what each layout pays on GPUs, and the ranking."""

from __future__ import annotations

import dataclasses

import pytest

from digen.errors import DigenError
from digen.planning.hardware import (
    GB,
    RECOMPUTE,
    ModelSize,
    allgather_s,
    allreduce_s,
    fsdp_update_s,
    load_hardware,
    offload_reload_s,
    sharded_sampling_s,
    ulysses_s,
    weight_sync_s,
)
from digen.planning.layouts import (
    COLOCATED,
    SPLIT,
    DoesNotFit,
    Workload,
    by_cost,
    colocated_costs,
    explain,
    format_plan,
    grouped_update,
    plan,
    simulate_colocated,
    split_costs,
    with_grouped_updates,
)
from digen.sched.costs import Costs
from digen.sched.simulator import simulate
from digen.sched.tag import BTS, NoTAG, StaticTAG

COSTS = Costs(gen=1.0, update=0.5, score=0.1, step=0.2)
FULL = ModelSize(params=10e9, blocks=50, trained=10e9, reward_params=1e9)


def test_colocated_steps_are_three_phases_each_as_long_as_the_slowest_device() -> None:
    # 5 micro-batches over 2 devices: device 0 has 3 (0, 2, 4), device 1 has 2
    res = simulate_colocated(COSTS, 5, 2, steps=2, switch_s=0.4)
    step = 0.4 + 3 * (1.0 + 0.1) + 3 * 0.5 + 0.2
    assert res.step_ends == pytest.approx([step, 2 * step])
    w0 = [e for e in res.events if e.worker == "worker-0" and e.step == 0]
    assert [e.kind for e in w0] == ["sync", "generate", "generate", "generate", "score"] + [
        "update"
    ] * 3 + ["step"]
    assert [e.mb for e in w0 if e.kind == "update"] == [0, 2, 4]
    # device 1 waits for device 0 at each barrier
    w1_update = next(e for e in res.events if e.worker == "worker-1" and e.kind == "update")
    assert w1_update.t0 == pytest.approx(0.4 + 3.3)


def test_colocated_draws_each_task() -> None:
    seen = []

    def draw(name: str, value: float) -> float:
        seen.append(name)
        return 2 * value

    res = simulate_colocated(COSTS, 2, 2, draw=draw)
    assert res.makespan == pytest.approx(2 * (1.0 + 0.1 + 0.5 + 0.2))
    assert sorted(set(seen)) == ["gen", "score", "step", "update"]


def test_colocated_on_gpus_takes_every_way_that_fits() -> None:
    hw = load_hardware({"device": "h100"})
    work = Workload(costs=COSTS, microbatches=16, passes=10, model=FULL)
    got = {s: (c, switch, terms) for s, c, switch, terms in colocated_costs(work, hw, 8, tsp=False)}
    # 160 GB of training state: sharded over 8 (20 GB), and a 20 GB copy + 2 GB reward fit
    assert set(got) == {"gathered copy", "sharded sampling", "offload"}
    gather = allgather_s(20 * GB, 8, 450)
    fsdp = fsdp_update_s(FULL, 8, 450)
    c, switch, terms = got["gathered copy"]
    assert switch == pytest.approx(gather)
    assert c.update == pytest.approx(0.5 + fsdp) and c.gen == 1.0
    assert terms["fsdp update"] == pytest.approx(2 * fsdp)  # 2 micro-batches a device
    c, switch, _ = got["sharded sampling"]
    assert switch == 0 and c.gen == pytest.approx(max(1.0, sharded_sampling_s(FULL, 8, 450, 10)))
    _, switch, _ = got["offload"]
    assert switch == pytest.approx(offload_reload_s(20 * GB, 64) + gather)
    # a small model is replicated: the gradients are all-reduced at the optimizer step
    small = ModelSize(params=1e9, blocks=10, trained=1e9)
    (one,) = colocated_costs(
        Workload(costs=COSTS, microbatches=16, passes=10, model=small), hw, 8, tsp=False
    )
    assert one[0] == "replicated"
    assert one[1].step == pytest.approx(0.2 + allreduce_s(4 * GB, 8, 450))


def test_a_split_pays_the_weight_sync_and_runs_at_each_kind_speed() -> None:
    hw = load_hardware(
        {
            "generator": {"kind": "l40s", "count": 4},
            "trainer": {"kind": "h100", "count": 4},
            "cross_gb_s": 25,
        }
    )
    small = ModelSize(params=1e9, blocks=10, trained=1e9)
    work = Workload(costs=COSTS, microbatches=8, passes=10, model=small)
    strategy, c, slots, terms, *_ = split_costs(work, hw, 4, 4, tsp=False)
    assert (strategy, slots) == ("replicated", 4)
    slow = 362 / 989  # an l40s against the h100 the costs were measured on
    assert c.gen == pytest.approx(1.0 / slow) and c.score == pytest.approx(0.1 / slow)
    assert c.update == 0.5 and c.gen_tag == 1.0
    assert c.sync == pytest.approx(weight_sync_s(2 * GB, 25)) == terms["weight sync"]
    # a fully trained 10B model does not fit one h100: the trainers shard it, as one slot
    strategy, c, slots, _, *_ = split_costs(
        Workload(costs=COSTS, microbatches=8, passes=10, model=FULL), hw, 4, 4, tsp=False
    )
    assert (strategy, slots) == ("fsdp trainers", 1)
    # one sample a micro-batch: one trainer works it, the other three keep in step
    assert c.update == pytest.approx(0.5 + fsdp_update_s(FULL, 4, 450))
    eight = Workload(costs=COSTS, microbatches=8, samples_per_microbatch=8, passes=10, model=FULL)
    _, c, _, _, *_ = split_costs(eight, hw, 4, 4, tsp=False)  # 8 samples: 2 each
    assert c.update == pytest.approx(0.5 / 4 + fsdp_update_s(FULL, 4, 450))
    gathers = sharded_sampling_s(FULL, 4, 450, 10)
    assert c.gen_tag == pytest.approx(max(1.0 / 4, gathers))


def test_sharded_updates_deal_terms_or_samples_and_pay_the_gathers_every_pass() -> None:
    # one sample of 8 trained timesteps on 4 members, TSP 4: by terms each trains 2 in one
    # pass; by samples one member trains all 8 in 2 passes, the others keep in step
    one = Workload(
        costs=COSTS, microbatches=8, update_tsp=0.3, tsp_degree=4, timesteps=8, model=FULL
    )
    assert one.trained_share(4, tsp=True) == (2 / 8, 1)
    by_samples = dataclasses.replace(one, shard_deal="samples")
    assert by_samples.trained_share(4, tsp=True) == (1.0, 2)
    assert one.trained_share(4, tsp=False) == (2 / 8, 2)  # passes of 1 term without TSP
    assert by_samples.trained_share(4, tsp=False) == (1.0, 8)
    # 4 samples of 6 timesteps on 8 members, 2 samples a pass: 3 terms each, in 2 passes
    four = Workload(
        costs=COSTS, microbatches=8, samples_per_microbatch=4, timesteps=6, pass_samples=2
    )
    assert four.trained_share(8, tsp=False) == (3 / 24, 2)
    assert dataclasses.replace(four, shard_deal="samples").trained_share(8, tsp=False) == (1 / 4, 6)
    hw = load_hardware({"device": "h100"})
    fsdp = fsdp_update_s(FULL, 4, 450)
    _, c, slots, terms, *_ = split_costs(one, hw, 4, 4, tsp=True)
    assert slots == 1 and c.update == pytest.approx(0.3 * 2 / 8 + fsdp)
    assert terms["fsdp update"] == pytest.approx(8 * fsdp)  # one pass a micro-batch
    _, c, _, _, *_ = split_costs(by_samples, hw, 4, 4, tsp=True)
    assert c.update == pytest.approx(0.3 + 2 * fsdp)
    _, c, _, _, *_ = split_costs(one, hw, 4, 4, tsp=False)
    assert c.update == pytest.approx(0.5 * 2 / 8 + 2 * fsdp)
    # a colocated FSDP device trains its micro-batch's 8 timesteps in 2 TSP passes
    got = {s: c for s, c, _, _ in colocated_costs(one, hw, 8, tsp=True)}
    assert got["gathered copy"].update == pytest.approx(0.3 + 2 * fsdp_update_s(FULL, 8, 450))
    # a group's 4 micro-batches as one update: 32 terms, 8 a member in 2 passes of 4, where
    # one update each pays 4 passes' gathers for the same terms
    update_of = grouped_update(one, hw, 4, tsp=True)
    assert update_of(1) == pytest.approx(0.3 * 2 / 8 + fsdp)
    assert update_of(4) == pytest.approx(0.3 * 4 * 8 / 32 + 2 * fsdp)
    grouped = dataclasses.replace(one, mbs_per_group=4)
    ranked, _ = plan(grouped, 8, hw, steps=2)
    together = [c for c in ranked if c.grouped]
    assert together and all(c.strategy == "fsdp trainers" for c in together)
    assert all("grouped updates" in c.label for c in together)
    # the schedule prices c together on the line through 1 and a whole group
    priced = with_grouped_updates(COSTS, update_of, 4)
    assert priced.update_for(1) == pytest.approx(update_of(1))
    assert priced.update_for(4) == pytest.approx(update_of(4))
    res = simulate(priced, 8, 2, 1, NoTAG(), steps=2, mbs_per_group=4, group_updates=True)
    updates = [e for e in res.events if e.kind == "update" and e.step == 0]
    assert len(updates) == 2  # one a group
    assert [e.duration for e in updates] == pytest.approx([update_of(4)] * 2)
    with pytest.raises(DigenError, match="shard_deal"):
        Workload(costs=COSTS, microbatches=1, shard_deal="rows")
    with pytest.raises(DigenError, match="timesteps"):
        Workload(costs=COSTS, microbatches=1, timesteps=0)


def test_activations_decide_checkpointing_and_what_fits() -> None:
    hw = load_hardware({"device": "h100"})  # 80 GB, 10 kept in reserve
    # 1B parameters, all trained: 16 GB of training state; 100k tokens of width 2048 in 20
    # blocks: a one-row pass keeps 139 GB of activations, 15 GB checkpointed a block at a time
    long = ModelSize(params=1e9, blocks=20, trained=1e9, hidden=2048, tokens=100_000)
    work = Workload(costs=COSTS, microbatches=8, update_tsp=0.3, tsp_degree=4, model=long)
    ((strategy, c, _, terms),) = colocated_costs(work, hw, 8, tsp=False)
    assert strategy == "replicated" and c.update == pytest.approx(0.5 * RECOMPUTE)
    assert terms["recompute"] == pytest.approx((RECOMPUTE - 1) * 0.5 * 1)  # 1 update a device
    # TSP 4 makes 4-row passes: 61 GB checkpointed, which fits only beside a shard
    got = {s: c for s, c, _, _ in colocated_costs(work, hw, 8, tsp=True)}
    assert "replicated" not in got and got["sharded sampling"].update > 0.3 * RECOMPUTE
    # a split's trainers pay the same; a one-device trainer pool cannot hold a TSP pass
    strategy, c, _, terms, *_ = split_costs(work, hw, 4, 4, tsp=False)
    assert strategy == "replicated" and "recompute" in terms
    one = Workload(costs=COSTS, microbatches=8, update_tsp=0.3, tsp_degree=4, model=long)
    with pytest.raises(DoesNotFit, match="of activations even checkpointed"):
        split_costs(one, hw, 7, 1, tsp=True)
    ranked, skipped = plan(work, 8, hw, steps=2)
    assert all(c.checkpointing for c in ranked)
    assert "checkpointed" in format_plan(ranked, [])
    # one trainer holds a one-row pass but not TSP's four rows: that split runs without TSP
    assert any(why.startswith("7G+1T + TSP: ") for why in skipped)
    assert {c.tsp for c in ranked if (c.generators, c.trainers) == (7, 1)} == {False}


def test_plan_ranks_colocated_beside_every_split() -> None:
    work = Workload(costs=COSTS, microbatches=8, update_tsp=0.3, tsp_degree=2)
    ranked, skipped = plan(work, 4, steps=2)
    assert skipped == []
    layouts = {(c.layout, c.generators, c.tsp) for c in ranked}
    assert (COLOCATED, 0, False) in layouts and (COLOCATED, 0, True) in layouts
    assert {c.generators for c in ranked if c.layout == SPLIT} == {1, 2, 3}
    times = [round(c.step_time, 9) for c in ranked]
    assert times == sorted(times)
    # equal devices, no costs of colocation: colocated with TSP does all the work in parallel
    co = next(c for c in ranked if c.layout == COLOCATED and c.tsp)
    assert co.step_time == pytest.approx(2 * (1.0 + 0.1 + 0.3) + 0.2)
    line = explain(ranked)
    assert line.startswith(ranked[0].label + ": predicted ")
    assert " vs " in line


def test_plan_leaves_out_what_does_not_fit_and_prices_every_candidate() -> None:
    hw = load_hardware(
        {
            "generator": {"kind": "l4", "count": 4, "price_h": 1.0},
            "trainer": {"kind": "h100", "count": 4, "price_h": 4.0},
        }
    )
    # 30B bf16 (60 GB) does not fit a 24 GB l4: the split is left out, with the reason
    big = ModelSize(params=30e9, blocks=60, trained=50e6)  # LoRA
    ranked, skipped = plan(Workload(costs=COSTS, microbatches=8, passes=10, model=big), None, hw)
    assert all(c.layout == COLOCATED for c in ranked)
    assert skipped == [
        "4G+4T: a l4 generator cannot hold the model (60 GB; 24 GB less 10 GB reserved)",
    ]
    small = ModelSize(params=2e9, blocks=20, trained=2e9)
    ranked, _ = plan(Workload(costs=COSTS, microbatches=8, passes=10, model=small), None, hw)
    split = next(c for c in ranked if c.layout == SPLIT)
    assert split.price_h == 4 * 1.0 + 4 * 4.0
    assert split.cost_per_1k == pytest.approx(20.0 * split.step_time / 3600 * 1000 / 8)
    # colocated on the trainers' kind alone, and on all 8 at the l4's speed and memory
    co = {c.trainers: c for c in ranked if c.layout == COLOCATED and not c.tsp}
    assert set(co) == {4, 8}
    assert co[4].price_h == 16.0 and co[8].price_h == 20.0
    # 32 GB of training state: sharded over 8; sampling from the shards hides its gathers
    # (10 x 3.5 GB at 32 GB/s: 1.1 s) behind a generation of 8.2 s; one sharded update each
    slow = 121 / 989
    want = (1.0 + 0.1 + 0.5 + 0.2) / slow + fsdp_update_s(small, 8, 32)
    assert co[8].strategy == "sharded sampling"
    assert co[8].step_time == pytest.approx(want)
    cheapest = by_cost(ranked)
    assert [c.cost_per_1k for c in cheapest] == sorted(c.cost_per_1k for c in cheapest)
    table = format_plan(ranked, [])
    assert "per 1k samples" in table.splitlines()[0]


def test_a_ranked_split_is_what_the_simulator_gives_for_it() -> None:
    work = Workload(costs=COSTS, microbatches=8)
    ranked, _ = plan(work, 4, steps=2, static_k=1)
    assert len(ranked) == 1 + 3 * 6  # colocated (no TSP timed), 3 splits x 3 policies x TCSS
    best = next(c for c in ranked if c.layout == SPLIT)
    pol = {"none": NoTAG(), "static-1": StaticTAG(1), "bts": BTS()}[best.policy]
    kw = {"max_staleness": 1, "staleness_ratio": 0.25} if best.tcss else {}
    res = simulate(COSTS, 8, best.generators, best.trainers, pol, steps=2, **kw, score_overlap=True)
    # the steady step: the second (the first also fills the pipeline)
    assert best.step_time == pytest.approx(res.step_ends[1] - res.step_ends[0])


def test_plan_checks_its_devices() -> None:
    with pytest.raises(ValueError, match="devices must be an integer >= 2"):
        plan(Workload(costs=COSTS, microbatches=4), 1)


def test_sequence_and_cfg_parallelism_in_a_split() -> None:
    """Generators of several devices share a sample's tokens (the all-to-alls paid) and the
    guidance branches; sharded trainers split the tokens where a pass of whole rows does
    not fit, and sample a micro-batch smaller than their group with the tokens split."""
    hw = load_hardware({"device": "h100"})  # 80 GB, 10 kept in reserve; NVLink 450 GB/s
    long = ModelSize(params=13e9, blocks=60, trained=13e9, hidden=3072, tokens=119_056)
    guided = Workload(costs=COSTS, microbatches=8, passes=10, timesteps=4, guided=True, model=long)
    one = split_costs(guided, hw, 4, 4, tsp=False)
    four = split_costs(guided, hw, 4, 4, tsp=False, sequence=4)
    cfg = split_costs(guided, hw, 4, 4, tsp=False, cfg=True)
    # a generator of 4 samples a micro-batch (2 rows with guidance) in a quarter of the
    # time, plus each pass's all-to-alls; with CFG parallelism one branch a device
    assert four.costs.gen == pytest.approx(1.0 / 4 + 10 * ulysses_s(long, 2, 4, 450))
    assert cfg.costs.gen == pytest.approx(0.5) and one.costs.gen == pytest.approx(1.0)
    # 720p video: a one-row pass keeps 746 GB, 56 GB checkpointed, beside 52 GB of shards a
    # trainer: only 4 trainers sharing the tokens hold it (checkpointed), each trains every
    # term with a quarter of the tokens, its passes trading them both ways
    assert one.shard_deal == "sequence" and "recompute" in one.terms
    share, passes = dataclasses.replace(guided, shard_deal="sequence").trained_share(4, tsp=False)
    assert (share, passes) == (1 / 4, 4)
    trade = ulysses_s(long, 1, 4, 450, backward=True)
    fsdp = fsdp_update_s(long, 4, 450)
    assert one.costs.update == pytest.approx(0.5 * RECOMPUTE / 4 + 4 * (fsdp + trade))
    # TAG on the slot: a one-sample micro-batch sampled by all 4, its tokens split
    assert one.trainer_sampling == "sequence"
    gathers = sharded_sampling_s(long, 4, 450, 10)
    tag = 1.0 / 4 + 10 * ulysses_s(long, 2, 4, 450)
    assert one.costs.gen_tag == pytest.approx(max(tag, gathers))
    # the plan weighs every generator group dividing the pool and applies its choice
    ranked, _ = plan(guided, 8, hw, steps=2)
    groups = {(c.generators, c.generator_sequence, c.generator_cfg) for c in ranked}
    assert {(4, 1, False), (4, 2, False), (4, 4, False), (4, 1, True), (4, 2, True)} <= groups
    assert (4, 8, False) not in groups  # 8 does not divide 4
    cfg_four = next(c for c in ranked if c.generators == 4 and c.generator_group == 4)
    assert "(CFG 2 x SP 2)" in cfg_four.label or "(SP 4)" in cfg_four.label
    assert "tokens split" in format_plan(ranked, [])
    # without the tokens, what the all-to-alls cost is unknown: one device a generator
    short = dataclasses.replace(guided, model=dataclasses.replace(long, tokens=0))
    assert {c.generator_group for c in plan(short, 8, hw, steps=2)[0]} == {1}
    with pytest.raises(DigenError, match="shard_deal"):
        Workload(costs=COSTS, microbatches=1, shard_deal="heads")


def test_the_planner_chooses_the_tsp_degree_whose_pass_fits() -> None:
    """An update is a fixed cost a pass and a cost a term, fitted to the two timings; the
    planner weighs every degree up to the trained timesteps, larger ones saving passes but
    holding more rows a pass, and takes the fastest whose pass fits."""
    # 8 trained timesteps: 8 passes take 0.8 s, 2 passes (TSP 4) 0.5 s: 0.05 s a pass, 0.4 of terms
    work = Workload(costs=COSTS, microbatches=8, update_tsp=0.5, tsp_degree=4, timesteps=8)
    base = dataclasses.replace(work, costs=dataclasses.replace(COSTS, update=0.8))
    assert base.tsp_degrees() == [2, 4, 8]
    assert base.at_degree(2).update_tsp == pytest.approx(4 * 0.05 + 0.4)
    assert base.at_degree(8).update_tsp == pytest.approx(1 * 0.05 + 0.4)
    assert base.at_degree(4) is base
    one = dataclasses.replace(base, timesteps=1)  # one timestep: nothing to model from
    assert one.tsp_degrees() == [4] and Workload(costs=COSTS, microbatches=1).tsp_degrees() == []
    # on GPUs, a 100k-token row: a degree-8 pass (8 rows, 121 GB checkpointed) fits 4
    # trainers only with the tokens split, a degree-4 one (60 GB) beside FSDP shards; the
    # split takes the degree whose update is cheapest among those that fit
    hw = load_hardware({"device": "h100"})
    long = ModelSize(params=1e9, blocks=20, trained=1e9, hidden=2048, tokens=100_000)
    gpu = dataclasses.replace(base, model=long)
    at = {d: split_costs(gpu.at_degree(d), hw, 4, 4, tsp=True) for d in gpu.tsp_degrees()}
    assert at[8].shard_deal == "sequence" and at[4].shard_deal == "terms"
    cheapest = min(at, key=lambda d: (at[d].costs.update, d))
    ranked, _ = plan(gpu, 8, hw, steps=2)
    splits = [c for c in ranked if c.tsp and c.layout == SPLIT and c.generators == 4]
    assert splits and {c.tsp_degree for c in splits} == {cheapest}
