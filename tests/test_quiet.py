"""Keeping the libraries' loading bars off: a process that never imports them does not
import them for this, and one that does gets them off all the same."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
from digen.quiet import no_progress_bars
{before}
no_progress_bars()
no_progress_bars()  # twice: one hook per library
print("diffusers" in sys.modules, "transformers" in sys.modules)
import diffusers.utils.logging as d
import transformers.utils.logging as t
print(d.is_progress_bar_enabled(), t.is_progress_bar_enabled())
print(sum(type(f).__name__ == "_BarsOff" for f in sys.meta_path))
"""


def _lines(before: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CODE.format(before=before)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("\n")[:3]


def test_bars_go_off_as_the_libraries_are_imported_later() -> None:
    assert _lines("") == ["False False", "False False", "0"]


def test_bars_go_off_at_once_for_libraries_already_imported() -> None:
    assert _lines("import diffusers, transformers") == ["True True", "False False", "0"]
