"""A worker that dies or hangs stops the run in bounded time with one line naming it, the
last checkpoint kept and the command to resume; no process outlives the run, and the resume
finishes with the weights of a run that was never interrupted.

The run directory's ``workers.json`` (role -> host, pid) is how an operator -- here the
test -- finds exactly one worker; its process name is its role. A reward hook holds the run
at a known point (step 2's first scoring), so what is killed, and when, is the same on an
idle machine and a loaded one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import process_alive, read_jsonl, run_config
from safetensors.torch import load_file

# each test stops, kills or hangs whole runs of worker processes: minutes in all
# slow; one worker of `pytest -n` runs them all, so the module's reference run is made once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_failures")]

STEPS = 4
_HOLD_HOOK = '''
import os, time
from pathlib import Path
from digen.rewards.builtin import jpeg_incompressibility

class HoldAt:
    """JPEG incompressibility; its call number HOLD_AT (from 0, in this scoring process)
    writes HOLD_MARK and waits there, so a test acts on a run paused at a known point."""

    calls = 0

    def __call__(self, samples, prompts, metadata):
        if HoldAt.calls == int(os.environ.get("HOLD_AT", "-1")):
            Path(os.environ["HOLD_MARK"]).write_text(str(os.getpid()))
            time.sleep(600)
        HoldAt.calls += 1
        return jpeg_incompressibility(samples, prompts, metadata)
'''


def _args(hook: Path) -> list[str]:
    args = ["--model", "sd3", "--mode", "disaggregated", "--steps", str(STEPS), "--quiet"]
    args += ["rollout.num_inference_steps=4", "save_every=1", "runtime.schedule.tag=none"]
    return [*args, "train.lr=1e-3", f"rewards=[{{name: '{hook}:HoldAt'}}]"]


def _cli(
    *args: str, hold_at: int = -1, mark: Path | None = None, env: dict | None = None
) -> subprocess.Popen:
    env = {**(env or os.environ), "HOLD_AT": str(hold_at), "HOLD_MARK": str(mark or "")}
    cmd = [sys.executable, "-m", "cli.main", "run", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "checkpoints" / f"step-{STEPS:06d}" / "weights.safetensors"))


@pytest.fixture(scope="module")
def hook(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hook") / "hold_hook.py"
    path.write_text(_HOLD_HOOK)
    return path


@pytest.fixture(scope="module")
def uninterrupted(hook: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same run never interrupted, through the API (the command line's config)."""
    from digen import load_config

    args = _args(hook)
    overrides = [a for a in args if "=" in a]
    cfg = load_config(None, overrides, {"steps": STEPS}, model="sd3", mode="disaggregated")
    out = tmp_path_factory.mktemp("whole") / "run"
    run_config(cfg, out)
    return _weights(out)


def _per_step() -> int:
    """Micro-batches a step: scoring calls, and generations of 4 forwards each."""
    from digen import load_config
    from digen.config import schedule_plan
    from digen.presets import preset

    cfg = load_config(base=preset("sd3", "flowgrpo", mode="disaggregated"), overrides=[])
    return schedule_plan(cfg).microbatches


def _hold_at_step_2(
    hook: Path, out: Path, *extra: str, env: dict | None = None
) -> tuple[subprocess.Popen, dict]:
    """Start a run and wait until it holds in step 2's first scoring call, with the
    checkpoint of its first two steps written."""
    mark = out.parent / "held"
    hold_at = 2 * _per_step()
    proc = _cli("--out", str(out), *_args(hook), *extra, hold_at=hold_at, mark=mark, env=env)
    deadline = time.monotonic() + 300
    second = out / "checkpoints" / "step-000002"
    while not ((out / "workers.json").is_file() and mark.is_file() and second.is_dir()):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the run did not reach step 2"
        time.sleep(0.05)
    return proc, json.loads((out / "workers.json").read_text())


