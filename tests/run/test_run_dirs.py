"""Where a run's outputs go: a dated folder per run under ``runs/`` with ``runs/latest`` a link
to the newest, so the README's command runs again and again; a folder left by a run that
failed to start is no obstacle to the next; ``--resume`` is advised only where a checkpoint
is; ``--overwrite`` replaces every output (evaluations included); progress in a log is one
plain line per step; a run stopped before its first step still has its trace and timeline."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import read_jsonl, tiny_config

from cli.main import main
from digen.checkpoint import check_out_dir, new_run_dir, point_latest
from digen.errors import DigenError
from digen.run.runner import DigenRunner


def test_each_run_gets_a_dated_folder_and_latest_follows(tmp_path: Path) -> None:
    noon = time.mktime((2026, 12, 5, 12, 0, 0, 0, 0, -1))
    first = new_run_dir(tmp_path, noon)
    assert first == tmp_path / "2026-12-05_12-00-00" and not first.exists()
    assert point_latest(first) is None
    assert first.is_dir() and os.readlink(tmp_path / "latest") == first.name  # relative
    second = new_run_dir(tmp_path, noon)  # the same second: the next free name
    assert second == tmp_path / "2026-12-05_12-00-00-2"
    assert point_latest(second) is None
    assert (tmp_path / "latest").resolve() == second.resolve()
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, second.name, "latest"]
    # a runs/latest that is a folder of its own (an earlier layout) is left as it is
    other = tmp_path / "elsewhere"
    (other / "latest").mkdir(parents=True)
    note = point_latest(new_run_dir(other, noon))
    assert note is not None and "is a folder, not a link, so it keeps its run" in note
    assert (other / "latest").is_dir() and not (other / "latest").is_symlink()


def test_a_folder_a_failed_start_left_is_replaced_and_resume_is_advised_only_with_a_checkpoint(
    tmp_path: Path,
) -> None:
    cfg = tiny_config("sd3", "flowgrpo")
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.yaml").write_text("steps: 30\n")
    (out / "trainer.log").write_text('{"event": "run_start"}\n')
    (out / "trace.jsonl").write_text("")
    said: list[str] = []
    assert check_out_dir(out, cfg, resume=False, overwrite=False, warn=said.append) is None
    assert said == [f"replacing what a run that trained no step left in '{out}'"]
    # a run that trained steps but kept no checkpoint: only --overwrite replaces it
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(DigenError) as refused:
        check_out_dir(out, cfg, resume=False, overwrite=False)
    assert "with no checkpoint to resume from; replace it with --overwrite" in str(refused.value)
    assert "--resume" not in str(refused.value)


@pytest.mark.slow
def test_the_readme_command_runs_twice_and_overwrite_replaces_the_evaluations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval.txt").write_text("a red cube\na blue sphere\n")
    args = ["run", "--flavour", "tiny", "--steps", "1", "eval.every=1", "eval.samples=1"]
    args += ["eval.prompts=eval.txt", "data.train_batch_size=1", "train.mini_batch_size=null"]
    first = CliRunner().invoke(main, args, catch_exceptions=False)
    second = CliRunner().invoke(main, args, catch_exceptions=False)
    assert (first.exit_code, second.exit_code) == (0, 0), first.output + second.output
    runs = sorted(p for p in (tmp_path / "runs").iterdir() if not p.is_symlink())
    assert len(runs) == 2 and (tmp_path / "runs" / "latest").resolve() == runs[1].resolve()
    for run in runs:  # the start and the end evaluated, once each
        assert [r["eval/policy_version"] for r in read_jsonl(run / "eval.jsonl")] == [0, 1]
    # progress on a stream that is no terminal: a plain line per step, no carriage return
    assert "train 1/1 reward=" in second.output and "\r" not in second.output
    again = CliRunner().invoke(main, [*args, "--out", str(runs[0]), "--overwrite"])
    assert again.exit_code == 0, again.output
    assert [r["eval/policy_version"] for r in read_jsonl(runs[0] / "eval.jsonl")] == [0, 1]


def test_a_run_stopped_before_its_first_step_writes_its_trace_and_timeline(
    tmp_path: Path,
) -> None:
    cfg = tiny_config("sd3", "flowgrpo", ["steps=2"])
    runner = DigenRunner(cfg, out_dir=tmp_path, progress=False)
    runner.request_stop()  # before the workers are up
    result = asyncio.run(runner.run())
    assert (result.metrics, result.interrupted) == ([], True)
    assert (tmp_path / "trace.jsonl").read_text() == ""  # no task ran
    assert (tmp_path / "trace.json").stat().st_size > 0
    assert (tmp_path / "timeline.png").stat().st_size > 0
