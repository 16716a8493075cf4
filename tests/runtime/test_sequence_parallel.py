"""Sequence parallelism (Ulysses) and CFG parallelism against one device, for every backbone.

Real processes on gloo (2 and 4), the real tiny architectures loaded through
``from_pretrained``: each member computes a guided velocity and the gradient of every
transformer weight with the model split over the group, and the result is measured, as one
device's fp32 result is, against the same computation in fp64 (``sequence_ranks.py``).

The bound: the split pass does one device's arithmetic in other orders (attention's keys
summed in the group's order, products over fewer rows, a weight's gradient summed over the
members), so its rounding is of the same kind and count as one device's. Its distance from
the fp64 result can differ from one device's by chance, not in scale: allowed 4x (16x the
variance), plus one fp32 rounding of the result's size. A mistake (a token's rotary position
or mask lost, a piece gathered out of place, a gradient counted twice) errs by a sizeable
part of the result: 1e5 times the rounding here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import free_port

from digen.registry.models import MODEL_NAMES

ROUNDING = 4.0
U32 = torch.finfo(torch.float32).eps / 2


def run_ranks(world: int, cfg: int, out: Path) -> dict:
    script = Path(__file__).with_name("sequence_ranks.py")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(port), str(out), str(cfg)]
            + list(MODEL_NAMES),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "cfg"),
    [(2, 1), (4, 1), (2, 2), (4, 2)],
    ids=["sp2", "sp4", "cfg2", "cfg2xsp2"],
)
def test_split_pass_equals_one_device(tmp_path: Path, world: int, cfg: int) -> None:
    """Velocity and gradients of every backbone split over ``world`` gloo processes (``cfg``
    guidance branches, each sequence-parallel over ``world / cfg``) equal one device's within
    the rounding bound; every member ends with the same velocity; each member held its share
    of every spanning attention's tokens and saved less for the backward pass than one
    device does."""
    report = run_ranks(world, cfg, tmp_path / "report.json")
    assert sorted(report) == sorted(MODEL_NAMES)
    sequence = world // cfg
    for model, got in report.items():
        for part in ("velocity", "grads"):
            one, split, size = (got[part][k] for k in ("one", "split", "size"))
            bound = ROUNDING * one + U32 * size
            assert split <= bound, f"{model} {part}: {split:.3g} from fp64, one device {one:.3g}"
        assert got["spread"] == 0.0, model
        if sequence > 1:
            assert got["spanned"] > 0, model
            assert 1 / sequence <= got["share"] < 2 / sequence, model
        else:
            assert got["spanned"] == 0, model
        assert got["saved"]["split"] < got["saved"]["one"], model
