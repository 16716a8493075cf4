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


def _inherited(path: str) -> None:
    import gc
    import sys

    from digen.models import MODEL_NAMES, get_backbone

    try:  # transformers releases before the conversion mapping have nothing to build
        from transformers import conversion_mapping
    except ImportError:
        conversions = "absent"
    else:
        conversions = conversion_mapping._checkpoint_conversion_mapping_cache is not None
    modules = {name: get_backbone(name).adapter.split(":")[0] for name in MODEL_NAMES}
    seen = {
        "frozen": gc.get_freeze_count(),
        "backbones": [name for name, module in modules.items() if module in sys.modules],
        "conversions": conversions,
    }
    Path(path).write_text(json.dumps(seen))


def test_a_forked_child_finds_the_workers_stack_ready_and_out_of_the_collectors_passes(
    tmp_path: Path,
) -> None:
    """What every worker would otherwise make for itself is made once, in the server: each
    backbone imported, transformers' checkpoint conversion mapping built. What the child
    inherits is frozen: the garbage collector's passes leave it alone (and its pages shared)."""
    from digen.models import MODEL_NAMES

    forkserver.start_fork_server()  # running already, with the workers' preload
    seen = tmp_path / "seen.json"
    proc = forkserver.process(_inherited, (str(seen),), name="probe")
    forkserver.start(proc)
    proc.join(120)
    assert proc.exitcode == 0
    got = json.loads(seen.read_text())
    assert got["backbones"] == list(MODEL_NAMES)
    assert got["conversions"] in (True, "absent"), got
    assert got["frozen"] > 100_000, got  # the objects torch, diffusers and transformers made
