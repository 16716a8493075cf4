"""The scheduling core never imports torch (it must run and be tested anywhere)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["torch"] = None  # any 'import torch' now fails loudly
import digen.sched
from digen.sched import costs, simulator, simulate_cli, state, tag, _engine  # noqa: F401
from digen.sched import BTS, Costs, simulate
r = simulate(Costs(gen=1, score=0.1, update=0.3), 6, 2, 2, BTS(), steps=2,
             max_staleness=1, staleness_ratio=0.5)
print(r.makespan > 0, "torch" in sys.modules and sys.modules["torch"] is not None)
"""


def test_sched_imports_and_runs_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
