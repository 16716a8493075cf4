"""The paper's settings, projected with the planner's GPU terms: colocated (with and without
TSP), a rollout-engine colocation with swaps, naive disaggregation and digen, on the paper's
three testbeds, next to the paper's figures.

    python benchmarks/gpu_check.py --device cpu --curves-only --size 256 --out cpu-check/
    python benchmarks/paper_settings.py --profile cpu-check/profile.json [--json rows.json]

    # with a GPU profile (its ratios, measured on a GPU)
    python benchmarks/gpu_check.py --out gpu-check/
    python benchmarks/paper_settings.py --profile gpu-check/profile.json

**Costs.** A sample's generation is sized by FLOPs: ``2 x params x tokens + 4 x blocks x
tokens^2 x hidden`` a denoiser pass (the paper's resolution, 16 px to a token, a quarter of the
frames, 256 text tokens), times the passes (sampling steps, twice with separate guidance
passes), at :data:`MFU` of the device's dense bf16 throughput. The other costs keep the
profile's *ratios* to generation: an update per trained timestep against one denoiser pass,
TSP's saving at degree 4 (other degrees on the line through the two timings, as the planner
models them), scoring. A CPU profile's ratios are a CPU's; the output says which
profile it used. Training passes keep their activations (the setting's tokens, at
:data:`~digen.planning.hardware.ACTIVATION_BYTES` a token and hidden unit a block), and a
layout whose pass does not fit otherwise checkpoints every block and pays the recompute.
The optimizer step is memory-bound: the sharded Adam state read and written at
:data:`HBM_GB_S`.

**Layouts** (all on the same devices, batch 32 = 4 prompts x 8, one sample a micro-batch):

- *colocated*: every device samples then trains its 32 / D samples, FSDP over all devices
  when the training state does not fit one, sampling the cheapest way that fits (a gathered
  copy, sampling from the shards, or offloading the training state);
- *colocated + TSP*: the same with digen's TSP, at the degree that is fastest and fits
  (4, or a power of two up to the trained timesteps: its activations grow with it);
- *rollout engine*: colocation with a separate sampling engine holding its own copy, which
  swaps with the training state through host memory when both do not fit (veRL-Omni's
  design with vLLM-Omni and FSDP);
- *naive*: half the devices generate, half train, the whole batch before any update;
- *digen*: the same even split with GAP groups, TSP (at the degree whose update is cheapest
  and fits, as the planner chooses), BTS and scoring beside generation,
  and *+ TCSS* (one version, half a step early); new weights reach the generators over the
  link between the pools every step; sharded trainers deal an update's (sample, timestep)
  terms over their members and take a prompt group's micro-batches as one update, sample
  TAG micro-batches with the tokens split when that is faster, and the generators run on
  the fastest number of devices each (sequence parallelism, and CFG parallelism where
  sampling is guided); *no SP* is + TCSS without either, and *samples dealt* is + TCSS
  dealing whole samples, one micro-batch an update, instead;
- *planner*: what ``digen simulate recommend`` ranks first over every layout, at the
  micro-batch size where its first choice is fastest.

Step times are the steady steps of a 4-step simulation (the mean after the first). The
output is markdown; ``--json FILE`` writes the rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from digen.planning.hardware import TRAINED_BYTES, Device, Hardware, ModelSize, weakest
from digen.planning.layouts import (
    DoesNotFit,
    Workload,
    best_colocated,
    grouped_update,
    plan,
    split_costs,
    with_grouped_updates,
)
from digen.registry.models import get_backbone
from digen.sched import BTS, Costs, NoTAG, simulate

MFU = 0.4
"""Share of a device's dense bf16 throughput a denoiser pass reaches (an assumption)."""
HBM_GB_S = 1500.0
"""Memory bandwidth the optimizer step streams its state at (an assumption)."""
BATCH, GROUP = 32, 8
STEPS = (20, 30, 40)
FRACTIONS = (0.4, 0.6)
TEXT_TOKENS = 256

