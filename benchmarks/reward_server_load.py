"""Load on the reference reward server: concurrent clients on loopback, bounded in time.

    python benchmarks/reward_server_load.py [--clients 8] [--batch 4] [--size 128]
        [--formats png raw] [--seconds 8] [--max-requests 100000]

Starts ``digen reward-server --reward jpeg_incompressibility --port 0`` as a process, then
``--clients`` :class:`~digen.rewards.http.HttpReward` clients (each its own keep-alive
session, one request in flight) send batches of ``--batch`` random ``--size`` px images
back to back, for ``--seconds`` per format or ``--max-requests`` in all, whichever is first.
Client and server share this machine's cores, so encoding competes with scoring. Prints one
JSON line per format: requests/s, samples/s, p50 / p99 request latency (ms), errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from digen.rewards.http import HttpReward

ROOT = Path(__file__).resolve().parents[1]


async def client(url: str, fmt: str, batch: int, size: int, seed: int, until: float, budget):
    """Requests back to back until ``until`` or the shared budget runs out: latencies (s)."""
    g = torch.Generator().manual_seed(seed)
    samples = torch.randint(0, 256, (batch, 1, size, size, 3), generator=g, dtype=torch.uint8)
    prompts, metadata = ["a photo"] * batch, [{}] * batch
    reward = HttpReward(url, format=fmt, concurrency=1)
    await reward.setup()
    latencies, errors = [], 0
    try:
        await reward(samples, prompts, metadata)  # warm-up: the connection is open after it
        while time.perf_counter() < until and budget[0] > 0:
            budget[0] -= 1
            t0 = time.perf_counter()
            try:
                await reward(samples, prompts, metadata)
            except Exception:
                errors += 1
                continue
            latencies.append(time.perf_counter() - t0)
    finally:
        await reward.close()
    return latencies, errors


async def measure(url: str, fmt: str, args: argparse.Namespace) -> dict[str, object]:
    budget = [args.max_requests]
    t0 = time.perf_counter()
    until = t0 + args.seconds
    async with asyncio.TaskGroup() as group:
        tasks = [
            group.create_task(client(url, fmt, args.batch, args.size, i, until, budget))
            for i in range(args.clients)
        ]
    elapsed = time.perf_counter() - t0
    latencies = sorted(x for t in tasks for x in t.result()[0])
    errors = sum(t.result()[1] for t in tasks)
    return {
        "format": fmt,
        "clients": args.clients,
        "batch": args.batch,
        "size_px": args.size,
        "requests": len(latencies),
        "errors": errors,
        "seconds": round(elapsed, 2),
        "requests_per_s": round(len(latencies) / elapsed, 1),
        "samples_per_s": round(len(latencies) * args.batch / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": round(1000 * statistics.quantiles(latencies, n=100)[98], 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--formats", nargs="+", default=["png", "raw"])
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--max-requests", type=int, default=100_000)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "cli.main", "reward-server"]
    cmd += ["--reward", "jpeg_incompressibility", "--port", "0"]
    server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        found = re.search(r"on (http://\S+/score) ", server.stdout.readline())
        if not found:
            sys.exit("the reward server did not start")
        for fmt in args.formats:
            row = asyncio.run(measure(found.group(1), fmt, args))
            print(json.dumps({**row, "cpus": os.cpu_count()}), flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
