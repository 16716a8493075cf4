"""The public surface does not drift, and the light modules stay free of torch."""

from __future__ import annotations

import subprocess
import sys

import digen


def test_exports() -> None:
    assert set(digen.__all__) == {
        "ConfigError", "DigenConfig", "DigenError", "DigenRunner", "RewardError", "RunResult",
        "__version__", "load_config",
    }  # fmt: skip
    for name in digen.__all__:
        assert getattr(digen, name) is not None


def test_config_and_sched_import_without_torch() -> None:
    code = "import sys, digen.config, digen.sched; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
