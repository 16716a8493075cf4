"""What a crash leaves: the final weights and the checkpoints are replaced whole (a complete
set on disk at every point), and what a crash or a full disk left unfinished is cleared at
the next start of a run in that directory."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

from digen import checkpoint
from digen.checkpoint import (
    CheckpointWriter,
    check_out_dir,
    checkpoint_identity,
    latest_checkpoint,
    load_trainer_state,
    publish,
    staging_for,
    tidy_out_dir,
    write_trainer_state,
)
from digen.errors import DigenError

CRASHES = {
    "moving the old one aside": {1},
    "moving the new one in": {2},  # the old one is put back at once
    "moving the new one in, and dying there": {2, 3},  # ... or at the next start
    "deleting the old one": "rmtree",
}
"""Where a write fails: the calls of ``os.replace`` (counted from 1) that raise, or the
delete of the replaced directory."""


class Crash(OSError):
    """A rename or delete that fails, as on a full or failing disk."""


def _crash_at(monkeypatch: pytest.MonkeyPatch, where: set[int] | str) -> None:
    real_replace, real_rmtree = os.replace, shutil.rmtree
    calls = 0

    def replace(src, dst):
        nonlocal calls
        calls += 1
        if where != "rmtree" and calls in where:
            raise Crash(f"os.replace call {calls}")
        return real_replace(src, dst)

    def rmtree(path, *args, **kwargs):
        if where == "rmtree" and Path(path).name.startswith(".old-"):
            raise Crash("rmtree of the replaced directory")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", rmtree)


def _cfg(steps: int = 5):
    return tiny_config("sd3", "flowgrpo", [f"steps={steps}"])


def _write_checkpoint(writer: CheckpointWriter, step: int, value: float, cfg) -> Path:
    tmp = writer.begin(step)
    weights = {"w": torch.full((64,), value)}
    write_trainer_state(tmp, weights, {"state": {}, "param_groups": []})
    return writer.finish(tmp, step, step, checkpoint_identity(cfg), "steps: 5\n")


def _weight(path: Path) -> float:
    return float(load_trainer_state(path)[0]["w"][0])


@pytest.mark.parametrize("crash", CRASHES)
def test_a_checkpoint_of_the_same_step_survives_a_crash_at_every_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash: str
) -> None:
    cfg = _cfg()
    writer = CheckpointWriter(tmp_path, keep=1)
    _write_checkpoint(writer, 3, 1.0, cfg)  # keep=1: the only checkpoint there is
    root = tmp_path / "checkpoints"
    _crash_at(monkeypatch, CRASHES[crash])
    with pytest.raises(Crash):
        _write_checkpoint(writer, 3, 2.0, cfg)
    monkeypatch.undo()

    # a complete checkpoint of step 3 is on disk, under its name or moved aside
    on_disk = [p for p in (root / "step-000003", root / ".old-step-000003") if p.is_dir()]
    assert on_disk and checkpoint._verify(on_disk[0]) is None
    assert not (root / ".tmp-step-000003").exists()  # a failed write removes its own
    # the next start puts it back, and finds it whole
    ckpt = check_out_dir(tmp_path, cfg, resume=True, overwrite=False)
    assert ckpt is not None and ckpt.path == root / "step-000003" and ckpt.step == 3
    assert _weight(ckpt.path) == (2.0 if crash == "deleting the old one" else 1.0)
    assert sorted(p.name for p in root.iterdir()) == ["step-000003"]


@pytest.mark.parametrize("crash", CRASHES)
def test_final_weights_are_replaced_whole_at_every_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash: str
) -> None:
    def write(text: str) -> Path:
        tmp = staging_for(tmp_path / "lora")
        (tmp / "adapter_config.json").write_text(f'{{"r": "{text}"}}')
        (tmp / "sub").mkdir()
        (tmp / "sub" / "weights.safetensors").write_text(text * 100)
        return tmp

    publish(write("old"), tmp_path / "lora")
    _crash_at(monkeypatch, CRASHES[crash])
    new = write("new")
    with pytest.raises(Crash):
        publish(new, tmp_path / "lora")
    monkeypatch.undo()

    def complete(d: Path, text: str) -> bool:
        files = {p.relative_to(d).as_posix(): p.read_text() for p in d.rglob("*") if p.is_file()}
        return files == {
            "adapter_config.json": f'{{"r": "{text}"}}',
            "sub/weights.safetensors": text * 100,
        }

    lora, aside = tmp_path / "lora", tmp_path / ".old-lora"
    assert complete(new, "new") or complete(lora, "new")  # the new set, whole
    assert complete(lora, "old") or complete(aside, "old") or complete(lora, "new")
    tidy_out_dir(tmp_path)  # the next start (check_out_dir: the test below)
    assert complete(lora, "new" if crash == "deleting the old one" else "old")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lora"]


def test_publish_flushes_every_file_and_directory_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tmp = staging_for(tmp_path / "transformer")
    (tmp / "a.json").write_text("{}")
    (tmp / "shards").mkdir()
    (tmp / "shards" / "b.safetensors").write_bytes(b"x" * 10)
    want = {p.stat().st_ino for p in [tmp, *tmp.rglob("*")]} | {tmp_path.stat().st_ino}
    flushed: list[int] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        flushed.append(os.fstat(fd).st_ino)
        real_fsync(fd)

    def replace(src, dst):
        assert want - {tmp_path.stat().st_ino} <= set(flushed)  # all of it, before
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    final = publish(tmp, tmp_path / "transformer")
    assert set(flushed) == want and len(flushed) == 5  # 2 files, 2 directories, the parent
    assert (final / "shards" / "b.safetensors").read_bytes() == b"x" * 10


def test_leftovers_are_removed_at_the_next_start(tmp_path: Path) -> None:
    cfg = _cfg()
    writer = CheckpointWriter(tmp_path, keep=2)
    _write_checkpoint(writer, 2, 1.0, cfg)
    root = tmp_path / "checkpoints"
    # a full disk in the middle of step 4's checkpoint; a crash mid-rename of step 2's
    # (a stale copy moved aside, the new one in place) and of the final weights (moved
    # aside, nothing in their place yet); a staged transformer never finished
    (root / ".tmp-step-000004").mkdir()
    (root / ".tmp-step-000004" / "weights.safetensors").write_bytes(b"\0" * 100)
    shutil.copytree(root / "step-000002", root / ".old-step-000002")
    (tmp_path / ".old-lora").mkdir()
    (tmp_path / ".old-lora" / "adapter_config.json").write_text("{}")
    (tmp_path / ".tmp-transformer").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    kept = {"metrics.jsonl", "checkpoints", "lora"}

    # a refused start touches nothing
    with pytest.raises(DigenError, match="holds a previous run"):
        check_out_dir(tmp_path, cfg, resume=False, overwrite=False)
    assert (root / ".tmp-step-000004").is_dir() and (tmp_path / ".old-lora").is_dir()

    ckpt = check_out_dir(tmp_path, cfg, resume=True, overwrite=False)
    assert ckpt is not None and ckpt.step == 2 and ckpt.path == root / "step-000002"
    assert sorted(p.name for p in root.iterdir()) == ["step-000002"]
    assert {p.name for p in tmp_path.iterdir()} == kept
    assert (tmp_path / "lora" / "adapter_config.json").read_text() == "{}"
    assert latest_checkpoint(tmp_path) == ckpt

    # a new run in a directory holding only leftovers
    fresh = tmp_path / "fresh"
    (fresh / ".tmp-lora").mkdir(parents=True)
    assert check_out_dir(fresh, cfg, resume=False, overwrite=False) is None
    assert list(fresh.iterdir()) == []
