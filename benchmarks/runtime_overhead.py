"""Driver + RPC overhead of the disaggregated runtime, and LoRA weight-sync time.

    python benchmarks/runtime_overhead.py [--size 128] [--steps 6]

One generator and one trainer (one process each, one thread each) train the tiny FLUX
flavour for a few steps, once with weights synced over RPC and once by a gloo broadcast.
Reported, as medians over the steps after the first (warm-up):

- overhead fraction: (driver-side span of each generate / score / update call minus the
  actor's own compute span) / compute, summed over a step's calls — what the actor layer,
  pickling and the event loop cost relative to the work they carry;
- per-call overhead in milliseconds;
- weight-sync time: driver-side span of one sync of the LoRA weights to the generator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile

from digen import DigenRunner, load_config
from digen.presets import preset
from digen.sched.trace import Trace


def measure(size: int, steps: int, sync: str) -> dict[str, float]:
    over = [
        f"steps={steps}",
        f"model.height={size}",
        f"model.width={size}",
        f"runtime.transport.weight_sync={sync}",
        "runtime.generators=1",
        "runtime.trainers=1",
    ]
    cfg = load_config(base=preset("flux", "flowgrpo", mode="disaggregated"), overrides=over)
    with tempfile.TemporaryDirectory() as out:
        result = asyncio.run(DigenRunner(cfg, out_dir=out, progress=False).run())
        trace = Trace.load_jsonl(f"{out}/trace.jsonl")
    rows = result.metrics[1:]
    calls = [e for e in trace.events if e.kind in ("generate", "score", "update") and e.step > 0]
    syncs = [e.duration for e in trace.events if e.kind == "sync" and e.worker == "driver"][1:]
    n_calls = len(calls) / max(len(rows), 1)
    return {
        "size_px": size,
        "weight_sync": sync,
        "overhead_fraction": statistics.median(r["overhead_fraction"] for r in rows),
        "overhead_ms_per_call": statistics.median(
            1e3
            * r["overhead_fraction"]
            * (r["time/generate_s"] + r["time/score_s"] + r["time/train_s"])
            / n_calls
            for r in rows
        ),
        "compute_ms_per_call": statistics.median(e.duration for e in calls) * 1e3,
        "sync_ms": statistics.median(syncs) * 1e3,
        "step_s": statistics.median(r["step_time_s"] for r in rows),
        "lora_params": sum(v.numel() for v in result.final_state.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    for size in args.size:
        for sync in ("rpc", "broadcast"):
            print(json.dumps(measure(size, args.steps, sync)), flush=True)


if __name__ == "__main__":
    main()