# The paper's testbeds (its section 5.1): a 48 GB GPU of 309.7 sparse (155 dense) bf16
# TFLOPS on PCIe, nodes on 200 Gb/s; an 80 GB GPU of 989 dense TFLOPS on NVLink, nodes on
# 400 Gb/s; a 96 GB GPU of 504 dense TFLOPS on PCIe Gen5, nodes on 200 Gb/s.
TESTBED = {
    "A": Device(kind="testbed-A", memory_gb=48, link_gb_s=25, host_gb_s=25, tflops=155),
    "B": Device(kind="testbed-B", memory_gb=80, link_gb_s=450, host_gb_s=50, tflops=989),
    "C": Device(kind="testbed-C", memory_gb=96, link_gb_s=25, host_gb_s=50, tflops=504),
}
CROSS = {"A": 25.0, "B": 50.0, "C": 25.0}
"""Between nodes (where the two pools meet), GB/s."""


@dataclass(frozen=True)
class Setting:
    name: str
    model: str
    height: int
    width: int
    frames: int | None
    guidance_passes: int
    reward_params: float
    testbeds: tuple[str, str]
    """(generators', trainers') testbed."""
    devices: tuple[int, ...]
    paper: str


SETTINGS = (
    Setting(
        "HunyuanVideo, DanceGRPO, testbed A",
        "hunyuanvideo",
        352,
        352,
        25,
        1,
        2e9,
        ("A", "A"),
        (16, 32),
        "1.04-1.37x colocated, 1.13-1.49x with TCSS",
    ),
    Setting(
        "Wan2.1 14B, Flow-GRPO, testbed B",
        "wan",
        352,
        352,
        25,
        2,
        2e9,
        ("B", "B"),
        (16, 32),
        "1.13-1.34x colocated, 1.21-1.45x with TCSS",
    ),
    Setting(
        "HunyuanVideo, heterogeneous: 8 x A generate, 8 x C train",
        "hunyuanvideo",
        352,
        352,
        25,
        1,
        2e9,
        ("A", "C"),
        (16,),
        "1.46-1.85x colocated",
    ),
    Setting(
        "QwenImage 20B, Flow-GRPO, testbed B, vs a rollout engine",
        "qwenimage",
        512,
        512,
        None,
        2,
        8e9,
        ("B", "B"),
        (32,),
        "1.56-2.21x veRL-Omni",
    ),
)


def load_ratios(path: Path) -> dict[str, Any]:
    """The profile's cost ratios, and where it was measured: an update's to a generation's
    per sample at the largest micro-batch both curves timed (the most compute-bound point,
    as a GPU's work is; on a CPU one sample alone can take a slower kernel path), and TSP's
    saving at the smallest (where batching timesteps is what fills a device)."""
    prof = json.loads(path.read_text())
    curves, point = prof.get("curves"), prof.get("operating_point")
    if not curves or not point:
        raise SystemExit(
            f"error: {path} has no cost curves: write it with benchmarks/gpu_check.py."
        )
    gens = {p["microbatch"]: p["seconds"] for p in curves["generate"] if "seconds" in p}
    trains = {p["microbatch"] for p in curves["train"] if "seconds" in p}
    if not set(gens) & trains:
        raise SystemExit(f"error: {path} has no micro-batch that both curves timed.")
    mb = max(set(gens) & trains)
    train = [p for p in curves["train"] if p["microbatch"] == mb and "seconds" in p]
    by_tsp = {p["tsp_degree"]: p["seconds"] for p in train}
    small = min(trains)
    tsp = {
        p["tsp_degree"]: p["seconds"]
        for p in curves["train"]
        if p["microbatch"] == small and "seconds" in p
    }
    per_pass = gens[mb] / point["inference_steps"]
    report = path.with_name("report.json")
    device = "unknown device"
    if report.is_file():
        env = json.loads(report.read_text()).get("environment", {})
        kind = "a GPU" if env.get("cuda_available") else "a CPU: not a GPU's ratios"
        device = f"{env.get('device_name', device)} ({kind})"
    return {
        "update_per_pass": by_tsp[min(by_tsp)] / point["trained_timesteps"] / per_pass,
        "tsp4": tsp.get(4, tsp[min(tsp)]) / tsp[min(tsp)],
        "score_per_gen": curves.get("score_s", 0.0) / point["microbatch"] / (gens[mb] / mb),
        "where": f"{device}, {point.get('height')}x{point.get('width')} px, "
        f"micro-batches of {mb} (TSP: of {small})",
    }


