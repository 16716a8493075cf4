"""Experiment trackers (``logger=[tensorboard, wandb]``): what a run sends them, read back from
the files each one writes, equals its ``metrics.jsonl`` rows and its pictures; a bad name or a
missing package stops ``digen run`` in one sentence before anything starts."""

from __future__ import annotations

import importlib.util
import io
import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from helpers import read_jsonl, run_config, tiny_config
from PIL import Image

from cli.main import main
from digen import load_config
from digen.run.trackers import TRACKERS, wandb_mode

SMALL = ["rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=4", "steps=2"]
pytestmark = pytest.mark.xdist_group("test_trackers")  # one worker builds the module's run
SMALL.append("model.flavour=tiny")  # digen run's own default for flux is the shapes model


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]], list[str]]:
    """One tiny two-step run logging to every installed tracker (W&B offline): its directory,
    its metrics.jsonl rows and the trackers it used. Both steps write a sample grid."""
    logger = [name for name in TRACKERS if importlib.util.find_spec(name)]
    if not logger:
        pytest.skip("no tracker installed (pip install 'digen[tensorboard,wandb]')")
    tmp = tmp_path_factory.mktemp("trackers")
    out = tmp / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            mp.setenv(var, str(tmp / var.lower()))
        cfg = tiny_config("flux", "flowgrpo", [*SMALL, f"logger=[{', '.join(logger)}]"])
        assert cfg.logger == logger
        run_config(cfg, out, save_weights=False)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    return out, rows, logger


def _numbers(row: dict[str, Any]) -> set[str]:
    return {k for k, v in row.items() if k != "step" and isinstance(v, int | float)}


def _png(path: Path | bytes) -> np.ndarray:
    with Image.open(io.BytesIO(path) if isinstance(path, bytes) else path) as im:
        return np.asarray(im.convert("RGB"))


@pytest.mark.slow
def test_tensorboard_holds_the_metrics_rows_and_the_pictures(run) -> None:
    out, rows, logger = run
    if "tensorboard" not in logger:
        pytest.skip("tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    tags = acc.Tags()
    assert set(tags["scalars"]) == _numbers(rows[0]) and "reward_mean" in tags["scalars"]
    for key in tags["scalars"]:
        events = acc.Scalars(key)
        assert [e.step for e in events] == [0, 1], key
        want = [float(r[key]) for r in rows]
        assert [e.value for e in events] == pytest.approx(want, rel=1e-6, abs=1e-30), key  # fp32

    grids = acc.Images("sample_grid")
    assert [e.step for e in grids] == [0, 1]
    for e in grids:
        picture = _png(out / "samples" / f"step_{e.step:04d}.png")
        assert (e.height, e.width) == picture.shape[:2]
        assert np.array_equal(_png(e.encoded_image_string), picture)
    [timeline] = acc.Images("timeline")
    assert timeline.step == 1 and (timeline.width, timeline.height) == (1600, 600)
    assert np.array_equal(_png(timeline.encoded_image_string), _png(out / "timeline.png"))

    [config] = acc.Tensors("config/text_summary")
    text = config.tensor_proto.string_val[0].decode()
    assert "    steps: 2\n" in text and "    model:\n      name: flux\n" in text


def _wandb_records(path: Path) -> Iterator[Any]:
    """The records of a ``.wandb`` file (wandb ships no Python reader for it any more): a
    LevelDB-style log, a 7-byte header then 32 KiB blocks of chunks, each ``crc32c u32,
    length u16, type u8`` and its bytes (type 1 a whole record; 2, 3, 4 its first, middle and
    last part), the records being wandb's ``Record`` protobufs."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, []
    while pos + 7 <= len(data):
        room = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if room < 7 or kind == 0:  # a block's padding
            pos += room
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_rows_and_the_pictures(run) -> None:
    out, rows, logger = run
    if "wandb" not in logger:
        pytest.skip("wandb is not installed")
    [run_dir] = (out / "wandb").glob("offline-run-*")
    [log] = run_dir.glob("run-*.wandb")
    history: list[dict[str, Any]] = []
    config: dict[str, Any] = {}
    for record in _wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = record.history.item
            history.append(
                {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            )
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    assert config["steps"] == 2 and config["logger"] == logger
    assert config["model"]["name"] == "flux"

    assert [h["_step"] for h in history] == [0, 1]
    for h, row in zip(history, rows, strict=True):
        for key in _numbers(row):
            assert h[key] == row[key], key  # JSON both ways: the same float64
        grid = h["sample_grid/path"]
        assert h["sample_grid/_type"] == "image-file" and h["sample_grid/caption"]
        picture = _png(out / "samples" / f"step_{row['step']:04d}.png")
        assert (h["sample_grid/height"], h["sample_grid/width"]) == picture.shape[:2]
        assert np.array_equal(_png(run_dir / "files" / grid), picture)
    last = history[-1]
    assert (last["timeline/width"], last["timeline/height"]) == (1600, 600)
    assert np.array_equal(
        _png(run_dir / "files" / last["timeline/path"]), _png(out / "timeline.png")
    )


def test_wandb_is_offline_unless_told_or_logged_in(tmp_path: Path) -> None:
    none = str(tmp_path / "no-netrc")
    assert wandb_mode({"NETRC": none}) == "offline"
    assert wandb_mode({"NETRC": none, "WANDB_MODE": "disabled"}) == "disabled"
    assert wandb_mode({"NETRC": none, "WANDB_API_KEY": "k" * 40}) == "online"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_mode({"NETRC": str(netrc)}) == "online"  # what `wandb login` writes
    other = {"NETRC": str(netrc), "WANDB_BASE_URL": "https://wandb.example.com"}
    assert wandb_mode(other) == "offline"  # a key for another host


def _one_line_error(tmp_path: Path, *args: str) -> str:
    res = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "o"), *args])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output
    assert not (tmp_path / "o").exists()  # before anything started
    return lines[0]


@pytest.mark.parametrize("value", ["[tensorbord]", "tensorbord"])
def test_a_bad_logger_name_is_one_sentence(tmp_path: Path, value: str) -> None:
    shown = "['tensorbord']" if value.startswith("[") else "'tensorbord'"
    assert _one_line_error(tmp_path, f"logger={value}") == (
        f"error: logger = {shown} is not allowed: list trackers from tensorboard, wandb, "
        "as in logger=[tensorboard, wandb]."
    )


def test_a_bare_logger_name_is_a_list_of_one() -> None:
    assert load_config(overrides=["logger=tensorboard"]).logger == ["tensorboard"]
    assert load_config().logger == [] and load_config(overrides=["logger=null"]).logger == []


def test_a_missing_tracker_package_names_its_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like
    assert _one_line_error(tmp_path, "logger=[wandb]", *SMALL) == (
        "error: logger has wandb, but the wandb package is not installed; "
        "install it with pip install 'digen[wandb]'."
    )
