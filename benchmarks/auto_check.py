"""Does ``--mode auto`` choose well here? Probe and plan as ``digen run --mode auto`` does,
then run the planner's first three layouts, interleaved, and compare measured step times.

    python benchmarks/auto_check.py --size 256 --steps 10 --repeats 2 [--json auto.json]

The runs are ``digen bench``'s (tiny FLUX, Flow-GRPO, 2 prompts x 8 samples, one optimizer
step a train step, one thread a worker process); step time is the trace's step end to step
end over the steps after the first, pooled over the repetitions (median, [min-max]).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from digen.config import load_config, schedule_plan
from digen.planning.layouts import Candidate
from digen.presets import preset
from digen.run.auto import apply_layout, choose_layout, probe_config
from digen.run.bench import COLOCATED, Rung, measure_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    over = [
        f"steps={args.steps}",
        "save_every=0",
        f"model.height={args.size}",
        f"model.width={args.size}",
        "train.mini_batch_size=null",
        "runtime.placement.threads_per_worker=1",
    ]
    cfg = load_config(base=preset("flux", "flowgrpo"), overrides=over)
    choice = asyncio.run(choose_layout(cfg, devices=args.devices))
    print(f"mode auto: {choice.line}")
    per_mb = schedule_plan(probe_config(cfg)).layout.samples_per_microbatch
    top: list[tuple[Candidate, object]] = []
    for d in choice.record["candidates"]:
        c = Candidate(**{k: v for k, v in d.items() if k not in ("label", "cost_per_1k")})
        try:
            top.append((c, apply_layout(cfg, c, per_mb)))
        except Exception:  # the config refuses it: not a layout auto would run
            continue
        if len(top) == args.top:
            break
    times: dict[str, list[float]] = {c.label: [] for c, _ in top}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for i, (c, layout) in enumerate(top):
                rung = Rung(
                    f"auto-{i}",
                    c.label,
                    layout.runtime.mode,
                    (),
                    threads=1 if c.layout == COLOCATED else None,
                )
                m = measure_run(rung, layout, Path(tmp) / f"{i}-{rep}", rep)
                times[c.label] += m.step_times_s
                print(f"{c.label}, run {rep + 1}: {statistics.median(m.step_times_s):.3f} s a step")
    rows = []
    print(
        "\n| planner's rank | layout | predicted s | measured s median [min-max] | measured rank |"
    )
    print("| ---: | --- | ---: | ---: | ---: |")
    order = sorted(times, key=lambda k: statistics.median(times[k]))
    for i, (c, _) in enumerate(top, 1):
        t = times[c.label]
        rows.append({"label": c.label, "predicted": c.step_time, "measured": t})
        print(
            f"| {i} | {c.label} | {c.step_time:.3f} | {statistics.median(t):.3f} "
            f"[{min(t):.3f}-{max(t):.3f}] | {order.index(c.label) + 1} |"
        )
    if args.json:
        args.json.write_text(json.dumps({"line": choice.line, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
