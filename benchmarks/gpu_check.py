"""GPU check of digen: equivalence, bf16 learning, memory, the cost curves, and with two
GPUs the sharded trainers.

    python benchmarks/gpu_check.py [--device cuda|cpu] [--quick] [--flavour tiny|medium]
                                   [--model flux] [--out DIR] [--set KEY=VALUE ...]

Prints a JSON report; with ``--out DIR`` also writes ``DIR/report.json`` and
``DIR/profile.json`` (read by ``digen simulate --profile DIR/profile.json``). On one device
(the generator and the trainer share it when only one GPU is visible) it:

1. runs one train step in fp32, colocated and disaggregated (one generator, one trainer, TAG
   off, same seed), and compares the two runs' final trainable parameters;
2. runs a few bf16 steps (``model.dtype=bfloat16``, LoRA in fp32) colocated and
   disaggregated with the shipped ``jpeg_compressibility`` reward: step times, and whether
   the reward rose;
3. reports each role's peak memory, from the runs' ``memory/peak_gb/<pool>`` metrics, and
   the log-prob drift of the bf16 disaggregated run (``logprob_drift``: the trainer's
   recomputed log-probs against the generator's at the same weights, none beyond what
   bf16's rounding allows);
4. times generation against micro-batch size, and training against micro-batch size and TSP
   degree, on :class:`digen.runtime.worker.policy.Policy` directly after a warm-up (with each
   point's peak and activation memory on a GPU), and writes them as a profile: the costs at
   one operating point in the format of a run's ``profile.json``, plus every measured point
   under ``curves``; :func:`digen.planning.simulate.load_costs` is checked to read it back;
5. runs every collective path once on the device (``collectives``): a default process group
   carrying CPU and device tensors (NCCL with gloo beside it on a GPU), a full fine-tune
   policy loaded through a one-member FSDP mesh (its peak memory against the transformer's
   size; on a GPU its device peak counts in the verdict), a disaggregated run whose
   weight-broadcast group shares the GPU (gloo, said in ``trainer.log``), and the
   generator's reward threads on the generator's device;
6. with two GPUs or more (``sharded``), one fp32 LoRA step on 2 FSDP trainers, each on a GPU
   of its own (NCCL), against one trainer: trained alike (the L2 norm of the difference under
   1 % of the step's move).

Exit code 0 when every check passed, 1 otherwise (with ``--quick`` the learning check only
reports its numbers), 2 on a usage error. ``--quick`` (tiny sizes, few steps) is the CI
smoke run on a CPU, well under a minute. The full run is sized for about 8 minutes on one
H200 with the medium flavour. ``--curves-only`` skips the runs (items 1-3), e.g. to measure
the curves of real weights (``--model-path``) at the size you will train at; ``--set``
passes config overrides to every run and to the curves (``--set
train.gradient_checkpointing=true``).

Running it on the project's GPU machine
---------------------------------------
That machine's Python (3.12) has torch with CUDA, transformers, peft, aiohttp, uvloop,
click, pyyaml, tqdm and matplotlib, but neither diffusers nor structlog, and it reaches no
package index. Carry their wheels in an ignored folder of the checkout, downloaded here::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux2014_x86_64 -d .whl \\
        diffusers==0.42.1 structlog==26.1.0 importlib_metadata

(all pure-Python wheels; diffusers also needs ``importlib_metadata``, and the rest of what
it needs is there). Then, on that machine, from the repository root, with ``.whl`` carried::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DIGEN_CACHE=/tmp/digen-cache
    python3 benchmarks/gpu_check.py --out $OUT

``PYTHONPATH`` must hold the checkout itself (digen is not installed there); the worker
processes inherit it. Nothing is downloaded: the flavours are random-init models built from
config and cached under ``DIGEN_CACHE``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from digen import DigenRunner, load_config
from digen.config import DigenConfig
from digen.planning.simulate import load_costs
from digen.presets import preset
from digen.registry.models import MODEL_NAMES
from digen.runtime.transport.forkserver import start_fork_server
from digen.sched.costs import Costs, OnlineProfiler

REWARD = "jpeg_compressibility"
"""The shipped reward the learning check trains on (smoother images score higher)."""

EQUALITY_TOL = {"rtol": 1e-5, "atol": 1e-6}
"""Per weight, ``|a - b| <= atol + rtol |b|`` (torch.allclose), as the runtime's tests use.
One Adam step moves a LoRA weight by about the learning rate (1e-3 here), so atol is 0.1 %
of a step."""


@dataclass(frozen=True, slots=True)
class Plan:
    """What one invocation measures; ``--quick`` shrinks every size."""

    device: str
    model: str
    model_path: str | None
    """Real weights (a local diffusers directory); None: the random-init ``flavour``."""
    flavour: str
    quick: bool
    curves_only: bool
    size: int | None
    """Image side in pixels; None: the preset's."""
    inference_steps: int
    window: int
    """Trained (SDE) timesteps per sample."""
    steps: int
    """Train steps of each bf16 run."""
    lr: float | None
    """Learning rate of the bf16 runs; None: the preset's."""
    gen_sizes: tuple[int, ...]
    train_sizes: tuple[int, ...]
    tsp_degrees: tuple[int, ...]
    repeats: int
    """TimedResult calls per curve point (the median is kept)."""
    microbatch: int
    """Micro-batch size at which the profile's costs are taken."""
    extra: tuple[str, ...]
    """``--set`` overrides, applied last everywhere."""


