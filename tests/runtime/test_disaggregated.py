"""The disaggregated runtime over real processes and real RPC.

Equivalence is proven on parameters: one train step on generator and trainer pools ends with
the same LoRA weights as the colocated reference trainer, whatever the split.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import SMOOTH_REWARD, assert_trained_alike, read_jsonl, run_config, tiny_config

from digen.prompts import PromptSet
from digen.runtime.driver.loop import Driver
from digen.sched.trace import Trace

COMMON = ["steps=1", "rollout.n=4", "train.micro_batch_size=2", "rollout.num_inference_steps=4"]
COMMON.append("train.mini_batch_size=null")  # one optimizer step per train step, as on-policy
COMMON.append("train.lr=1e-3")  # Adam moves each weight ~lr; 1e-6 is then 0.1 % of a step


def _cfg(model: str, algo: str, mode: str, extra: list[str]):
    return tiny_config(model, algo, [*COMMON, *extra], mode=mode)


def _assert_same_weights(a: dict, b: dict, *, exact: bool) -> None:
    """The same weights: bit for bit where the two runs compute alike (``exact``), else as
    AdamW lets two runs that differ by rounding be compared (:func:`assert_trained_alike`)."""
    assert a.keys() == b.keys() and len(a) > 0
    if not exact:
        assert_trained_alike(b, a)
        return
    moved = 0.0
    for name, p in a.items():
        assert torch.equal(b[name], p), name
        if "lora_B" in name:
            moved = max(moved, float(p.abs().max()))
    assert moved > 1e-4  # the step moved the weights, so equality says something


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "algo", "both", "extra", "exact"),
    [
        # GAP (a prompt's samples spread over 2 generators) and TSP (2 timesteps per forward),
        # with GRPO-Guard: generators keep each step's mean, and trainers fetch it
        (
            "flux",
            "flowgrpo",
            ["algo.ratio_norm=true", SMOOTH_REWARD],
            ["runtime.generators=2", "runtime.schedule.tsp_degree=2"],
            False,
        ),
        # GAP over 3 generators (6 samples: 3 micro-batches per group), two TAG micro-batches.
        # The micro-batches are the colocated trainer's own (2 samples) and gradients are
        # summed in micro-batch order: the same bits, wherever each ran.
        # two rewards weighted at the advantage level (each reward's own group advantages)
        (
            "sd3",
            "flowgrpo",
            [
                "rollout.n=6",
                "algo.reward_weighting=advantage",
                "rewards=[jpeg_incompressibility, {name: jpeg_compressibility, weight: 0.25}]",
            ],
            ["runtime.generators=3", "runtime.schedule.tag=static", "runtime.schedule.tag_k=2"],
            True,
        ),
        # a published recipe's mini-batches: two optimizer steps in the train step (the
        # second off-policy), with GAP, TSP (in both modes: the same batched forwards), TAG
        # and two data-parallel trainers. Each optimizer step sums its own mini-batch's
        # micro-batches in order, as the colocated trainer does: the same bits.
        (
            "flux",
            "flowgrpo",
            ["train.mini_batch_size=1", "runtime.schedule.tsp_degree=2"],
            [
                "runtime.generators=2",
                "runtime.trainers=2",
                "runtime.schedule.tag=static",
                "runtime.schedule.tag_k=2",
            ],
            True,
        ),
        # DiffusionNFT: generators keep only clean latents and sample with the old policy,
        # which trainer 0 serves after each step; two steps, so the second samples with an
        # old policy a quarter of the way back to the first step's weights. GAP, TSP over
        # the trained timesteps, TAG: the same bits.
        (
            "sd3",
            "nft",
            ["steps=2", "runtime.schedule.tsp_degree=2", "algo.params.decay_rate=0.25"],
            ["runtime.generators=2", "runtime.schedule.tag=static", "runtime.schedule.tag_k=2"],
            True,
        ),
        # AWM: clean latents only, sampled with the trained weights; each trained term's
        # noise seeded by the term, so GAP, TSP and TAG change nothing: the same bits
        (
            "sd3",
            "awm",
            ["steps=2", "runtime.schedule.tsp_degree=2"],
            ["runtime.generators=2", "runtime.schedule.tag=static", "runtime.schedule.tag_k=2"],
            True,
        ),
        # DGPO: a group's terms weighed together, so whole groups everywhere (a colocated
        # micro-batch of the group's 4, prompt-axis micro-batches); the moving-average old
        # copy, a quarter of the way back to the first step's weights, samples the second
        # step and anchors its clip: the same bits
        (
            "sd3",
            "dgpo",
            [
                "steps=2",
                "train.micro_batch_size=4",
                "runtime.schedule.tsp_degree=2",
                "algo.params.decay_start=0",  # lagging from the first step: d = 0.25
                "algo.params.decay_rate=0.25",
                "algo.params.clip_range=0.05",
            ],
            [
                "runtime.generators=2",
                "runtime.schedule.microbatch_axis=prompt",
                "runtime.schedule.tag=static",
                "runtime.schedule.tag_k=2",
            ],
            True,
        ),
        # two data-parallel trainers, weights by broadcast, whole groups, no pipelining;
        # the colocated reference samples whole groups too (one batch shape, the same bits)
        (
            "wan",
            "dancegrpo",
            ["train.micro_batch_size=4", SMOOTH_REWARD],
            [
                "runtime.trainers=2",
                "runtime.transport.weight_sync=broadcast",
                "runtime.schedule.microbatch_axis=prompt",
                "runtime.schedule.pipeline=false",
            ],
            False,
        ),
    ],
)
def test_disaggregated_step_equals_colocated(
    tmp_path: Path, model, algo, both, extra, exact
) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(
        1
    )  # as each worker (runtime.placement.threads_per_worker): the same kernels
    try:
        colocated = run_config(_cfg(model, algo, "colocated", both), tmp_path / "colocated")
    finally:
        torch.set_num_threads(threads)
    disagg = run_config(
        _cfg(model, algo, "disaggregated", [*both, *extra]), tmp_path / "disaggregated"
    )
    assert set(disagg.metrics[0]) == set(colocated.metrics[0])  # one metrics builder
    keys = ("reward_mean", "reward_std", "loss", "clip_fraction", "approx_kl")
    got, want = ([{k: m[k] for k in keys} for m in r.metrics] for r in (disagg, colocated))
    if exact:
        assert got == want
    else:
        for g, w in zip(got, want, strict=True):  # the loss is ~0 on-policy
            assert g == pytest.approx(w, rel=1e-5, abs=1e-7)
    _assert_same_weights(colocated.final_state, disagg.final_state, exact=exact)
    chrome = json.loads((tmp_path / "disaggregated" / "trace.json").read_text())
    names = {e["args"]["name"] for e in chrome["traceEvents"] if e.get("name") == "process_name"}
    assert {"driver", "generator-0", "trainer-0"} <= names
    assert (tmp_path / "disaggregated" / "timeline.png").stat().st_size > 10_000
    m = disagg.metrics[0]
    assert 0 < m["utilisation"] <= 1 and m["bubble_fraction"] == pytest.approx(1 - m["utilisation"])


@pytest.mark.asyncio
async def test_trace_accounts_for_every_microbatch_and_version() -> None:
    cfg = _cfg(
        "sd3",
        "flowgrpo",
        "disaggregated",
        ["runtime.generators=2", "steps=2", "data.train_batch_size=2", "train.lr=1e-2"],
    )
    trace = Trace()
    async with Driver(cfg, None, PromptSet.builtin(), trace) as driver:
        results = await driver.run(2)
        pids = await asyncio.gather(*(a.ping() for a in driver.gens + driver.trainers))
        gen_state = await driver.gens[1].actor.call("trainable_state")
        trainer_state = await driver.trainers[0].trainable_state()
        held = await asyncio.gather(
            *(a.actor.call("statistics") for a in driver.gens + driver.trainers)
        )
    assert [r.metrics["policy_version"] for r in results] == [1, 2]
    assert all(h["held"] == 0 for h in held)  # every rollout was taken by its update
    # prompts reach the trainer with the rollouts: it encodes only the prompts of what it
    # generated itself (TAG; 2 micro-batches a group), and the negative prompt under CFG
    tagged = {(e.step, e.mb // 2) for e in trace.events if e.kind == "tag"}
    negative = int(cfg.rollout.guidance_scale > 1.0)
    assert held[-1]["encoded_prompts"] == len(tagged) + negative
    assert len(set(pids)) == 3  # two generators and a trainer, each its own process
    # the first bubble of a run is always filled by TAG (it measures the trainer's speed)
    assert any(e.kind == "tag" and e.step == 0 for e in trace.events)

    # after the last sync the generators hold exactly the trainer's weights
    assert gen_state.keys() == trainer_state.keys()
    for name, value in trainer_state.items():
        assert torch.equal(gen_state[name], value), name
    assert any(float(v.abs().max()) > 0 for n, v in trainer_state.items() if "lora_B" in n)

    events = trace.events
    for step in range(2):
        mine = [e for e in events if e.step == step]
        made = [e for e in mine if e.kind in ("generate", "tag")]  # TAG: made on a trainer
        by_kind = {k: Counter(e.mb for e in mine if e.kind == k) for k in ("score", "update")}
        by_kind["generate or tag"] = Counter(e.mb for e in made)
        n_mb = 2 * 2  # 2 prompts x (4 samples / 2 per micro-batch)
        for kind, counts in by_kind.items():
            assert sorted(counts) == list(range(n_mb)), kind
            assert set(counts.values()) == {1}, kind  # each exactly once
        # every trajectory of step s was made with version s (on-policy), TAG ones included
        assert {e.version for e in made} == {step}
        # generation and training ran in different processes; TAG ran on the trainer
        assert {e.worker for e in mine if e.kind == "generate"} == {"generator-0", "generator-1"}
        assert {e.worker for e in mine if e.kind in ("update", "tag")} == {"trainer-0"}
        # an update starts only after its micro-batch was scored
        scored = {e.mb: e.t1 for e in mine if e.kind == "score"}
        assert all(e.t0 >= scored[e.mb] - 1e-6 for e in mine if e.kind == "update")


@pytest.mark.slow
@pytest.mark.asyncio
async def test_a_dead_worker_stops_the_run_with_its_name_and_leaves_no_process() -> None:
    """With ``runtime.elastic.on_generator_loss = fail`` a lost generator ends the run as a lost
    trainer does (the default goes on: test_elastic.py)."""
    import os
    import signal
    import time

    from digen.runtime.transport.actors import WorkerDied

    over = ["runtime.generators=2", "steps=3", "runtime.elastic.on_generator_loss=fail"]
    cfg = _cfg("sd3", "flowgrpo", "disaggregated", over)
    driver = Driver(cfg, None, PromptSet.builtin(), Trace())
    killed_at: list[float] = []

    def kill_after_first_step(result) -> None:
        os.kill(pids["generator-1"], signal.SIGKILL)
        killed_at.append(time.monotonic())

    async with driver:
        pids = driver.cluster.system.pids()
        with pytest.raises(
            WorkerDied, match="generator-1.*runtime.elastic.on_generator_loss is fail"
        ):
            await asyncio.wait_for(driver.run(3, kill_after_first_step), timeout=60)
        assert time.monotonic() - killed_at[0] < 15
    time.sleep(0.5)
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # every worker process is gone


# every backbone; MixGRPO(-Flash), Flow-GRPO and DanceGRPO each on image and video backbones, NFT on video;
# the colocated suite runs every pair in-process (tests/run/test_run.py); these spawn processes,
# so each model and each algorithm runs at least once (the runtime is the same for all)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "algo"),
    [
        ("flux", "mixgrpo"),
        ("sd3", "dancegrpo"),
        ("wan", "flowgrpo"),
        ("hunyuanvideo", "dancegrpo"),
        ("qwenimage", "mixgrpo-flash"),  # a DPM-Solver++ tail on fewer steps after the window
        ("hunyuanvideo", "nft"),  # clean video latents only, sampled with the old policy
    ],
)
def test_digen_run_disaggregated_every_model_and_algo(
    tmp_path: Path, model: str, algo: str
) -> None:
    from click.testing import CliRunner

    from cli.main import main

    out = tmp_path / "out"
    args = ["run", "--mode", "disaggregated", "--model", model, "--algo", algo, "--steps", "1"]
    args += ["--out", str(out), "--quiet", "rollout.n=2", "train.micro_batch_size=2"]
    args += ["rollout.num_inference_steps=3", "model.flavour=tiny"]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    row = read_jsonl(out / "metrics.jsonl")[0]
    assert row["samples"] == 4 and row["policy_version"] == 1
    assert 0 < row["utilisation"] <= 1 and row["overhead_fraction"] >= 0
    assert row["reward_min"] <= row["reward_mean"] <= row["reward_max"]
    kinds = Counter(e["kind"] for e in read_jsonl(out / "trace.jsonl"))
    # 2 prompts x 2 samples, one group per micro-batch with one generator: 2 of each, and
    # an optimizer step for each of the preset's two mini-batches
    made = kinds["generate"] + kinds["tag"]  # the first bubble is filled by a TAG probe
    assert (made, kinds["score"], kinds["update"], kinds["step"]) == (2, 2, 2, 2)
    assert row["optimizer_steps"] == 2
    assert kinds["tag"] == row["tag_microbatches"]
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (out / "timeline.png").is_file() and (out / "samples" / "step_0000.png").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["rpc", "broadcast"])
@pytest.mark.asyncio
async def test_heterogeneous_pools_sync_in_buckets(sync: str) -> None:
    """bf16 generators, fp32 trainers: weights travel in fp32 (the pools differ), in many small buckets, and
    what a trainer receives (bf16 prompt embeddings) is cast to its own dtype before use."""
    over = [
        "runtime.placement.generator_dtype=bfloat16",
        "runtime.placement.trainer_dtype=float32",
        "steps=2",
    ]
    over += [
        f"runtime.transport.weight_sync={sync}",
        "runtime.transport.sync_bucket_mb=0.01",
        "runtime.schedule.tag=none",
    ]
    cfg = _cfg("sd3", "flowgrpo", "disaggregated", over)
    async with Driver(cfg, None, PromptSet.builtin(), Trace()) as driver:
        results = await driver.run(2)
        gen_state = await driver.gens[0].actor.call("trainable_state")
        trainer_state = await driver.trainers[0].trainable_state()
        stats = await driver.trainers[0].actor.call("statistics")
    assert stats["encoded_prompts"] == 0  # every embedding came from the bf16 generator
    assert {v.dtype for v in gen_state.values()} == {torch.bfloat16}
    assert {v.dtype for v in trainer_state.values()} == {torch.float32}
    moved = 0.0
    for name, value in trainer_state.items():
        assert torch.equal(gen_state[name], value.to(torch.bfloat16)), name
        moved = max(moved, float(value.abs().max()) if "lora_B" in name else 0.0)
    assert moved > 0 and len(results) == 2
    assert results[-1].metrics["memory/peak_gb/trainer"] > 0