@pytest.mark.parametrize(
    ("victim", "sig", "extra", "cause"),
    [
        # a killed worker (the trainer; a killed generator is found the same way, by its
        # process's exit: test_elastic kills the last generator of a run, which ends so)
        ("trainer-0", signal.SIGKILL, (), "was killed by signal SIGKILL"),
        # a hung worker (stopped, not dead) is found by the heartbeat
        ("generator-0", signal.SIGSTOP, ("runtime.transport.heartbeat_s=4",), "stopped answering"),
    ],
)
def test_a_lost_worker_stops_the_run_naming_it_and_resume_finishes_it_exactly(
    tmp_path: Path, hook: Path, uninterrupted: dict, victim, sig, extra, cause
) -> None:
    out = tmp_path / "run"
    proc, workers = _hold_at_step_2(hook, out, *extra)
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
    assert "The last checkpoint is step-000002 (2 steps)" in lines[0]
    assert lines[0].endswith(f"continue with: digen run --resume {out}")
    # found within the stated bound (0.1 s for a process that exits, heartbeat_s for a hung
    # one), plus stopping the others: a generous margin for a loaded machine
    assert took < (4 if sig == signal.SIGSTOP else 0) + 60
    if sig == signal.SIGSTOP:
        assert "no heartbeat for 4 s" in lines[0]
    assert not (out / "workers.json").exists()  # it lists live runs only
    deadline = time.monotonic() + 10
    while any(process_alive(w["pid"]) for w in workers.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [r for r, w in workers.items() if process_alive(w["pid"])]  # no orphan
    log = (out / "trainer.log").read_text()
    assert '"event": "run_failed"' in log and victim in log
    if sig == signal.SIGSTOP:
        return  # the kill resumes below: a resume starts from the checkpoint, whoever was lost
    resumed = _cli("--resume", str(out))
    _, err = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, err[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(STEPS))  # step 2 made again, once
    got = _weights(out)
    assert got.keys() == uninterrupted.keys()
    assert all(torch.equal(got[k], uninterrupted[k]) for k in got)


def test_a_second_ctrl_c_exits_at_once_leaving_no_process(
    tmp_path: Path, hook: Path, run_mark
) -> None:
    """The first signal waits for the calls running -- here a reward that does not return --
    to reach a micro-batch boundary; a second one exits at once, whatever the driver is
    doing, with no process of the run left and the checkpoints written so far intact."""
    out, sig = tmp_path / "run", signal.SIGINT
    proc, workers = _hold_at_step_2(hook, out, env=run_mark.env)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    proc.send_signal(sig)
    deadline = time.monotonic() + 120
    while not any("again to abort" in line for line in lines):  # the first one was handled
        assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-3000:]
        time.sleep(0.05)
    time.sleep(1.0)  # the driver now waits for the held reward (two signals pending at
    assert proc.poll() is None  # once would count as one)
    t0 = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=120)
    took = time.monotonic() - t0
    reader.join(timeout=60)
    err = "".join(lines)
    assert proc.returncode == 130, err[-3000:]
    assert "again to abort" in err and "SIGINT again: aborting now." in err
    assert took < 60  # not the reward's ten minutes
    deadline = time.monotonic() + 60  # SIGKILLed workers die as soon as they are scheduled
    while run_mark.left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert run_mark.left() == []  # workers and fork server: no orphan
    assert not [r for r, w in workers.items() if process_alive(w["pid"])]
    from digen.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(out)  # checksums verified
    assert ckpt is not None and ckpt.step == 2


_FAULT_HOOK = """
import os
import diffusers
from digen.rewards.builtin import jpeg_incompressibility

calls = {"reward": 0, "forward": 0}

def _count(what):
    calls[what] += 1
    if what == os.environ["FAIL_IN"] and calls[what] == int(os.environ["FAIL_AT"]) + 1:
        raise RuntimeError(f"injected failure in the {what}")

# the generator's transformer, in this (the generator's) process
_forward = diffusers.SD3Transformer2DModel.forward

def _failing_forward(self, *args, **kwargs):
    _count("forward")
    return _forward(self, *args, **kwargs)

diffusers.SD3Transformer2DModel.forward = _failing_forward

def reward(samples, prompts, metadata):
    _count("reward")
    return jpeg_incompressibility(samples, prompts, metadata)
"""


@pytest.mark.parametrize(
    ("where", "code", "summary"),
    [
        (
            "reward",
            2,
            "reward hook '{hook}:reward' raised RuntimeError: injected failure in the reward.",
        ),
        ("forward", 1, "RuntimeError: injected failure in the forward; the traceback is in {log}."),
    ],
)
def test_an_exception_on_a_worker_is_one_line_with_its_traceback_in_the_log(
    tmp_path: Path, where: str, code: int, summary: str
) -> None:
    """A reward hook or the model's forward raising in the generator process mid-run: one
    line on the terminal (what raised, where the traceback is, the last checkpoint and the
    command to resume), and the worker's own traceback in trainer.log."""
    hook, out = tmp_path / "fault_hook.py", tmp_path / "run"
    hook.write_text(_FAULT_HOOK)
    args = ["--model", "sd3", "--mode", "disaggregated", "--steps", "3", "--quiet"]
    args += ["rollout.num_inference_steps=4", "save_every=1", "runtime.schedule.tag=none"]
    args += [f"rewards=[{{name: '{hook}:reward'}}]", "--out", str(out)]
    at = 2 * _per_step() * (1 if where == "reward" else 4)  # step 2's first scoring or forward
    env = {**os.environ, "FAIL_IN": where, "FAIL_AT": str(at)}
    proc = subprocess.run(
        [sys.executable, "-m", "cli.main", "run", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    log = out / "trainer.log"
    assert summary.format(hook=hook, log=log) in lines[0]
    assert re.search(
        r"The last checkpoint is step-00000[12] \([12] steps\); continue with: "
        rf"digen run --resume {re.escape(str(out))}",
        lines[0],
    ), lines[0]
    failed = [json.loads(x) for x in log.read_text().splitlines() if '"run_failed"' in x]
    assert len(failed) == 1
    trace = failed[0]["traceback"]
    assert "Raised in worker 'generator-0'" in trace  # the remote traceback, to the line
    assert f'File "{hook}", line' in trace and "injected failure" in trace
