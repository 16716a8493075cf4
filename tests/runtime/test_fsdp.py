"""Sharded trainers (FSDP2 over gloo) against whole-model training, and TSP's all-gathers.

Sharded trainers split each update's rows between them and FSDP sums their gradients with a
reduce-scatter: a different order of float additions than one trainer's, so parameters are
compared to a tolerance well below what one step moves them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from helpers import (
    SMOOTH_REWARD,
    assert_trained_alike,
    free_port,
    read_jsonl,
    run_config,
    tiny_config,
    wider_sd3,
)

from digen.models import load_adapter
from digen.runtime.worker.fsdp import lockstep_chunks, lockstep_terms

COMMON = ["steps=1", "rollout.n=4", "train.micro_batch_size=2", "rollout.num_inference_steps=4"]
COMMON += ["train.mini_batch_size=null", "train.lr=1e-3", SMOOTH_REWARD]


def _run(mode: str, extra: list[str], out: Path):
    return run_config(tiny_config("flux", "flowgrpo", [*COMMON, *extra], mode=mode), out)


def _moved(state: dict[str, torch.Tensor]) -> float:
    """How far one step moved the weights: LoRA B starts at zero; full weights start as
    the saved tiny model's."""
    if any("lora_B" in n for n in state):
        return max(float(v.abs().max()) for n, v in state.items() if "lora_B" in n)
    start = dict(load_adapter("flux").transformer.named_parameters())
    return max(float((v - start[n]).abs().max()) for n, v in state.items())


def _mid_size_sd3(directory: Path) -> Path:
    """The tiny SD3 pipeline with a 150M-parameter transformer (570 MiB in fp32), saved."""
    wider_sd3(directory, heads=16, head_dim=64, layers=4)
    return directory


def _members(world: int, model: Path, out: Path, port: int) -> list[dict]:
    """Run ``world`` trainers of ``load_ranks.py`` at once, forked from the fork server as a
    run's workers are; each one's memory report."""
    import load_ranks

    from digen.runtime.transport import forkserver

    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = (world, port, str(model), str(out))
    procs = [forkserver.process(load_ranks.main, (rank, *args), env=env) for rank in range(world)]
    try:
        for p in procs:
            forkserver.start(p)
        for p in procs:
            p.join(timeout=600)
    finally:
        for p in procs:
            p.kill()
    assert [p.exitcode for p in procs] == [0] * world  # the tracebacks are in the output
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_sharded_trainers_read_only_their_own_rows_of_the_weights(tmp_path: Path) -> None:
    """Three FSDP trainers loading a full fine-tune of a 570 MiB transformer: each builds it
    without weights, shards it, then reads its own rows from the files, so its resident
    memory while loading peaks near a third of a copy, where a whole load (measured the same
    way, one trainer) holds at least one; together their rows are the saved weights, bit for
    bit."""
    from safetensors.torch import load_file

    from digen.runtime.transport.groups import tcp_store

    model = _mid_size_sd3(tmp_path / "model")
    saved = load_file(str(model / "transformer" / "diffusion_pytorch_model.safetensors"))
    copy_kb = sum(t.nbytes for t in saved.values()) / 1024
    store = tcp_store("127.0.0.1", 0, 4, lead=True, timeout=timedelta(minutes=10))
    sharded = _members(3, model, tmp_path / "sharded", store.port)
    whole = _members(1, model, tmp_path / "whole", 0)
    grown = [(r["peak_kb"] - r["before_kb"]) / copy_kb for r in sharded + whole]
    print(f"peak resident memory while loading, in copies of the transformer: {grown}")
    # a third of a copy each, and a little more (seen: 0.37-0.41; building the transformer
    # before sharding it, as a whole load does, gave 0.86-1.07)
    assert max(grown[:3]) < 0.6, grown
    assert grown[3] > 0.95, grown  # the measurement sees a whole copy where there is one
    parts = [load_file(str(tmp_path / "sharded" / f"rank-{r}.safetensors")) for r in range(3)]
    alone = load_file(str(tmp_path / "whole" / "rank-0.safetensors"))
    assert set(saved) - set(parts[0]) == {"pos_embed.pos_embed"}  # a buffer, not a weight
    uneven = 0
    for name in parts[0]:
        value = saved[name]
        rows = torch.cat([p[name] for p in parts]) if value.dim() else parts[0][name]
        assert torch.equal(rows, value), name
        assert torch.equal(alone[name], value), name
        uneven += value.dim() > 0 and value.shape[0] % 3 != 0
    assert uneven > 0  # the last member's chunk of most weights is the shorter


