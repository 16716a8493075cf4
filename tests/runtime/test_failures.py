"""A worker that dies or hangs stops the run in bounded time with one line naming it, the
last checkpoint kept and the command to resume; no process outlives the run.

The run directory's ``workers.json`` (role -> host, pid) is how an operator -- here the
test -- finds exactly one worker; its process name is its role.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

_ARGS = ["--model", "sd3", "--mode", "disaggregated", "--steps", "40", "--quiet"]
_ARGS += ["rollout.num_inference_steps=4", "save_every=1", "runtime.tag=none"]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _start(out: Path, *extra: str) -> tuple[subprocess.Popen, dict]:
    cmd = [sys.executable, "-m", "cli.main", "run", "--out", str(out), *_ARGS, *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    first = out / "checkpoints" / "step-000001"
    while not ((out / "workers.json").is_file() and first.is_dir()):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach its first checkpoint"
        time.sleep(0.1)
    return proc, json.loads((out / "workers.json").read_text())


@pytest.mark.parametrize(
    ("victim", "sig", "extra", "cause"),
    [
        ("trainer-0", signal.SIGKILL, (), "was killed by signal SIGKILL"),
        # a hung worker (stopped, not dead) is found by the heartbeat
        ("generator-0", signal.SIGSTOP, ("runtime.heartbeat_s=4",), "stopped answering"),
    ],
)
def test_a_lost_worker_stops_the_run_naming_it_with_the_resume_command(
    tmp_path: Path, victim: str, sig: signal.Signals, extra: tuple, cause: str
) -> None:
    out = tmp_path / "run"
    proc, workers = _start(out, *extra)
    assert set(workers) == {"driver", "generator-0", "trainer-0"}
    assert workers["driver"]["pid"] == proc.pid
    for role, where in workers.items():
        if role != "driver":  # `ps -e` and `pgrep` show the role
            assert Path(f"/proc/{where['pid']}/comm").read_text().strip() == role
    t0 = time.monotonic()
    os.kill(workers[victim]["pid"], sig)
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - t0
    assert proc.returncode == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err[-3000:]
    pid = workers[victim]["pid"]
    assert f"worker '{victim}' (pid {pid}) {cause}" in lines[0]
    assert f"continue with: digen run --resume {out}" in lines[0]
    if sig == signal.SIGSTOP:
        assert "no heartbeat for 4 s" in lines[0]
        assert took < 4 + 30  # the heartbeat bound, plus stopping the others
    kept = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))
    assert kept and f"The last checkpoint is {kept[-1]}" in lines[0]
    assert not (out / "workers.json").exists()  # it lists live runs only
    deadline = time.monotonic() + 10
    while any(_alive(w["pid"]) for w in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r for r, w in workers.items() if _alive(w["pid"])]  # no orphan
    log = (out / "trainer.log").read_text()
    assert '"event": "run_failed"' in log and victim in log