def tokens_of(s: Setting) -> int:
    """A sample's sequence: 16 px to a token, a quarter of the frames, and the text."""
    tokens = (s.height // 16) * (s.width // 16)
    if s.frames:
        tokens *= (s.frames - 1) // 4 + 1
    return tokens + TEXT_TOKENS


def pass_seconds(s: Setting, device: Device) -> float:
    """One denoiser pass of one sample, from FLOPs at :data:`MFU`."""
    b = get_backbone(s.model)
    tokens = tokens_of(s)
    flops = 2 * b.params * tokens + 4 * b.blocks * tokens**2 * b.hidden
    return flops / (device.tflops * 1e12 * MFU)


SIZES = (1, 2, 4, 8)
"""Samples a micro-batch: each layout is projected at the size that suits it best."""


def workload(
    s: Setting,
    r: dict[str, Any],
    steps: int,
    fraction: float,
    trainers: int,
    size: int,
    lora: int,
    deal: str = "terms",
) -> Workload:
    """The setting's costs per micro-batch of ``size`` samples on its trainers' device (the
    planner's reference); a micro-batch costs ``size`` samples (a GPU is compute-bound at
    these sizes). ``deal``: what sharded trainers deal over their members."""
    device = TESTBED[s.testbeds[1]]
    one = pass_seconds(s, device)
    gen = one * steps * s.guidance_passes * size
    trained = round(fraction * steps)  # trained timesteps a sample
    update = r["update_per_pass"] * one * trained * size
    model = ModelSize.of(
        s.model, lora_rank=lora, reward_params=s.reward_params, tokens=tokens_of(s)
    )
    step = 2 * TRAINED_BYTES * model.trained / trainers / (HBM_GB_S * 1e9)
    costs = Costs(gen=gen, update=update, score=r["score_per_gen"] * gen, step=step)
    return Workload(
        costs=costs,
        microbatches=BATCH // size,
        samples_per_microbatch=size,
        mbs_per_group=GROUP // size,
        update_tsp=update * r["tsp4"],
        tsp_degree=4,
        passes=steps * s.guidance_passes,
        timesteps=trained,
        pass_samples=size,
        shard_deal=deal,
        guided=s.guidance_passes == 2,
        model=model,
    )


def _split(
    w: Workload,
    hw: Hardware,
    half: int,
    *,
    tsp: bool,
    policy: str,
    tcss: bool,
    grouped: bool = False,
    parallel: bool = False,
) -> tuple[float, int]:
    """A split's step time and TSP degree; ``parallel``: the fastest of its generators on one device each
    and on several (sequence parallelism, and CFG parallelism where sampling is guided)."""
    ways = [(1, False)]
    if parallel:
        for cfg in (False, True) if w.guided else (False,):
            ways += [
                (q, cfg) for q in (1, 2, 4, 8) if q * (1 + cfg) > 1 and half % (q * (1 + cfg)) == 0
            ]
    times: list[tuple[float, int]] = []
    for sequence, cfg in ways:
        try:
            times.append(
                _one_split(w, hw, half, tsp, policy, tcss, grouped, sequence, cfg, parallel)
            )
        except DoesNotFit:
            if (sequence, cfg) == (1, False):
                raise
    return min(times)


def _colocated(w: Workload, hw: Hardware, devices: int, *, tsp: bool, **kw: Any) -> Any:
    """The fastest colocated layout over the TSP degrees whose passes fit."""
    fits = []
    for at in w.at_degrees(tsp):
        try:
            fits.append(best_colocated(at, hw, devices, tsp=tsp, **kw))
        except DoesNotFit as exc:
            why = exc
    if not fits:
        raise why
    return min(fits, key=lambda c: (c.step_time, c.tsp_degree))


def _one_split(
    w, hw, half, tsp, policy, tcss, grouped, sequence, cfg, parallel
) -> tuple[float, int]:
    sampling = None if parallel else "rows"  # the faster, or the rows dealt
    # as the planner does: the TSP degree whose update is cheapest among those that fit
    fits = []
    for at in w.at_degrees(tsp):
        try:
            split = split_costs(
                at, hw, half, half, tsp=tsp, sequence=sequence, cfg=cfg, trainer_sampling=sampling
            )
        except DoesNotFit as exc:
            why = exc
            continue
        fits.append((split.costs.update, at.tsp_degree, at, split))
    if not fits:
        raise why
    _, degree, w, split = min(fits, key=lambda f: (f[0], f[1]))
    costs, slots = split.costs, split.slots
    gens = half // (sequence * (2 if cfg else 1))
    group = {}
    if grouped and split.strategy == "fsdp trainers" and w.mbs_per_group > 1:
        # a group's micro-batches as one update
        dealt = dataclasses.replace(w, shard_deal=split.shard_deal)
        update_of = grouped_update(dealt, hw, half, tsp=tsp)
        costs = with_grouped_updates(costs, update_of, w.mbs_per_group)
        group = {"group_updates": True}
    if policy == "naive":
        res = simulate(
            costs, w.microbatches, gens, slots, NoTAG(), steps=4, mbs_per_group=w.microbatches
        )
    else:
        stale = {"max_staleness": 1, "staleness_ratio": 0.5} if tcss else {}
        res = simulate(
            costs,
            w.microbatches,
            gens,
            slots,
            BTS(),
            steps=4,
            mbs_per_group=w.mbs_per_group,
            score_overlap=True,
            **stale,
            **group,
        )
    return _mean(res), degree if tsp else 1


def project(
    s: Setting, r: dict[str, Any], devices: int, steps: int, fraction: float, lora: int
) -> dict[str, Any]:
    """Step times of every layout at one setting, each at its best micro-batch size."""
    g_kind, t_kind = s.testbeds
    half = devices // 2
    hetero = g_kind != t_kind
    hw = Hardware(
        generator=TESTBED[g_kind],
        trainer=TESTBED[t_kind],
        generators=half if hetero else None,
        trainers=half if hetero else None,
        cross_gb_s=CROSS[g_kind],
    )
    mixed = weakest(hw.generator, hw.trainer) if hetero else None
    layouts: dict[str, Any] = {
        "colocated": lambda w: _colocated(w, hw, devices, tsp=False, device=mixed),
        "colocated+tsp": lambda w: _colocated(w, hw, devices, tsp=True, device=mixed),
        "rollout engine": lambda w: _colocated(
            w, hw, devices, tsp=False, device=mixed, engine=True
        ),
        "naive": lambda w: _split(w, hw, half, tsp=False, policy="naive", tcss=False),
        "digen": lambda w: _split(
            w, hw, half, tsp=True, policy="bts", tcss=False, grouped=True, parallel=True
        ),
        "digen+tcss": lambda w: _split(
            w, hw, half, tsp=True, policy="bts", tcss=True, grouped=True, parallel=True
        ),
        "digen+tcss no sp": lambda w: _split(
            w, hw, half, tsp=True, policy="bts", tcss=True, grouped=True
        ),
        "digen+tcss by samples": lambda w: _split(w, hw, half, tsp=True, policy="bts", tcss=True),
    }
    row: dict[str, Any] = {}
    for name, run in layouts.items():
        best = None
        deal = "samples" if name.endswith("by samples") else "terms"
        for size in SIZES:
            try:
                got = run(workload(s, r, steps, fraction, half, size, lora, deal))
            except DoesNotFit:  # this micro-batch's training pass does not fit
                continue
            if isinstance(got, tuple):  # a split's (step time, TSP degree)
                (t, degree), how = got, ""
            else:
                t, degree, how = got.step_time, got.tsp_degree, got.strategy
                how += ", checkpointed" if got.checkpointing else ""
            if best is None or t < best[0]:
                best = (t, size, how, degree)
        if best is None:
            raise SystemExit(f"error: {name} fits at no micro-batch size in {s.name}")
        row[name], row[f"{name} size"], row[f"{name} how"], row[f"{name} tsp"] = best
    w = workload(s, r, steps, fraction, half, row["digen size"], lora)
    _, _, _, terms, *_ = split_costs(w, hw, half, half, tsp=True)
    row["weight sync"] = terms.get("weight sync", 0.0)
    # the planner at every micro-batch size, as the layouts above were: its best first choice
    firsts = []
    for size in SIZES:
        sized = workload(s, r, steps, fraction, half, size, lora)
        ranked, _ = plan(sized, None if hetero else devices, hw, steps=4, staleness_ratio=0.5)
        if ranked:
            firsts.append((ranked[0].step_time, size, ranked[0].label))
    t, size, label = min(firsts)
    row["planner"] = f"{label}, {size} a micro-batch ({t:.1f} s)"
    row["planner s"] = t
    return row


def _mean(res) -> float:
    return statistics.mean(res.step_times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, required=True, help="gpu_check.py's profile.json")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument(
        "--lora-rank", type=int, default=0, help="train a LoRA of this rank (default 0: full)"
    )
    args = ap.parse_args()
    if not args.profile.is_file():
        sys.exit(f"error: profile file '{args.profile}' does not exist.")
    r = load_ratios(args.profile)
    print(
        f"Ratios from {r['where']}: an update of one trained timestep = "
        f"{r['update_per_pass']:.2f} denoiser passes, TSP 4 x{r['tsp4']:.2f}; generation "
        f"from FLOPs at {MFU:.0%} MFU; "
        + (f"LoRA rank {args.lora_rank}.\n" if args.lora_rank else "full fine-tuning.\n")
    )
    rows = []
    for s in SETTINGS:
        print(f"**{s.name}** (paper: {s.paper})\n")
        print(
            "| GPUs | steps | fraction | colocated (s) | + TSP (s) | rollout engine (s) "
            "| naive (s) | digen (s) | + TCSS (s) | + TCSS, no SP (s) | + TCSS, samples dealt (s) "
            "| digen vs colocated | + TCSS vs colocated | + TCSS vs colocated + TSP "
            "| + TCSS, no SP, vs colocated + TSP | digen vs rollout engine | planner's first |"
        )
        print("| ---: " * 15 + "| --- |")
        for d in s.devices:
            for steps in STEPS:
                for f in FRACTIONS:
                    t = project(s, r, d, steps, f, args.lora_rank)
                    row = {"setting": s.name, "devices": d, "steps": steps, "fraction": f, **t}
                    rows.append(row)
                    print(
                        f"| {d} | {steps} | {f} | {t['colocated']:.1f} | {t['colocated+tsp']:.1f} "
                        f"| {t['rollout engine']:.1f} | {t['naive']:.1f} | {t['digen']:.1f} "
                        f"| {t['digen+tcss']:.1f} | {t['digen+tcss no sp']:.1f} "
                        f"| {t['digen+tcss by samples']:.1f} "
                        f"| {t['colocated'] / t['digen']:.2f}x "
                        f"| {t['colocated'] / t['digen+tcss']:.2f}x "
                        f"| {t['colocated+tsp'] / t['digen+tcss']:.2f}x "
                        f"| {t['colocated+tsp'] / t['digen+tcss no sp']:.2f}x "
                        f"| {t['rollout engine'] / t['digen']:.2f}x | {t['planner']} |"
                    )
        mine = [r_ for r_ in rows if r_["setting"] == s.name]
        how = sorted({r_["colocated how"] for r_ in mine})
        eng = sorted({r_["rollout engine how"] for r_ in mine})
        sizes = sorted({r_["digen size"] for r_ in mine})
        sync = max(r_["weight sync"] for r_ in mine)
        degrees = {
            k: sorted({r_[f"{k} tsp"] for r_ in mine}) for k in ("colocated+tsp", "digen+tcss")
        }
        print(
            f"\ncolocated: {', '.join(how)}; the engine: {', '.join(eng)}; digen's "
            f"micro-batches: {sizes} samples; weight sync up to {sync:.2f} s a step; TSP "
            f"degrees: colocated {degrees['colocated+tsp']}, digen {degrees['digen+tcss']}\n"
        )
    if args.json:
        args.json.write_text(json.dumps({"where": r["where"], "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