def make_plan(args: argparse.Namespace) -> Plan:
    quick, real = args.quick, args.model_path is not None
    flavour = args.flavour or ("tiny" if quick or args.device == "cpu" else "medium")
    gen_sizes = (1, 2) if quick else (1, 2, 4, 8, 16)
    train_sizes = (1, 2) if quick else (1, 2, 4, 8)
    microbatch = args.microbatch or (2 if quick else 4)
    if microbatch not in gen_sizes or microbatch not in train_sizes:
        raise ValueError(
            f"--microbatch {microbatch} is not measured: choose one of "
            + ", ".join(str(n) for n in train_sizes if n in gen_sizes)
        )
    size = args.size or (None if real else 64 if flavour == "tiny" else 512)
    return Plan(
        device=args.device,
        model=args.model,
        model_path=args.model_path,
        flavour=flavour,
        quick=quick,
        curves_only=args.curves_only,
        size=size,
        inference_steps=4 if quick else 10,
        window=2 if quick else 4,
        steps=args.steps or (3 if quick else 8),
        # tiny: the preset's 0.1; a smaller step for the ~1B medium model (not yet tried on a GPU)
        lr=args.lr or (1e-2 if flavour == "medium" and not real else None),
        gen_sizes=gen_sizes,
        train_sizes=train_sizes,
        tsp_degrees=(1, 2) if quick else (1, 2, 3, 4),
        repeats=args.repeats or (1 if quick else 3),
        microbatch=microbatch,
        extra=tuple(args.set or ()),
    )


# --- configs -----------------------------------------------------------------------------


def config(plan: Plan, mode: str, dtype: str, overrides: Sequence[str] = ()) -> DigenConfig:
    """The run's config: the Flow-GRPO preset, what every run shares, then ``overrides`` and
    the user's ``--set``."""
    shared = [
        f"model.device={plan.device}",
        f"model.dtype={dtype}",
        "train.lora_dtype=float32",
        f"rollout.num_inference_steps={plan.inference_steps}",
        f"rollout.sde_window_size={plan.window}",
        "rollout.sde_window_range=null",
        "train.mini_batch_size=null",  # one optimizer step per train step in both modes
        "runtime.generators=1",
        "runtime.trainers=1",
    ]
    if plan.model_path:
        # the check's own batch, not the published round of 48 prompts
        shared += [f"model.path={plan.model_path}", "data.train_batch_size=8"]
    else:
        shared.append(f"model.flavour={plan.flavour}")
    if plan.size:
        shared += [f"model.height={plan.size}", f"model.width={plan.size}"]
    if plan.lr:
        shared.append(f"train.lr={plan.lr}")
    base = preset(plan.model, "flowgrpo", real_weights=bool(plan.model_path), mode=mode)
    return load_config(base=base, overrides=[*shared, *overrides, *plan.extra])


