"""Cost of one bubble-triggered-search decision, and the schedules it buys.

    python benchmarks/bts_search.py [--repeats 9] [--write docs/BENCHMARKS.md]

Pure Python on one core, G = T = 4, generation 1 s per micro-batch, scoring 0.05 s, step and
sync 0.1 s each; "ratio" is update time / generation time.

1. Decision time: one :func:`digen.sched.search` at the step's first bubble (median and min
   over repeats), and the median over every bubble of a simulated step in which BTS re-plans
   at each bubble from scratch (memo not reused, as in a real run where the costs change);
   at the default budget.
2. Schedules: step time under NoTAG, StaticTAG(T), the best StaticTAG(k) for k in 0..B,
   and BTS, against the ideal bound ``max(total work / workers, critical path)``; then
   four steps with and without TCSS (W = 1, ratio 0.25).

With ``--write`` the markdown section "## BTS search" of that file is replaced (or added at
the end); other sections are left alone.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import re
import statistics
import time
from pathlib import Path

from digen.sched import BTS, Costs, NoTAG, SchedState, StaticTAG, TagPolicy, ideal_bound, simulate
from digen.sched import search as bts_search

G = T = 4


def costs(ratio: float, tag: float = 1.0) -> Costs:
    return Costs(gen=1.0, gen_tag=tag, score=0.05, update=ratio, step=0.1, sync=0.1)


class _First(TagPolicy):
    """Grabs the state at the first bubble, then never inserts."""

    name = "first"

    def reset(self) -> None:
        self.state: SchedState | None = None

    def decide(self, state: SchedState, c: Costs) -> bool:
        if self.state is None:
            self.state = state
        return False


def first_bubble(c: Costs, b: int) -> SchedState:
    pol = _First()
    simulate(c, b, G, T, pol)
    assert pol.state is not None
    return pol.state


def decision_times(repeats: int) -> list[str]:
    rows = [
        "| B | ratio | first bubble: median (min) ms | nodes | exact | all bubbles: median ms "
        "(bubbles) | BTS step, memo dropped (s) | NoTAG step (s) | ideal (s) |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for b in (32, 64, 128):
        for ratio in (0.1, 0.25, 0.5, 1.0):
            c = costs(ratio)
            st = first_bubble(c, b)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                res = bts_search(st, c)
                ts.append((time.perf_counter() - t0) * 1e3)
            per_bubble = []
            for _ in range(max(1, repeats // 3)):
                pol = BTS(reuse=False)
                run = simulate(c, b, G, T, pol)
                per_bubble.append(statistics.median(pol.stats.ms))
            rows.append(
                f"| {b} | {ratio} | {statistics.median(ts):.1f} ({min(ts):.1f}) | {res.nodes} "
                f"| {'yes' if res.exact else 'no'} | {statistics.median(per_bubble):.1f} "
                f"({pol.stats.decisions}) | {run.makespan:.2f} "
                f"| {simulate(c, b, G, T, NoTAG()).makespan:.2f} | {ideal_bound(c, b, G, T):.2f} |"
            )
            print(rows[-1], flush=True)
    return rows


def schedules() -> tuple[list[str], str]:
    rows = [
        "| B | ratio | gen_tag / gen | NoTAG | StaticTAG(4) | best StaticTAG(k) | BTS "
        "| ideal | BTS / ideal |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    wins = ties = 0
    gaps = []
    for b in (32, 64):
        for tag in (1.0, 1.5):
            for ratio in (0.1, 0.25, 0.5, 1.0):
                c = costs(ratio, tag)
                none = simulate(c, b, G, T, NoTAG()).makespan
                static = simulate(c, b, G, T, StaticTAG(T)).makespan
                best_k, best = min(
                    ((k, simulate(c, b, G, T, StaticTAG(k)).makespan) for k in range(b + 1)),
                    key=lambda kv: (kv[1], kv[0]),
                )
                bts = simulate(c, b, G, T, BTS()).makespan
                ideal = ideal_bound(c, b, G, T)
                wins += bts < best - 1e-9
                ties += abs(bts - best) <= 1e-9
                gaps.append(bts / ideal)
                rows.append(
                    f"| {b} | {ratio} | {tag} | {none:.2f} | {static:.2f} | {best:.2f} (k={best_k}) "
                    f"| {bts:.2f} | {ideal:.2f} | {bts / ideal:.3f} |"
                )
                print(rows[-1], flush=True)
    n = len(gaps)
    summary = (
        f"BTS beats the best StaticTAG(k) (k = 0..B, chosen with hindsight) on {wins} of {n} "
        f"rows, ties it on {ties} and loses on {n - wins - ties}; it is within "
        f"{(min(gaps) - 1) * 100:.0f}-{(max(gaps) - 1) * 100:.0f} % of the ideal bound. The "
        "bound counts every generation at the cheaper of the two pools and ignores the "
        "pipeline's fill and drain, so it is loosest when TAG is slower than generation."
    )
    return rows, summary


def tcss_rows() -> list[str]:
    rows = [
        "| B | ratio | NoTAG | NoTAG + TCSS | BTS | BTS + TCSS | stale / step (BTS + TCSS) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    b, steps = 32, 4
    for ratio in (0.1, 0.25, 0.5, 1.0):
        c = costs(ratio)
        cells = []
        stale = 0.0
        for pol in (NoTAG, BTS):
            for w, r in ((0, 0.0), (1, 0.25)):
                res = simulate(c, b, G, T, pol(), steps=steps, max_staleness=w, staleness_ratio=r)
                cells.append(f"{res.mean_step_time:.2f}")
                stale = sum(res.stale.values()) / steps  # ends on BTS + TCSS
        rows.append(f"| {b} | {ratio} | {' | '.join(cells)} | {stale:.1f} |")
        print(rows[-1], flush=True)
    return rows


def section(repeats: int) -> str:
    sched_rows, sched_summary = schedules()
    today = datetime.date.today().isoformat()
    py = platform.python_version()
    parts = [
        "## BTS search",
        "",
        f"`python benchmarks/bts_search.py --repeats {repeats}` ({today}; Python {py}, one "
        "thread on the 2-core shared CPU described above — other jobs were running, so "
        "medians can be up to ~2x the uncontended time; the min is closer to it). "
        "G = T = 4; generation 1 s per micro-batch on either pool, scoring 0.05 s, step and "
        "sync 0.1 s; *ratio* = update time / generation time. BTS uses its default budget of "
        f"{BTS().node_limit} search nodes per decision.",
        "",
        "### Time of one decision",
        "",
        *decision_times(repeats),
        "",
        "*First bubble*: one search from the step's first bubble (the largest problem). *All "
        "bubbles*: the median over a simulated step in which BTS re-plans at every bubble, "
        "its memo dropped each time as in a real run (the previous plan still guides the "
        "first dive). *Exact* says whether the search finished within its budget; past it, "
        "the answer is the best schedule found (never worse than NoTAG or the previous plan).",
        "",
        "### Step time (s) by policy",
        "",
        *sched_rows,
        "",
        sched_summary,
        "",
        "### Four steps with TCSS (mean step time, s)",
        "",
        *tcss_rows(),
        "",
    ]
    return "\n".join(parts)


def write_section(path: Path, text: str) -> None:
    """Replace the '## BTS search' section of ``path`` (up to the next '## '), or append it."""
    old = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    pat = re.compile(r"^## BTS search\n.*?(?=^## |\Z)", re.S | re.M)
    if pat.search(old):
        new = pat.sub(lambda _: text + "\n", old, count=1)
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    path.write_text(new.rstrip("\n") + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=9, help="timed searches per configuration")
    ap.add_argument("--write", type=Path, help="markdown file whose BTS section to replace")
    args = ap.parse_args()
    text = section(args.repeats)
    print()
    print(text)
    if args.write:
        write_section(args.write, text)


if __name__ == "__main__":
    main()
