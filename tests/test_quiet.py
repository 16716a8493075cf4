"""Keeping the libraries' loading bars off: a process that never imports them does not
import them for this, one that imported them already gets theirs off at once, and one that
imports them later gets them off as it does."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import transformers.utils.logging as t
from digen.quiet import no_progress_bars
no_progress_bars()
no_progress_bars()  # twice: one hook for the library still to come
print("diffusers" in sys.modules, t.is_progress_bar_enabled())
print(sum(type(f).__name__ == "_BarsOff" for f in sys.meta_path))
import diffusers.utils.logging as d
print(d.is_progress_bar_enabled(), sum(type(f).__name__ == "_BarsOff" for f in sys.meta_path))
"""


def test_bars_go_off_now_for_an_imported_library_and_as_the_others_are_imported() -> None:
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["False False", "1", "False 0"]