def pool_overrides(plan: Plan, visible_gpus: int) -> list[str]:
    """Disaggregated pools: two GPUs when there are, else both roles on the one GPU."""
    if plan.device != "cuda":
        return []
    trainer = "cuda:1" if visible_gpus > 1 else "cuda:0"
    return [
        "runtime.placement.generator_devices=cuda:0",
        f"runtime.placement.trainer_devices={trainer}",
    ]


# --- pure summaries ----------------------------------------------------------------------


def compare_states(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], *, rtol: float, atol: float
) -> dict[str, Any]:
    """How far two final trainable states are apart, and whether they count as equal."""
    if a.keys() != b.keys() or not a:
        return {"passed": False, "why": "the runs trained different parameters", "params": 0}
    max_diff, moved, close, exact, numel = 0.0, 0.0, True, True, 0
    for name, pa in a.items():
        pa, pb = pa.detach().float().cpu(), b[name].detach().float().cpu()
        diff = (pa - pb).abs()
        max_diff = max(max_diff, float(diff.max()))
        exact = exact and torch.equal(pa, pb)
        close = close and bool((diff <= atol + rtol * pb.abs()).all())
        numel += pa.numel()
        if "lora_B" in name:  # zero at init: its size is how far the step moved the weights
            moved = max(moved, float(pa.abs().max()))
    return {
        "max_abs_diff": max_diff,
        "exact": exact,
        "moved": moved,
        "params": numel,
        "tensors": len(a),
        **EQUALITY_TOL,
        # equality says something only if the step moved the weights
        "passed": close and moved > 10 * atol,
    }


