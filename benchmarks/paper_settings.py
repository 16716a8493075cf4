"""The paper's settings, projected: colocated vs naive disaggregation vs digen on 16 and 32
devices, from measured cost curves.

    python benchmarks/gpu_check.py --out gpu-check/            # on one GPU: its cost curves
    python benchmarks/paper_settings.py --profile gpu-check/profile.json

    # without a GPU: this machine's curves, labelled as such in the output
    python benchmarks/gpu_check.py --device cpu --curves-only --flavour tiny --out cpu-check/
    python benchmarks/paper_settings.py --profile cpu-check/profile.json

The settings are those of the paper's end-to-end comparison: a train batch of 32 samples
(4 prompts x 8), sampling steps 20 / 30 / 40, timestep fractions 0.4 / 0.6 (the share of
the denoising steps that is trained), the devices split evenly between generators and
trainers, one sample per micro-batch. Per setting it simulates, with the runtime's own
scheduler model (:func:`digen.sched.simulate`):

- **colocated**: every device generates and scores its 32 / D samples, then trains them,
  then one optimizer step (data-parallel, no pipelining, no TSP: what veRL-Omni and
  flow_grpo do); and **colocated + TSP**, the same with digen's TSP, a fairer baseline;
- **naive**: D / 2 generators and D / 2 trainers; training starts once the whole batch is
  scored; no TSP, no TAG;
- **digen**: GAP groups, TSP at the best degree the curves measured, BTS, scoring beside
  generation; and **digen + TCSS** (one version of staleness, up to half a step early).

Costs per micro-batch come from the profile's curves at micro-batch 1: generation scales
with the sampling steps (``gen x S / S0``), training with the trained timesteps
(``update x fraction x S / W0``), where ``S0`` and ``W0`` are the profile's own sampling
steps and trained timesteps; scoring, the optimizer step and the weight sync are taken as
measured. Step times are the mean of steps 2-4 of a 4-step simulation (the first fills the
pipeline). The output is a markdown table; ``--json FILE`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from digen.sched import BTS, Costs, NoTAG, simulate

PAPER = {
    "HunyuanVideo (paper, vs colocated)": "1.04-1.37x, 1.13-1.49x with TCSS",
    "Wan2.1 (paper, vs colocated)": "1.13-1.45x",
    "ablation (paper, vs naive)": "up to 3.34x",
}
BATCH, GROUP = 32, 8
"""Samples a train step, samples a prompt (the paper's batch of 32)."""
STEPS = (20, 30, 40)
FRACTIONS = (0.4, 0.6)
DEVICES = (16, 32)


def load_curves(path: Path) -> dict[str, Any]:
    """The per-sample costs of a ``gpu_check.py`` profile, and where they were measured."""
    prof = json.loads(path.read_text())
    curves, point = prof.get("curves"), prof.get("operating_point")
    if not curves or not point:
        raise SystemExit(
            f"error: {path} has no cost curves: write it with benchmarks/gpu_check.py."
        )
    gen = [p for p in curves["generate"] if p["microbatch"] == 1 and "seconds" in p]
    train = [p for p in curves["train"] if p["microbatch"] == 1 and "seconds" in p]
    if not gen or not train:
        raise SystemExit(f"error: {path} has no micro-batch 1 points to project from.")
    by_tsp = {p["tsp_degree"]: p["seconds"] for p in train}
    best = min(by_tsp, key=by_tsp.get)
    costs = prof.get("costs") or {}
    return {
        "gen": gen[0]["seconds"],
        "update_tsp1": by_tsp[min(by_tsp)],
        "update_best": by_tsp[best],
        "tsp_best": best,
        "score": curves.get("score_s", 0.0) / point["microbatch"],
        "step": curves.get("optimizer_step_s", 0.0),
        "sync": costs.get("sync", 0.0),
        "S0": point["inference_steps"],
        "W0": point["trained_timesteps"],
        "where": _where(path, point),
    }


def _where(path: Path, point: dict[str, Any]) -> str:
    report = path.with_name("report.json")
    device = "unknown device"
    if report.is_file():
        rep = json.loads(report.read_text())
        env, plan = rep.get("environment", {}), rep.get("plan", {})
        kind = "GPU" if env.get("cuda_available") else "CPU, scaled: not a GPU's cost ratios"
        device = f"{env.get('device_name', device)} ({kind}), {plan.get('flavour', '?')} {plan.get('model', '')}"
    return (
        f"{device}, {point.get('height')}x{point.get('width')} px, {point.get('model.dtype')}, "
        f"{point['inference_steps']} sampling steps, {point['trained_timesteps']} trained"
    )


def costs_for(c: dict[str, Any], steps: int, fraction: float, tsp: bool) -> Costs:
    """Per-micro-batch (one sample) costs at ``steps`` sampling steps, ``fraction`` trained."""
    g = steps / c["S0"]
    trained = fraction * steps / c["W0"]
    return Costs(
        gen=c["gen"] * g,
        gen_tag=c["gen"] * g,  # the paper's testbeds are homogeneous: a trainer generates as fast
        score=c["score"],
        update=(c["update_best"] if tsp else c["update_tsp1"]) * trained,
        step=c["step"],
        sync=c["sync"],
    )


def _mean_step(res) -> float:
    return statistics.mean(res.step_times[1:])


def project(c: dict[str, Any], devices: int, steps: int, fraction: float) -> dict[str, float]:
    """Step times (s) of every mode at one setting."""
    half = devices // 2
    plain = costs_for(c, steps, fraction, tsp=False)
    per_device = BATCH // devices
    fast = costs_for(c, steps, fraction, tsp=True)
    colocated = per_device * (plain.gen + plain.score + plain.update) + plain.step
    colocated_tsp = per_device * (fast.gen + fast.score + fast.update) + fast.step
    naive = simulate(plain, BATCH, half, half, NoTAG(), steps=4, mbs_per_group=BATCH)
    kw = {"steps": 4, "mbs_per_group": GROUP, "score_overlap": True}
    digen = simulate(fast, BATCH, half, half, BTS(), **kw)
    tcss = simulate(fast, BATCH, half, half, BTS(), max_staleness=1, staleness_ratio=0.5, **kw)
    return {
        "colocated": colocated,
        "colocated+tsp": colocated_tsp,
        "naive": _mean_step(naive),
        "digen": _mean_step(digen),
        "digen+tcss": _mean_step(tcss),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, required=True, help="gpu_check.py's profile.json")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    if not args.profile.is_file():
        sys.exit(f"error: profile file '{args.profile}' does not exist.")
    c = load_curves(args.profile)
    print(f"Costs from {c['where']}; TSP degree {c['tsp_best']} for digen.\n")
    print(
        "| devices | sampling steps | fraction | colocated (s) | colocated + TSP (s) | naive (s) "
        "| digen (s) | + TCSS (s) | digen vs colocated | + TCSS vs colocated "
        "| + TCSS vs colocated + TSP | digen + TCSS vs naive |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = []
    for d in DEVICES:
        for s in STEPS:
            for f in FRACTIONS:
                t = project(c, d, s, f)
                row = {"devices": d, "sampling_steps": s, "fraction": f, **t}
                row["digen_vs_colocated"] = t["colocated"] / t["digen"]
                row["tcss_vs_colocated"] = t["colocated"] / t["digen+tcss"]
                row["tcss_vs_colocated_tsp"] = t["colocated+tsp"] / t["digen+tcss"]
                row["tcss_vs_naive"] = t["naive"] / t["digen+tcss"]
                rows.append(row)
                print(
                    f"| {d} | {s} | {f} | {t['colocated']:.3f} | {t['colocated+tsp']:.3f} "
                    f"| {t['naive']:.3f} | {t['digen']:.3f} | {t['digen+tcss']:.3f} "
                    f"| {row['digen_vs_colocated']:.2f}x | {row['tcss_vs_colocated']:.2f}x "
                    f"| {row['tcss_vs_colocated_tsp']:.2f}x | {row['tcss_vs_naive']:.2f}x |"
                )
    print()
    for name, value in PAPER.items():
        print(f"- {name}: {value}")
    if args.json:
        args.json.write_text(json.dumps({"where": c["where"], "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