def test_lockstep_chunks_give_every_member_the_same_count() -> None:
    # 5 rows over 2 members, chunks of 2: member 0 has 3 rows (2 chunks), member 1 has 2
    # rows (1 chunk) and a padding chunk; every row is trained exactly once
    assert lockstep_chunks(5, 2, 0, 2) == [[0, 2], [4]]
    assert lockstep_chunks(5, 2, 1, 2) == [[1, 3], None]
    assert lockstep_chunks(1, 2, 1, 4) == [None]
    assert lockstep_chunks(3, 1, 0, 2) == [[0, 1], [2]]


def test_lockstep_terms_deal_every_term_once_and_keep_every_member_busy() -> None:
    # one sample, 4 trained timesteps, 2 members: by samples member 1 would only pad; by
    # terms each takes 2 timesteps of the sample, in one pass of up to 2 terms
    assert lockstep_chunks(1, 2, 1, 2) == [None]
    assert lockstep_terms(1, 4, 2, 0, 2) == [[(0, 0), (0, 2)]]
    assert lockstep_terms(1, 4, 2, 1, 2) == [[(0, 1), (0, 3)]]
    for rows, steps, members, size in [(3, 2, 2, 1), (4, 3, 8, 2), (2, 5, 3, 4), (1, 1, 4, 1)]:
        dealt = [lockstep_terms(rows, steps, members, r, size) for r in range(members)]
        every = [t for chunks in dealt for c in chunks if c is not None for t in c]
        assert sorted(every) == [(i, j) for i in range(rows) for j in range(steps)]
        assert len({len(chunks) for chunks in dealt}) == 1  # the same number of passes
        assert all(len(c) <= size for chunks in dealt for c in chunks if c is not None)
        # the members' shares differ by at most one term
        shares = [sum(len(c) for c in chunks if c is not None) for chunks in dealt]
        assert max(shares) - min(shares) <= 1, shares


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "full", "deal", "grouped"),
    [
        ("flowgrpo", False, "terms", False),
        ("nft", True, "terms", False),
        ("mixgrpo", False, "terms", False),
        ("dancegrpo", True, "terms", False),
        ("flowgrpo", False, "samples", False),
        ("flowgrpo", False, "terms", True),
        ("dancegrpo", True, "terms", True),
        ("nft", True, "samples", True),
    ],
    ids=[
        "flowgrpo-lora",
        "nft-full",
        "mixgrpo-lora",
        "dancegrpo-full",
        "samples-flowgrpo-lora",
        "grouped-flowgrpo-lora",
        "grouped-dancegrpo-full",
        "grouped-samples-nft-full",
    ],
)
def test_sharded_trainers_dealing_terms_train_as_the_colocated_trainer(
    tmp_path: Path, algo: str, full: bool, deal: str, grouped: bool
) -> None:
    """``runtime.placement.shard_deal=terms`` (the default): micro-batches of one sample on
    2 FSDP trainers, each member training its share of the sample's (sample, timestep) terms
    as one timestep batch, end the step with the colocated trainer's weights (NFT: its
    per-term noise drawn for the term wherever it runs). Dealt by samples, one member trains
    the sample and the other runs padding passes: the same weights. With
    ``runtime.schedule.group_updates`` a prompt group's micro-batches are one update (one
    update event a group), their rows dealt together: the same weights again."""
    over = ["train.lora_rank=0", "algo.kl_coef=0.01"] if full else []
    if algo == "nft":
        over = ["train.lora_rank=0"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        colocated = run_config(tiny_config("flux", algo, [*COMMON, *over]), tmp_path / "c")
    finally:
        torch.set_num_threads(threads)
    extra = ["runtime.trainers=2", "runtime.placement.trainer_parallel=fsdp"]
    extra += [f"runtime.placement.shard_deal={deal}", "runtime.schedule.tag=none"]
    extra += ["runtime.schedule.samples_per_microbatch=1"]
    extra += [f"runtime.schedule.group_updates={str(grouped).lower()}"]
    cfg = tiny_config("flux", algo, [*COMMON, *over, *extra], mode="disaggregated")
    sharded = run_config(cfg, tmp_path / deal)
    start = dict(load_adapter("flux").transformer.named_parameters()) if full else None
    assert_trained_alike(sharded.final_state, colocated.final_state, start)
    # every sample trained: as many as the colocated step trained
    terms = sharded.metrics[0]["trained_samples"]
    assert terms == colocated.metrics[0]["trained_samples"] > 0
    updates = [e for e in read_jsonl(tmp_path / deal / "trace.jsonl") if e["kind"] == "update"]
    groups, samples = cfg.data.train_batch_size, cfg.data.train_batch_size * cfg.rollout.n
    assert len(updates) == (groups if grouped else samples)  # one sample a micro-batch


@pytest.mark.slow
def test_sharded_lora_trainers_equal_one_trainer_and_colocated(tmp_path: Path) -> None:
    """LoRA: 2 FSDP trainers (with a TAG micro-batch made by both at once, weights broadcast
    from trainer 0's gathered copy), 1 trainer, the colocated trainer, and 2 colocated HSDP workers end the step with the same weights."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        colocated = _run("colocated", [], tmp_path / "colocated")
    finally:
        torch.set_num_threads(threads)
    one = _run("disaggregated", ["runtime.schedule.tag=none"], tmp_path / "one")
    fsdp_extra = ["runtime.trainers=2", "runtime.placement.trainer_parallel=fsdp"]
    fsdp_extra += [
        "runtime.schedule.tag=static",
        "runtime.schedule.tag_k=1",
        "runtime.transport.weight_sync=broadcast",
    ]
    sharded = _run("disaggregated", fsdp_extra, tmp_path / "fsdp")
    # HSDP with one trainer per sharding group: replicas whose gradients FSDP all-reduces
    hsdp = [
        "train.num_devices=2",
        "runtime.placement.trainer_parallel=hsdp",
        "runtime.placement.shard_size=1",
    ]
    coloc_fsdp = _run("colocated", hsdp, tmp_path / "c2")
    assert colocated.final_state.keys() == sharded.final_state.keys()
    assert _moved(colocated.final_state) > 1e-4  # equality below says something
    for other in (one, sharded, coloc_fsdp):
        assert_trained_alike(other.final_state, colocated.final_state)
    # The loss is not compared: at ratio 1 it is minus the mean advantage, a rounding residue
    # of group-normalised rewards whose spread here is ~1e-3, so rewards that differ in their
    # last bit (generators summing in another order) move it by ~1e-5 from run to run.
    assert sharded.metrics[0]["reward_mean"] == pytest.approx(colocated.metrics[0]["reward_mean"])
    for run in (sharded, colocated):  # nothing clips when recomputed log-probs drift less
        assert run.metrics[0]["train/logprob_drift_max"] < 1e-4  # than the clip range
        assert run.metrics[0]["clip_fraction"] == 0.0
    # the sharded pool is scheduled as one trainer, and it made the TAG micro-batch
    assert sharded.metrics[0]["tag_microbatches"] == 1
    lora = tmp_path / "fsdp" / "lora" / "pytorch_lora_weights.safetensors"
    assert lora.stat().st_size > 0


@pytest.mark.slow
def test_sharded_full_finetune_equals_colocated_and_saves_full_weights(tmp_path: Path) -> None:
    """Full fine-tuning (every weight trained and sharded, the KL reference sharded too):
    2 FSDP trainers == the colocated trainer; trainer 0 saves the gathered weights in the
    layout ``from_pretrained`` loads."""
    full = ["train.lora_rank=0", "algo.kl_coef=0.01"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        colocated = _run("colocated", full, tmp_path / "colocated")
    finally:
        torch.set_num_threads(threads)
    extra = [
        *full,
        "runtime.trainers=2",
        "runtime.placement.trainer_parallel=fsdp",
        "runtime.schedule.tag=none",
    ]
    sharded = _run("disaggregated", extra, tmp_path / "fsdp")
    assert _moved(colocated.final_state) > 1e-4
    # FSDP reduce-scatters the gradients, summing in another order than one process does
    start = dict(load_adapter("flux").transformer.named_parameters())
    assert_trained_alike(sharded.final_state, colocated.final_state, start)
    from diffusers import FluxTransformer2DModel

    saved = FluxTransformer2DModel.from_pretrained(str(tmp_path / "fsdp" / "transformer"))
    for name, value in saved.named_parameters():
        assert torch.equal(value, sharded.final_state[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("full", [False, True], ids=["lora", "full"])
def test_sharded_nft_trainers_keep_the_old_policy_and_its_average(
    tmp_path: Path, full: bool
) -> None:
    """DiffusionNFT on 2 FSDP trainers, LoRA and full fine-tuning: each keeps its shards of
    the old policy (which the second step samples with, served from trainer 0's gathered
    copy, and which a TAG micro-batch samples with on the trainers themselves) and of the
    evaluation's moving average (gathered by both for an evaluation); two steps end with the
    colocated trainer's weights, and the checkpoint's shards load into one unsharded policy
    as the colocated run's old policy and average. Full fine-tuning swaps the old policy in
    for the whole transformer, the root's weights (embedders, ``proj_out``) included, which
    FSDP keeps gathered after a forward without a backward."""
    from digen.runtime.worker.policy import Policy

    nft = ["steps=2", "algo.params.decay_rate=0.25", "eval.every=2", "save_every=2"]
    nft += [f"eval.prompts={_eval_prompts(tmp_path)}"]
    nft += ["train.lora_rank=0"] if full else []

    def run(mode: str, extra: list[str], name: str):
        cfg = tiny_config("flux", "nft", [*COMMON, *nft, *extra], mode=mode)
        return cfg, run_config(cfg, tmp_path / name)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cfg, colocated = run("colocated", [], "colocated")
    finally:
        torch.set_num_threads(threads)
    extra = [
        "runtime.trainers=2",
        "runtime.placement.trainer_parallel=fsdp",
        "runtime.schedule.tag=static",
    ]
    extra += ["runtime.schedule.tag_k=1", "runtime.transport.weight_sync=broadcast"]
    # generation batches of the colocated trainer's size (train.micro_batch_size), so most
    # samples are the colocated ones bit for bit (a batch's size can change their last bits)
    extra += ["runtime.schedule.samples_per_microbatch=2"]
    _, sharded = run("disaggregated", extra, "fsdp")
    start = dict(load_adapter("flux").transformer.named_parameters()) if full else None
    assert_trained_alike(sharded.final_state, colocated.final_state, start)
    assert [r["eval/policy_version"] for r in sharded.evals] == [0, 2]
    assert sharded.metrics[-1]["tag_microbatches"] >= 1  # both members sampled with old

    kept = {}
    for name, run_ in (("colocated", colocated), ("fsdp", sharded)):
        policy = Policy(cfg, trainable=True)
        policy.load_checkpoint(run_.checkpoint, version=2)
        kept[name] = (policy.old, policy.ema)
    assert (sharded.checkpoint / "sharded").is_dir()
    theta = colocated.final_state
    names = list(theta)
    for got, want in zip(kept["fsdp"], kept["colocated"], strict=True):
        assert all(w.dtype == torch.float32 for w in want)
        got_, want_ = dict(zip(names, got, strict=True)), dict(zip(names, want, strict=True))
        # each is an average of the trained weights' iterates, so it differs between the runs
        # by at most as much as they do; it moves less than they do (it lags), so its own
        # move would shrink the scale (seen: 1.07e-2 of it under ATEN_CPU_CAPABILITY=default)
        assert_trained_alike(got_, want_, start, scale=theta)
    old, ema = kept["colocated"]
    # neither is the trained weights: the old policy lags them, the average lags too
    assert max(float((o - theta[n]).abs().max()) for n, o in zip(names, old)) > 1e-5
    assert max(float((e - theta[n]).abs().max()) for n, e in zip(names, ema)) > 1e-5


def _eval_prompts(tmp_path: Path) -> Path:
    path = tmp_path / "eval_prompts.txt"
    path.write_text("a red apple\na blue car on a road\n")
    return path


@pytest.mark.slow
def test_all_gathers_per_update_fall_with_the_tsp_degree(tmp_path: Path) -> None:
    """FSDP all-gathers a block's weights once per forward (and once more for its backward),
    so TSP, which runs k timesteps in one pass, needs the all-gathers of ceil(K / k) passes
    instead of K: counted on 2 gloo members for degree 1, 2 and 4."""
    script = Path(__file__).with_name("fsdp_ranks.py")
    out, port = tmp_path / "report.json", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), "2", str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    report = json.loads(out.read_text())
    counts = {int(d): n for d, n in report["all_gathers"].items()}
    k = report["timesteps"]
    assert k == 4
    passes = {d: math.ceil(k / d) for d in counts}  # 4, 2, 1
    assert counts[1] > counts[2] > counts[4] > 0
    # a pass all-gathers each block twice (forward, then again for its backward) and the
    # root once (its weights stay gathered from its forward to the end of its backward)
    per_pass = 2 * (report["fsdp_modules"] - 1) + 1
    assert {d: n // per_pass for d, n in counts.items()} == passes
    assert all(n % per_pass == 0 for n in counts.values()), counts


@pytest.mark.parametrize(("model", "lora_rank"), [("sd3", 0), ("flux", 4), ("wan", 4)])
def test_a_sharded_trainer_recomputes_the_generators_log_probs_in_bfloat16(
    tmp_path: Path, model: str, lora_rank: int
) -> None:
    """bf16 base (fp32 LoRA where there is one), FSDP2 over one member: at the weights that
    sampled, the trainer's recomputed log-probs are the generator's, bit for bit (the same
    rows in the same batch on the same kernels); FSDP's default mixed precision, which casts
    the fp32 timestep, rotary tables and LoRA weights to bf16 on sharded trainers only,
    drifts (sd3's timestep: steps of 4 above 512 in bf16)."""
    script = Path(__file__).with_name("sharded_drift.py")
    out = tmp_path / "drift.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(script), model, str(lora_rank), str(out)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["drift_terms"] > 0  # the terms were measured
    assert report["drift_max"] == 0.0, report
    assert report["drift_over"] == 0


@pytest.mark.slow
def test_sharded_tag_deals_its_rows_over_the_members(tmp_path: Path) -> None:
    """A TAG micro-batch on 2 FSDP trainers: each member samples half its rows (every other
    key), the rows are put back together (trainer 0 scores them all, each member trains its
    share), and the step ends with the weights one trainer making the same TAG micro-batch
    reaches (samples compared through a reward smooth in them: a half batch may round its
    last bits otherwise)."""
    import asyncio

    from digen.prompts import PromptSet
    from digen.runtime.driver.loop import Driver
    from digen.sched.trace import Trace

    tag = [
        "runtime.schedule.tag=static",
        "runtime.schedule.tag_k=1",
        "runtime.schedule.samples_per_microbatch=4",
    ]
    sharded = ["runtime.trainers=2", "runtime.placement.trainer_parallel=fsdp"]
    cfg = tiny_config("flux", "flowgrpo", [*COMMON, *tag, *sharded], mode="disaggregated")

    async def run() -> tuple[list[dict], dict[str, torch.Tensor], Trace]:
        trace = Trace()
        async with Driver(cfg, None, PromptSet.builtin(), trace) as driver:
            await driver.run(1)
            members = driver.trainers[0].actor.handles
            stats = await asyncio.gather(*(h.call("statistics") for h in members))
            state = await driver.trainers[0].trainable_state()
        return stats, state, trace

    stats, state, trace = asyncio.run(run())
    tagged = [e for e in trace.events if e.kind == "tag"]
    assert len(tagged) >= 1
    rows = 4 * len(tagged)  # every micro-batch is one prompt's 4 samples
    assert [s["sampled_rows"] for s in stats] == [rows // 2, rows // 2]
    one = _run("disaggregated", tag, tmp_path / "one")
    assert one.metrics[0]["tag_microbatches"] == len(tagged)
    assert _moved(one.final_state) > 1e-4
    assert_trained_alike(state, one.final_state)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_nft_trainer_0_keeps_one_full_copy(tmp_path: Path, dtype: str) -> None:
    """DiffusionNFT, full fine-tuning on 2 FSDP trainers: between steps trainer 0 keeps one
    gathered copy of the model in host memory, the old policy it serves the generators, in
    the dtype it travels in (bf16 for a bf16 model: the fp32 shards rounded as the
    generators would round them), and no other; the trained weights are gathered only when
    asked for, and are the trained ones (not the old policy)."""
    import asyncio

    from digen.prompts import PromptSet
    from digen.runtime.driver.loop import Driver
    from digen.sched.trace import Trace

    over = [*COMMON, "train.lora_rank=0", "steps=2", "algo.params.decay_rate=0.25"]
    over += [
        "runtime.trainers=2",
        "runtime.placement.trainer_parallel=fsdp",
        "runtime.schedule.tag=none",
    ]
    cfg = tiny_config("flux", "nft", [*over, f"model.dtype={dtype}"], mode="disaggregated")

    async def run() -> tuple[list[dict], dict, list]:
        async with Driver(cfg, None, PromptSet.builtin(), Trace()) as driver:
            await driver.run(2)
            members = driver.trainers[0].actor.handles
            stats = await asyncio.gather(*(h.call("statistics") for h in members))
            state = await driver.trainers[0].trainable_state()
            old = await members[0].call("_synced")
        return stats, state, old

    stats, state, old = asyncio.run(run())
    assert [s["full_copies"] for s in stats] == [1, 0]
    start = dict(load_adapter("flux").transformer.named_parameters())
    old = dict(old)
    assert state.keys() == old.keys() == start.keys()
    assert {v.dtype for v in old.values()} == {getattr(torch, dtype)}
    state, old = (
        {n: v.float() for n, v in state.items()},
        {n: v.float() for n, v in old.items()},
    )
    # two steps at decay 0.25: the old policy lags the trained weights, both moved
    assert max(float((state[n] - start[n]).abs().max()) for n in start) > 1e-4
    assert max(float((state[n] - old[n]).abs().max()) for n in start) > 1e-6


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algo", "full", "deal"),
    [("flowgrpo", False, "sequence"), ("nft", True, "sequence"), ("flowgrpo", True, "terms")],
)
def test_sequence_parallel_trainers_train_as_the_colocated_trainer(
    tmp_path: Path, algo: str, full: bool, deal: str
) -> None:
    """``runtime.placement.shard_deal=sequence``: 2 FSDP trainers run every term of every
    update with half of each sample's tokens (Ulysses), and sample their TAG micro-batch so
    too; with ``shard_deal=terms`` and ``trainer_sampling=sequence`` only the sampling is
    split so. Either way the step ends with the colocated trainer's weights (rounding
    apart: the samples may differ in their last bits, so the reward is a smooth one). Each
    member held about half of the tokens of the attention it ran."""
    import asyncio

    from digen.prompts import PromptSet
    from digen.runtime.driver.loop import Driver
    from digen.sched.trace import Trace

    over = [*COMMON, SMOOTH_REWARD, *(["train.lora_rank=0"] if full else [])]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        colocated = run_config(tiny_config("flux", algo, over), tmp_path / "c")
    finally:
        torch.set_num_threads(threads)
    extra = ["runtime.trainers=2", "runtime.placement.trainer_parallel=fsdp"]
    extra += [f"runtime.placement.shard_deal={deal}", "runtime.schedule.tag=static"]
    extra += ["runtime.placement.trainer_sampling=sequence"]
    extra += ["runtime.schedule.tag_k=1"]
    cfg = tiny_config("flux", algo, [*over, *extra], mode="disaggregated")

    async def run() -> tuple[list[dict], dict, list[dict]]:
        trace = Trace()
        async with Driver(cfg, None, PromptSet.builtin(), trace) as driver:
            await driver.run(1)
            members = driver.trainers[0].actor.handles
            stats = await asyncio.gather(*(h.call("statistics") for h in members))
            state = await driver.trainers[0].trainable_state()
        return stats, state, [e.to_dict() for e in trace.events]

    stats, state, events = asyncio.run(run())
    start = dict(load_adapter("flux").transformer.named_parameters()) if full else None
    assert_trained_alike(state, colocated.final_state, start)
    # each member held its half of the tokens (the first the larger piece of an odd count)
    shares = [s["token_share"] for s in stats]
    assert shares[0] >= 0.5 >= shares[1] > 0.3 and abs(sum(shares) - 1) < 1e-9, shares
    # the trainers sampled a micro-batch (TAG), sequence-parallel like their updates
    assert any(e["kind"] == "tag" for e in events)
