"""The suite's one-process groups hold: the tests of a module marked ``xdist_group`` run in one
process of ``pytest -n``, so the module's expensive reference run is made once.

pytest-xdist groups them by renaming their test ids; pytest 9.2 no longer reads the renamed
id, so there every grouped test went its own way and each process that met one made the
module's run again (the test extra pins pytest below 9.2 for this)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

GROUPED = """\
import os

import pytest

pytestmark = pytest.mark.xdist_group("one")


@pytest.mark.parametrize("i", range(8))
def test_where(i):
    with open(os.environ["WHERE"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_a_marked_module_runs_in_one_process_of_pytest_n(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not the project's options
    where = tmp_path / "where.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["WHERE"] = str(where)
    args = ["-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider"]
    args += ["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)]
    done = subprocess.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran_in = where.read_text().split()
    assert len(ran_in) == 8 and len(set(ran_in)) == 1, ran_in  # all 8, in one process
