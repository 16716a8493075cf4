"""Workers forked from the fork server get what a spawned child would inherit at its start:
the environment, working directory, stdout and stderr of that moment, not the server's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from digen.runtime.transport import forkserver


def _report(path: str, key: str) -> None:
    Path(path).write_text(json.dumps({"env": os.environ.get(key), "cwd": os.getcwd()}))
    print("hello from the child", flush=True)
    os.write(2, b"and on stderr\n")


def test_a_forked_child_gets_the_environment_cwd_and_stdio_of_its_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture
) -> None:
    forkserver.start_fork_server()  # running already (the test session started it): a no-op
    monkeypatch.setenv("DIGEN_TEST_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    seen = tmp_path / "seen.json"
    proc = forkserver.process(_report, (str(seen), "DIGEN_TEST_MARK"), name="probe")
    forkserver.start(proc)
    proc.join(120)
    assert proc.exitcode == 0
    assert json.loads(seen.read_text()) == {
        "env": "set after the server started",
        "cwd": str(tmp_path),
    }
    out, err = capfd.readouterr()
    assert "hello from the child" in out and "and on stderr" in err