def learning(rewards: Sequence[float], *, checked: bool) -> dict[str, Any]:
    """First and last reward means (a third of the steps each) and whether the reward rose."""
    k = max(1, len(rewards) // 3)
    first, last = statistics.fmean(rewards[:k]), statistics.fmean(rewards[-k:])
    rose = last > first
    return {
        "reward": REWARD,
        "reward_mean_per_step": list(rewards),
        "first_mean": first,
        "last_mean": last,
        "steps_averaged": k,
        "rose": rose,
        "checked": checked,
        "passed": rose or not checked,
    }


def run_summary(metrics: Sequence[Mapping[str, Any]], wall_s: float) -> dict[str, Any]:
    """Step times (the first one warms up), rewards and peak memory per role of one run."""
    times = [m["step_time_s"] for m in metrics]
    return {
        "steps": len(metrics),
        "step_time_s": times,
        "median_step_time_s": statistics.median(times[1:] or times),
        "reward_mean": [m["reward_mean"] for m in metrics],
        "peak_gb": {
            pool: max(m.get(f"memory/peak_gb/{pool}", 0.0) for m in metrics)
            for pool in ("generator", "trainer")
        },
        # the trainers' recomputed log-probs against the generators' at the same weights
        "logprob_drift_max": max(m.get("train/logprob_drift_max", 0.0) for m in metrics),
        "logprob_drift_over": sum(m.get("train/logprob_drift_over", 0) for m in metrics),
        "wall_s": wall_s,
    }


def logprob_drift(run: Mapping[str, Any]) -> dict[str, Any]:
    """Whether a run's trainers recomputed the generators' log-probs within rounding
    (``train/logprob_drift_*``: docs/TRAINING.md, "Log-prob drift")."""
    return {
        "max": run["logprob_drift_max"],
        "terms_over_bound": run["logprob_drift_over"],
        "passed": run["logprob_drift_over"] == 0,
    }


def profile_dict(
    curves: Mapping[str, Any], costs: Mapping[str, float], point: Mapping[str, Any]
) -> dict[str, Any]:
    """A run's ``profile.json`` (:class:`OnlineProfiler`, one sample per cost at the
    operating point), plus ``operating_point`` and every measured point under ``curves``,
    which :func:`load_costs` ignores."""
    prof = OnlineProfiler()
    pools = {"gen": "generator", "score": "generator"}
    for name, seconds in costs.items():
        prof.add(name, pools.get(name, "trainer"), seconds)
    return {**prof.to_dict(), "operating_point": dict(point), "curves": dict(curves)}


# --- timing on Policy --------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@contextlib.contextmanager
def _peak(device: str, out: dict[str, Any]) -> Iterator[None]:
    """Peak device memory of the block, and how much of it the block added (GPU only)."""
    if not device.startswith("cuda"):
        yield
        return
    torch.cuda.synchronize()
    resident = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    yield
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    out.update(peak_gb=peak / 1e9, activation_gb=(peak - resident) / 1e9)


@contextlib.contextmanager
def _host_peak(out: dict[str, Any]) -> Iterator[None]:
    """How much the block raised this process's peak resident memory, in GB (Linux: the
    peak is restarted through ``/proc/self/clear_refs``); nothing elsewhere."""
    status = Path("/proc/self/status")
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        yield
        return

    def kb(field: str) -> int:
        line = next(x for x in status.read_text().splitlines() if x.startswith(field + ":"))
        return int(line.split()[1])

    before = kb("VmRSS")
    yield
    out["host_added_gb"] = (kb("VmHWM") - before) * 1024 / 1e9


def _timed(fn: Callable[[], Any], device: str, repeats: int) -> dict[str, Any]:
    """``seconds`` (median of ``repeats`` calls) and the peak memory of the first call; on a
    GPU that runs out of memory, ``{"oom": True}`` instead."""
    out: dict[str, Any] = {}
    times = []
    try:
        for i in range(repeats):
            with _peak(device, out) if i == 0 else contextlib.nullcontext():
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError:
        _free(device)
        return {"oom": True}
    return {"seconds": statistics.median(times), **out}


def measure_curves(plan: Plan, cfg: DigenConfig) -> tuple[dict[str, Any], dict[str, float], int]:
    """Generation and training times per micro-batch on :class:`Policy`; the costs at the
    operating point (``plan.microbatch`` samples) and the TSP degree they were taken at (the
    fastest measured there)."""
    from digen.prompts import PromptSet
    from digen.rewards.scoring import build_reward
    from digen.runtime.messages import SampleKey, TrainItem
    from digen.runtime.worker.policy import Policy

    dev = plan.device
    prompt = PromptSet.builtin().prompts[0]
    gen = Policy(cfg, trainable=False)
    trainer = Policy(cfg, trainable=True)

    def keys(n: int) -> list[SampleKey]:
        return [SampleKey(0, 0, i) for i in range(n)]

    def generate(policy: Policy, n: int):
        return policy.generate(keys(n), [prompt] * n)

    generate(gen, 1)  # warm-up: kernels, allocator, text-encoder cache
    points = []
    for n in plan.gen_sizes:
        point = {"microbatch": n, **_timed(lambda n=n: generate(gen, n), dev, plan.repeats)}
        if "seconds" in point:
            point["per_sample_s"] = point["seconds"] / n
        points.append(point)
        log(f"generate  mb={n:<3d} {_show(point)}")
    largest = generate(gen, max(plan.train_sizes))  # the rollouts the updates train on
    rollout = largest.rollout.for_training()
    advantages = torch.randn(len(largest.keys), generator=torch.Generator().manual_seed(0))

    def update(n: int, tsp: int) -> None:
        rows = torch.arange(n)
        item = TrainItem(keys(n), [prompt] * n, rollout.select(rows), advantages[:n])
        trainer.accumulate(item, loss_scale=1.0 / (n * plan.window), tsp_degree=tsp)

    update(1, 1)  # warm-up of the backward pass
    train = []
    for n in plan.train_sizes:
        for tsp in plan.tsp_degrees:
            point = {"microbatch": n, "tsp_degree": tsp}
            point |= _timed(lambda n=n, tsp=tsp: update(n, tsp), dev, plan.repeats)
            train.append(point)
            log(f"update    mb={n:<3d} tsp={tsp} {_show(point)}")
    mb = plan.microbatch
    step = _timed(trainer.optimizer_step, dev, plan.repeats)
    gen_tag = _timed(lambda: generate(trainer, mb), dev, plan.repeats)
    reward = build_reward(cfg.rewards)
    pixels = largest.pixels[:mb]
    score = _timed(lambda: reward.score_sync(pixels, [prompt] * mb), "cpu", plan.repeats)
    at_mb = [p for p in train if p["microbatch"] == mb and "seconds" in p]
    gen_at_mb = [p for p in points if p["microbatch"] == mb and "seconds" in p]
    if not at_mb or not gen_at_mb or "seconds" not in gen_tag:
        raise RuntimeError(f"micro-batches of {mb} ran out of memory: try --microbatch 1")
    best = min(at_mb, key=lambda p: p["seconds"])
    costs = {
        "gen": gen_at_mb[0]["seconds"],
        "gen_tag": gen_tag["seconds"],
        "update": best["seconds"],
        "score": score["seconds"],
        "step": step["seconds"],
    }
    curves = {
        "generate": points,
        "train": train,
        "optimizer_step_s": step["seconds"],
        "score_s": score["seconds"],
        "gen_tag_s": gen_tag["seconds"],
        "trainable_params": sum(p.numel() for p in trainer.params),
        "transformer_params": sum(p.numel() for p in trainer.adapter.transformer.parameters()),
    }
    if dev.startswith("cuda"):
        curves["resident_gb"] = torch.cuda.memory_allocated() / 1e9  # both policy copies
    return curves, costs, best["tsp_degree"]


def _show(point: Mapping[str, Any]) -> str:
    if point.get("oom"):
        return "out of memory"
    mem = f", peak {point['peak_gb']:.2f} GB" if "peak_gb" in point else ""
    return f"{point['seconds']:.3f} s{mem}"


# --- runs --------------------------------------------------------------------------------


def log(msg: str) -> None:
    print(f"[gpu_check] {msg}", file=sys.stderr, flush=True)


def _free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run(cfg: DigenConfig, out: Path, device: str):
    """One :class:`DigenRunner` run; on a CPU the in-process (colocated) run takes one thread,
    as each worker process does, so the two modes use the same kernels."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(cfg.runtime.placement.threads_per_worker)
    t0 = time.perf_counter()
    try:
        runner = DigenRunner(cfg, out_dir=out, progress=False, save_weights=False)
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the report alone
            result = asyncio.run(runner.run())
    finally:
        torch.set_num_threads(threads)
    wall = time.perf_counter() - t0
    _free(device)
    return result, wall


def equality_runs(plan: Plan, pools: list[str], work: Path, report: dict[str, Any]) -> None:
    """One fp32 step colocated and disaggregated: the same final parameters."""
    fp32 = [
        "steps=1",
        "rollout.n=4",
        "runtime.schedule.samples_per_microbatch=4",
        "train.micro_batch_size=4",  # the colocated micro-batches are the generation ones
        "train.lr=1e-3",
        "runtime.schedule.tag=none",
    ]
    states = {}
    for mode in ("colocated", "disaggregated"):
        log(f"fp32 {mode}: 1 step")
        cfg = config(plan, mode, "float32", fp32 + (pools if mode == "disaggregated" else []))
        result, wall = run(cfg, work / f"fp32_{mode}", plan.device)
        report["runs"][f"fp32_{mode}"] = run_summary(result.metrics, wall)
        states[mode] = result.final_state
    report["equality"] = compare_states(
        states["colocated"], states["disaggregated"], **EQUALITY_TOL
    )


SHARDED_REL = 1e-2
"""Two sharded trainers against one: the L2 norm of the weights' difference under this share
of how far one step moved them (the runtime's tests' rule: AdamW lets an element whose
gradient is within rounding of zero step either way, never the weights as a whole)."""


def sharded_runs(plan: Plan, work: Path, report: dict[str, Any]) -> None:
    """With two GPUs or more: one fp32 LoRA step on 2 FSDP trainers, each on a GPU of its
    own (their group on NCCL), against one trainer; trained alike (:data:`SHARDED_REL`)."""
    one_step = ["steps=1", "rollout.n=4", "train.micro_batch_size=2", "train.lr=1e-3"]
    one_step += ["runtime.schedule.tag=none", "runtime.placement.generator_devices=[cuda:0]"]
    layouts = {
        "one_trainer": ["runtime.trainers=1", "runtime.placement.trainer_devices=[cuda:1]"],
        "fsdp_2": [
            "runtime.trainers=2",
            "runtime.placement.trainer_parallel=fsdp",
            "runtime.placement.trainer_devices=[cuda:0,cuda:1]",
        ],
    }
    states = {}
    for name, layout in layouts.items():
        log(f"fp32 disaggregated, {name}: 1 step")
        cfg = config(plan, "disaggregated", "float32", [*one_step, *layout])
        result, wall = run(cfg, work / f"sharded_{name}", plan.device)
        report["runs"][f"fp32_{name}"] = run_summary(result.metrics, wall)
        states[name] = result.final_state
    want, got = states["one_trainer"], states["fsdp_2"]
    moved = sum(float(w.double().square().sum()) for n, w in want.items() if "lora_B" in n)
    diff = sum(float((got[n].double() - w.double()).square().sum()) for n, w in want.items())
    share = (diff / moved) ** 0.5 if moved > 0 else float("inf")
    report["sharded"] = {
        "trainers": 2,
        "relative_difference": share,
        "passed": got.keys() == want.keys() and share <= SHARDED_REL,
    }


def bf16_runs(plan: Plan, pools: list[str], work: Path, report: dict[str, Any]) -> None:
    """A few bf16 steps in each mode: step times, peak memory, and the reward rising."""
    bf16 = [f"steps={plan.steps}", f"rewards.0.name={REWARD}"]
    if plan.quick:
        bf16.append("rollout.n=4")
    for mode in ("colocated", "disaggregated"):
        log(f"bf16 {mode}: {plan.steps} steps")
        cfg = config(plan, mode, "bfloat16", bf16 + (pools if mode == "disaggregated" else []))
        result, wall = run(cfg, work / f"bf16_{mode}", plan.device)
        report["runs"][f"bf16_{mode}"] = run_summary(result.metrics, wall)
    rewards = report["runs"]["bf16_disaggregated"]["reward_mean"]
    report["learning"] = learning(rewards, checked=not plan.quick)
    report["logprob_drift"] = logprob_drift(report["runs"]["bf16_disaggregated"])
    # one process per role in the disaggregated runs
    report["memory_peak_gb"] = {
        f"{dtype}/{pool}": report["runs"][f"{dtype}_disaggregated"]["peak_gb"][pool]
        for dtype in ("fp32", "bf16")
        for pool in ("generator", "trainer")
    }
    report["memory_peak_gb"]["unit"] = (
        "GB of torch.cuda.max_memory_allocated per process"
        if plan.device == "cuda"
        else "GB of peak resident memory per process"
    )


_WHERE_HOOK = """
import json, os
from pathlib import Path
import torch
from digen.rewards.builtin import jpeg_compressibility
from digen.rewards.loop import worker_device

def reward(samples, prompts, metadata):
    here = {"worker_device": worker_device(), "pid": os.getpid()}
    if torch.cuda.is_available():
        here["current_device"] = f"cuda:{torch.cuda.current_device()}"
    out = Path(os.environ["DIGEN_CHECK_WHERE"]) / f"{os.getpid()}.json"
    out.write_text(json.dumps(here))
    return jpeg_compressibility(samples, prompts, metadata)
"""


def collective_checks(plan: Plan, pools: list[str], work: Path, report: dict[str, Any]) -> None:
    """Every collective path once on the device: a default group (the colocated workers' and
    the sharded trainers' kind) carrying CPU and device tensors; a sharded policy loaded
    through a one-member FSDP mesh (built without weights, then each shard read from the
    files), with its device and host peaks against the transformer's size; a
    disaggregated run whose weight-broadcast group shares one GPU (gloo, said in the log);
    the rewards' threads on the generator's device."""
    from datetime import timedelta

    import torch.distributed as dist

    from digen.runtime.transport.groups import destroy_default_group, init_default_group, tcp_store
    from digen.runtime.worker.fsdp import make_mesh
    from digen.runtime.worker.policy import Policy

    device = "cuda:0" if plan.device == "cuda" else "cpu"
    out: dict[str, Any] = {}
    store = tcp_store("127.0.0.1", 0, 1, lead=True, timeout=timedelta(seconds=120))
    init_default_group(store, 0, 1, [device], 120)
    try:
        flag = torch.tensor([1.0])  # a stop flag, loss statistics: CPU tensors
        dist.all_reduce(flag)
        parts = [torch.empty(2)]
        dist.all_gather(parts, torch.arange(2.0))
        grads = torch.ones(4, device=device)
        dist.all_reduce(grads)
        out["default_group"] = {
            "backend": str(dist.get_backend()),
            "cpu_and_device_tensors": bool(flag.item() == 1.0 and float(grads.sum()) == 4.0),
        }
        cfg = config(plan, "colocated", "bfloat16", ["train.lora_rank=0", "algo.kl_coef=0.01"])
        peak: dict[str, Any] = {}
        _free(plan.device)
        with _peak(plan.device, peak), _host_peak(peak):
            policy = Policy(cfg, trainable=True, mesh=make_mesh("fsdp", 1, device.split(":")[0]))
        size = sum(p.numel() * p.element_size() for p in policy.adapter.transformer.parameters())
        # one member holds every shard: the transformer and its KL reference, nothing more on
        # the device; the host holds the other components and no copy of the transformer
        out["fsdp_load"] = {"transformer_gb": size / 1e9, **peak}
        if "peak_gb" in peak:  # on a GPU: the transformer and its reference, little more
            out["fsdp_load"]["passed"] = peak["peak_gb"] <= 2.2 * size / 1e9
        del policy
        _free(plan.device)
    finally:
        destroy_default_group()
    hook = work / "where_hook.py"
    hook.write_text(_WHERE_HOOK)
    where = work / "where"
    where.mkdir()
    os.environ["DIGEN_CHECK_WHERE"] = str(where)
    over = [
        "steps=1",
        "runtime.transport.weight_sync=broadcast",
        f"rewards=[{{name: '{hook}:reward'}}]",
    ]
    log("disaggregated, weights broadcast: 1 step")
    cfg = config(plan, "disaggregated", "bfloat16", [*over, *pools])
    run(cfg, work / "broadcast", plan.device)
    logged = (work / "broadcast" / "trainer.log").read_text()
    out["broadcast_group"] = {
        "ran": True,
        "gloo_on_a_shared_gpu_said": "weight-broadcast group" in logged,
    }
    out["reward_threads"] = [json.loads(p.read_text()) for p in sorted(where.iterdir())]
    gen = (
        cfg.runtime.placement.generator_devices[0]
        if cfg.runtime.placement.generator_devices
        else device
    )
    out["rewards_on_the_generators_device"] = all(
        r["worker_device"] == gen and r.get("current_device", gen) == gen
        for r in out["reward_threads"]
    )
    out["passed"] = bool(
        out["default_group"]["cpu_and_device_tensors"]
        and out["fsdp_load"].get("passed", True)
        and out["reward_threads"]
        and out["rewards_on_the_generators_device"]
    )
    report["collectives"] = out


def write_profile(plan: Plan, work: Path, out: Path, report: dict[str, Any]) -> None:
    """The cost curves, and the profile ``digen simulate --profile`` reads, checked."""
    log("cost curves")
    cfg = config(plan, "disaggregated", "bfloat16", [f"rewards.0.name={REWARD}"])
    threads = torch.get_num_threads()
    if plan.device == "cpu":  # a worker's threads: the costs are a worker's
        torch.set_num_threads(cfg.runtime.placement.threads_per_worker)
    try:
        curves, costs, tsp = measure_curves(plan, cfg)
    finally:
        torch.set_num_threads(threads)
    _free(plan.device)  # the two policy copies are gone with measure_curves' frame
    # the weight sync needs two processes: take it from the disaggregated run's own profile
    run_profile = work / "bf16_disaggregated" / "profile.json"
    sync = OnlineProfiler.load(run_profile).estimate("sync") if run_profile.is_file() else None
    costs["sync"] = sync or 0.0
    point = {
        "microbatch": plan.microbatch,
        "tsp_degree": tsp,
        "model.dtype": cfg.model.dtype,
        "train.lora_dtype": cfg.train.lora_dtype,
        "train.lora_rank": cfg.train.lora_rank,
        "height": cfg.model.height,
        "width": cfg.model.width,
        "num_frames": cfg.model.num_frames,
        "inference_steps": cfg.rollout.num_inference_steps,
        "trained_timesteps": cfg.rollout.sde_window_size,
        "sync_from": "the bf16 disaggregated run's trace" if sync else "not measured (0 s)",
    }
    path = out / "profile.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_dict(curves, costs, point), indent=2) + "\n")
    loaded, want = load_costs(path), Costs(**costs)
    report["profile"] = {
        "path": str(path),
        "costs": loaded.to_dict(),
        "operating_point": point,
        "loaded_back": all(
            math.isclose(getattr(loaded, k), getattr(want, k), rel_tol=1e-9) for k in costs
        ),
    }
    report["curves"] = curves


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def environment(plan: Plan) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "torch": torch.__version__,
        "cuda_available": cuda,
        "cuda_version": torch.version.cuda,
        "visible_gpus": torch.cuda.device_count() if cuda else 0,
        "device_name": torch.cuda.get_device_name(0) if plan.device == "cuda" else _cpu_name(),
        "cpu_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "tf32": {
            "matmul": torch.backends.cuda.matmul.allow_tf32,
            "cudnn": torch.backends.cudnn.allow_tf32,
        },
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CPU smoke)")
    ap.add_argument("--flavour", choices=("tiny", "medium"), help="default: medium on cuda")
    ap.add_argument("--model", choices=MODEL_NAMES, default="flux")
    ap.add_argument("--model-path", help="real weights (a local diffusers directory)")
    ap.add_argument("--out", type=Path, help="write report.json and profile.json here")
    ap.add_argument("--size", type=int, help="image side in px (default: 64 tiny, 512 medium)")
    ap.add_argument("--steps", type=int, help="train steps of the bf16 runs (default 8, quick 3)")
    ap.add_argument("--lr", type=float, help="learning rate of the bf16 runs")
    ap.add_argument("--repeats", type=int, help="timed calls per curve point (default 3)")
    ap.add_argument("--microbatch", type=int, help="the profile's micro-batch (default 4)")
    ap.add_argument("--curves-only", action="store_true", help="skip the runs (items 1-3)")
    ap.add_argument("--set", action="append", metavar="KEY=VALUE", help="a config override")
    args = ap.parse_args(argv)
    start_fork_server()  # the disaggregated runs' workers import while the first runs run
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU (use --device cpu).", file=sys.stderr)
        return 2
    try:
        plan = make_plan(args)
    except ValueError as exc:
        print(f"error: {exc}.", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    report: dict[str, Any] = {"plan": asdict(plan), "environment": environment(plan), "runs": {}}
    gpus = torch.cuda.device_count() if plan.device == "cuda" else 0
    pools = pool_overrides(plan, gpus)
    with tempfile.TemporaryDirectory(prefix="digen-gpu-check-") as tmp:
        work = Path(tmp)
        if not plan.curves_only:
            equality_runs(plan, pools, work, report)
            bf16_runs(plan, pools, work, report)
            collective_checks(plan, pools, work, report)
            if gpus >= 2:
                sharded_runs(plan, work, report)
        write_profile(plan, work, args.out or work, report)
    report["wall_s"] = time.perf_counter() - t0
    report["driver_peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    checks = [report["profile"]["loaded_back"]]
    if not plan.curves_only:
        checks += [report["equality"]["passed"], report["learning"]["passed"]]
        checks.append(report["logprob_drift"]["passed"])
        checks.append(report["collectives"]["passed"])
        if "sharded" in report:
            checks.append(report["sharded"]["passed"])
    report["passed"] = all(checks)
    text = json.dumps(report, indent=2)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "report.json").write_text(text + "\n")
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
