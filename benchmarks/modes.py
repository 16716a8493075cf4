"""Step time of the execution modes on this machine: the ablation of the runtime.

    python benchmarks/modes.py [--steps 8] [--size 64]

Tiny FLUX, Flow-GRPO, 2 prompts x 8 samples a step, on two worker processes in every
mode (two cores here): colocated data-parallel (2 workers), and disaggregated with one
generator and one trainer — naive (generate everything, then train), pipelined (GAP
micro-batches, updates start per group), + TSP, + TAG (bubble-triggered search), + TCSS
(one version of staleness, up to half of a step's micro-batches). Reports the median step
time over the steps after the first, and the speed-up over colocated, as a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile

from digen import DigenRunner, load_config
from digen.presets import preset

MODES = {
    "colocated, 2 data-parallel workers": ("colocated", ["train.num_devices=2"]),
    "disaggregated, naive": (
        "disaggregated",
        ["runtime.pipeline=false", "runtime.tag=none", "runtime.microbatch_axis=prompt"],
    ),
    "disaggregated, pipelined (GAP)": ("disaggregated", ["runtime.tag=none"]),
    "+ TSP (2 timesteps per pass)": ("disaggregated", ["runtime.tag=none", "runtime.tsp_degree=2"]),
    "+ TAG (BTS)": ("disaggregated", ["runtime.tsp_degree=2"]),
    "+ TCSS (W=1, ratio 0.5)": (
        "disaggregated",
        ["runtime.tsp_degree=2", "runtime.max_staleness=1", "runtime.staleness_ratio=0.5"],
    ),
}


def run(mode: str, extra: list[str], steps: int, size: int) -> dict[str, float]:
    over = [f"steps={steps}", f"model.height={size}", f"model.width={size}", *extra]
    over.append("train.mini_batch_size=null")  # one optimizer step per train step everywhere
    cfg = load_config(base=preset("flux", "flowgrpo", mode=mode), overrides=over)
    with tempfile.TemporaryDirectory() as out:
        res = asyncio.run(DigenRunner(cfg, out_dir=out, progress=False, save_weights=False).run())
    rows = res.metrics[1:]
    return {
        "step_s": statistics.median(r["step_time_s"] for r in rows),
        "utilisation": statistics.median(r.get("utilisation", float("nan")) for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--size", type=int, default=64)
    args = ap.parse_args()
    results = {
        name: run(mode, extra, args.steps, args.size) for name, (mode, extra) in MODES.items()
    }
    base = results["colocated, 2 data-parallel workers"]["step_s"]
    print("| mode | step time (s) | vs colocated | utilisation |")
    print("| --- | ---: | ---: | ---: |")
    for name, r in results.items():
        print(
            f"| {name} | {r['step_s']:.3f} | {base / r['step_s']:.2f}x | {r['utilisation']:.2f} |"
        )


if __name__ == "__main__":
    main()
