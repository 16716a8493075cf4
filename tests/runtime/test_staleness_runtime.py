"""Bounded staleness (TCSS) on the real runtime: its invariants hold in the trace of a real
multi-process run, and the stale run still learns like the on-policy one."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest

from digen import DigenRunner, load_config
from digen.presets import preset
from digen.sched.state import stale_cap


def _run(out: Path, extra: list[str]):
    over = ["runtime.generators=2", *extra]
    cfg = load_config(base=preset("flux", "flowgrpo", mode="disaggregated"), overrides=over)
    result = asyncio.run(DigenRunner(cfg, out_dir=out, progress=False, save_weights=False).run())
    events = [json.loads(line) for line in (out / "trace.jsonl").read_text().splitlines()]
    return result, events


@pytest.mark.slow
def test_tcss_invariants_and_learning(tmp_path: Path) -> None:
    sync, _ = _run(tmp_path / "sync", [])
    stale, events = _run(
        tmp_path / "tcss", ["runtime.max_staleness=1", "runtime.staleness_ratio=0.5"]
    )
    steps, n_mb = 30, 4  # 2 prompts x 8 samples in micro-batches of 4 (2 generators)

    made = [e for e in events if e["kind"] in ("generate", "tag")]
    updates = [e for e in events if e["kind"] == "update"]
    # every micro-batch of every step was generated exactly once and trained exactly once
    assert Counter((e["step"], e["mb"]) for e in made) == {
        (s, m): 1 for s in range(steps) for m in range(n_mb)
    }
    assert Counter((e["step"], e["mb"]) for e in updates) == {
        (s, m): 1 for s in range(steps) for m in range(n_mb)
    }
    # a trajectory is made by one version, at most W = 1 behind its step
    lags = Counter(e["step"] - e["version"] for e in made)
    assert set(lags) <= {0, 1} and lags[1] > 0  # staleness was used, and bounded
    # per step, at most floor(0.5 * 4) = 2 micro-batches come from the previous version
    per_step = Counter(e["step"] for e in made if e["version"] < e["step"])
    assert max(per_step.values()) <= stale_cap(n_mb, 0.5) == 2
    assert sum(per_step.values()) == sum(m["stale_microbatches"] for m in stale.metrics)
    # updates of step s run on version s: the optimizer steps once per train step
    assert all(e["version"] == e["step"] for e in updates)

    # both runs learn (JPEG incompressibility, seeded). On-policy is deterministic:
    # 3.673 -> 3.767 kB (mean of the first 6 steps -> the last 6). Which micro-batches go out
    # stale depends on timing, so the TCSS curve varies from run to run: 3.670 -> 3.739 and
    # 3.672 -> 3.695 kB were measured; the check asks only that it rises.
    r = [m["reward_mean"] for m in sync.metrics]
    assert sum(r[-6:]) / 6 - sum(r[:6]) / 6 > 0.05, r
    r = [m["reward_mean"] for m in stale.metrics]
    assert sum(r[-10:]) / 10 > sum(r[:6]) / 6, r
    assert all(m["stale_microbatches"] == 0 for m in sync.metrics)
