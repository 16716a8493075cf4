"""The driver process holds no model: its modules never import diffusers or peft (the types it
exchanges with workers live in the torch-light ``digen.runtime.messages``)."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from digen.runtime.driver import accounting, cluster, loop  # noqa: F401
from digen.runtime import messages, metrics, notes, placement  # noqa: F401
print(sorted(m for m in ("diffusers", "peft") if m in sys.modules))
"""


def test_driver_modules_import_neither_diffusers_nor_peft() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
