"""The scheduling core never imports torch (it must run and be tested anywhere), and neither
do presets, config checks or a bad command line (errors come at once)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
sys.modules["torch"] = None  # any 'import torch' now fails loudly
import digen.sched
from digen.sched import costs, simulator, state, tag, _engine  # noqa: F401
from digen.planning import hardware, layouts, simulate as simulate_report  # noqa: F401
from digen.sched import BTS, Costs, simulate
r = simulate(Costs(gen=1, score=0.1, update=0.3), 6, 2, 2, BTS(), steps=2,
             max_staleness=1, staleness_ratio=0.5)
print(r.makespan > 0, "torch" in sys.modules and sys.modules["torch"] is not None)
"""


def test_sched_imports_and_runs_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]


CONFIG_CODE = """
import sys
sys.modules["torch"] = None
sys.modules["diffusers"] = None
from digen.config import load_config
from digen.models import MODEL_NAMES
cfg = load_config(model="wan", algo="dancegrpo", mode="disaggregated")
print(len(MODEL_NAMES), cfg.model.name, cfg.rollout.sde_type, cfg.runtime.mode)
"""


def test_presets_and_config_checks_import_neither_torch_nor_diffusers() -> None:
    out = subprocess.run([sys.executable, "-c", CONFIG_CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "wan", "dance", "disaggregated"]


def test_a_bad_run_command_fails_before_torch_loads() -> None:
    code = (
        "import sys; sys.modules['torch'] = None; sys.modules['diffusers'] = None\n"
        "sys.argv = ['digen', 'run', '--model', 'sd3', 'rollout.n=1']\n"
        "from cli.main import main; main()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == (
        "error: rollout.n = 1 is not allowed: the group size must be at least 2 "
        "(advantages are group-relative)."
    )
