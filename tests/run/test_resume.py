"""Checkpoints and resume: a stopped run continued ends exactly where an uninterrupted one
does; damaged checkpoints are skipped; a run is never silently overwritten."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import yaml
from helpers import assert_trained_alike, flat_runtime, read_jsonl, run_config, tiny_config

from digen.checkpoint import CheckpointWriter, latest_checkpoint, write_trainer_state
from digen.errors import DigenError
from digen.prompts import PromptSet
from digen.sched.trace import Trace

# a schedule that changes every step, so a resume that lost the step would show
COMMON = ["train.lr=1e-3", "train.lr_schedule=cosine", "train.warmup_steps=1"]
COMMON += ["rollout.num_inference_steps=4", "save_every=1"]


def _cfg(mode: str, steps: int, extra: list[str] = (), algo: str = "flowgrpo"):
    return tiny_config("sd3", algo, [*COMMON, f"steps={steps}", *extra], mode=mode)


def _rows(out: Path) -> list[dict]:
    return read_jsonl(out / "metrics.jsonl")


_SAME = ("step", "reward_mean", "reward_std", "loss", "clip_fraction", "approx_kl", "grad_norm")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "algo"),
    # NFT: the old policy, which samples, must come back from the checkpoint too
    [("colocated", "flowgrpo"), ("disaggregated", "flowgrpo"), ("disaggregated", "nft")],
)
def test_stopped_and_resumed_equals_uninterrupted_bit_for_bit(
    tmp_path: Path, mode: str, algo: str
) -> None:
    extra = ["runtime.schedule.tag=none"] if mode == "disaggregated" else []
    if algo == "nft":
        extra.append("algo.params.decay_rate=0.2")  # an old policy well behind the trained one
    whole = run_config(_cfg(mode, 3, extra, algo), tmp_path / "whole")
    first = run_config(_cfg(mode, 2, extra, algo), tmp_path / "split")
    assert first.checkpoint == tmp_path / "split" / "checkpoints" / "step-000002"
    # what a full disk or a crash left unfinished goes at the next start
    junk = tmp_path / "split" / "checkpoints" / ".tmp-step-000007"
    junk.mkdir()
    (junk / "weights.safetensors").write_bytes(b"\0" * 64)
    (tmp_path / "split" / ".tmp-lora").mkdir()
    resumed = run_config(_cfg(mode, 3, extra, algo), tmp_path / "split", resume=True)
    assert resumed.first_step == 2 and len(resumed.metrics) == 1
    assert whole.final_state.keys() == resumed.final_state.keys()
    for name, value in whole.final_state.items():
        assert torch.equal(resumed.final_state[name], value), name
    moved = max(float(v.abs().max()) for n, v in whole.final_state.items() if "lora_B" in n)
    assert moved > 1e-4
    want, got = _rows(tmp_path / "whole"), _rows(tmp_path / "split")
    assert len(got) == 3  # appended, never rewritten
    assert [{k: r[k] for k in _SAME} for r in got] == [{k: r[k] for k in _SAME} for r in want]
    # the newest two checkpoints are kept
    names = sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir())
    assert names == ["step-000002", "step-000003"]
    assert not (tmp_path / "split" / ".tmp-lora").exists()


def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path) -> None:
    writer = CheckpointWriter(tmp_path, keep=3)
    for step in (1, 2, 3):
        tmp = writer.begin(step)
        weights = {"w": torch.full((64,), float(step))}
        write_trainer_state(tmp, weights, {"state": {}, "param_groups": []})
        writer.finish(tmp, step, step, {"model": "sd3"}, "steps: 3\n")
    newest = tmp_path / "checkpoints" / "step-000003" / "weights.safetensors"
    data = newest.read_bytes()
    newest.write_bytes(data[:-10])  # truncated
    notes: list[str] = []
    ckpt = latest_checkpoint(tmp_path, warn=notes.append)
    assert ckpt is not None and ckpt.step == 2
    assert "step-000003" in notes[0] and "bytes" in notes[0]
    older = tmp_path / "checkpoints" / "step-000002" / "weights.safetensors"
    flipped = bytearray(older.read_bytes())
    flipped[-1] ^= 0xFF  # same size, other contents
    older.write_bytes(bytes(flipped))
    notes.clear()
    ckpt = latest_checkpoint(tmp_path, warn=notes.append)
    assert ckpt is not None and ckpt.step == 1 and "checksum" in notes[-1]
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))


def test_a_run_is_never_silently_overwritten_and_resume_checks_the_model(tmp_path: Path) -> None:
    out = tmp_path / "run"
    run_config(_cfg("colocated", 1), out)
    with pytest.raises(DigenError, match="holds a previous run.*--resume"):
        run_config(_cfg("colocated", 1), out)
    with pytest.raises(DigenError, match="lora_rank = 16, but this run has lora_rank = 4"):
        run_config(_cfg("colocated", 2, ["train.lora_rank=4"]), out, resume=True)
    with pytest.raises(DigenError, match="already trained 1 steps"):
        run_config(_cfg("colocated", 1), out, resume=True)
    with pytest.raises(DigenError, match="no complete checkpoint"):
        run_config(_cfg("colocated", 2), tmp_path / "empty", resume=True)
    again = run_config(_cfg("colocated", 1), out, overwrite=True)
    assert len(_rows(out)) == 1 and again.metrics[0]["step"] == 0


@pytest.mark.slow
def test_an_older_run_with_a_flat_runtime_in_its_config_yaml_resumes(tmp_path: Path) -> None:
    """A run written before the runtime sections (its config.yaml has every runtime key
    directly under ``runtime``) is continued by ``digen run --resume`` as configured, to the
    step an uninterrupted run ends on; the resumed run writes its config.yaml in sections."""
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from cli.main import main
    from digen.config import load_config

    extra = ["runtime.schedule.tag=none"]  # a setting of a section, kept by the old file
    run_config(_cfg("colocated", 2, extra), tmp_path / "whole")
    run_config(_cfg("colocated", 1, extra), tmp_path / "old")
    saved = tmp_path / "old" / "config.yaml"
    sectioned = load_config(saved)
    saved.write_text(yaml.safe_dump(flat_runtime(yaml.safe_load(saved.read_text()))))
    assert "max_staleness" in yaml.safe_load(saved.read_text())["runtime"]  # the old layout
    assert load_config(saved) == sectioned
    args = ["run", "--resume", str(tmp_path / "old"), "--steps", "2", "--quiet"]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    want, got = _rows(tmp_path / "whole"), _rows(tmp_path / "old")
    assert [{k: r[k] for k in _SAME} for r in got] == [{k: r[k] for k in _SAME} for r in want]
    last = Path("checkpoints") / "step-000002" / "weights.safetensors"
    a, b = load_file(tmp_path / "whole" / last), load_file(tmp_path / "old" / last)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plain = yaml.safe_load(saved.read_text())
    assert "max_staleness" not in plain["runtime"] and "schedule" in plain["runtime"]
    assert load_config(saved, ["steps=1"]) == sectioned  # the same run, now at 2 steps


def test_the_learning_rate_schedule() -> None:
    t = _cfg("colocated", 11, ["train.warmup_steps=2", "train.lr_min_ratio=0.1"]).train
    lrs = [t.lr_at(s, 11) for s in range(11)]
    assert lrs[:3] == pytest.approx([1e-3 / 3, 2e-3 / 3, 1e-3])  # warm-up, then the peak
    assert lrs[-1] == pytest.approx(1e-4)  # cosine down to lr_min_ratio x lr
    assert lrs[3:] == sorted(lrs[3:], reverse=True)
    flat = _cfg("colocated", 11, ["train.lr_schedule=constant", "train.warmup_steps=0"]).train
    assert {flat.lr_at(s, 11) for s in range(11)} == {1e-3}


_STOP_HOOK = '''
import os, signal, time
from digen.rewards.builtin import jpeg_incompressibility

class StopAt:
    """JPEG incompressibility; on its call number STOP_AT (from 0, in this process) it
    sends SIGTERM to STOP_PID and waits, so the signal lands inside that scoring call."""

    calls = 0

    def __call__(self, samples, prompts, metadata):
        here = os.environ["STOP_FROM"] == "any" or os.getpid() == int(os.environ["STOP_PID"])
        if here and StopAt.calls == int(os.environ["STOP_AT"]):
            os.kill(int(os.environ["STOP_PID"]), signal.SIGTERM)
            time.sleep(1.0)
        StopAt.calls += 1
        return jpeg_incompressibility(samples, prompts, metadata)
'''


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["colocated", "colocated-dp", "disaggregated"])
def test_a_signal_inside_a_step_stops_at_the_next_micro_batch(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM while step 1 is being scored: the run stops at the next micro-batch boundary
    inside step 1 (it does not finish the step), keeps step 1's checkpoint, and a resume
    ends with the weights of an uninterrupted run."""
    from digen.config import schedule_plan

    hook = tmp_path / "stop_hook.py"
    hook.write_text(_STOP_HOOK)
    extra = [f"rewards=[{{name: '{hook}:StopAt'}}]"]
    extra += ["runtime.schedule.tag=none"] if mode == "disaggregated" else []
    # two data-parallel workers: the lead (this process) is signalled, both stop together
    extra += ["train.num_devices=2", "train.micro_batch_size=4"] if mode == "colocated-dp" else []
    cfg = _cfg(mode.removesuffix("-dp"), 3, extra)
    monkeypatch.setenv("STOP_PID", str(os.getpid()))
    monkeypatch.setenv("STOP_FROM", "any" if mode == "disaggregated" else "lead")
    monkeypatch.setenv("STOP_AT", "-1")
    whole = run_config(cfg, tmp_path / "whole")
    # the first scoring call of step 1: one per step colocated, one per micro-batch else
    per_step = 1 if mode != "disaggregated" else schedule_plan(cfg).microbatches
    assert per_step > 1 or mode != "disaggregated"
    monkeypatch.setenv("STOP_AT", str(per_step))
    stopped = run_config(cfg, tmp_path / "split")
    assert stopped.interrupted and stopped.stop_signal == "SIGTERM"
    assert len(stopped.metrics) == 1  # step 1 was left, not finished
    assert stopped.checkpoint == tmp_path / "split" / "checkpoints" / "step-000001"
    assert len(_rows(tmp_path / "split")) == 1
    monkeypatch.setenv("STOP_AT", "-1")
    resumed = run_config(cfg, tmp_path / "split", resume=True)
    assert resumed.first_step == 1 and len(resumed.metrics) == 2
    for name, value in whole.final_state.items():
        assert torch.equal(resumed.final_state[name], value), name
    want, got = _rows(tmp_path / "whole"), _rows(tmp_path / "split")
    assert [{k: r[k] for k in _SAME} for r in got] == [{k: r[k] for k in _SAME} for r in want]


@pytest.mark.slow
def test_a_resumed_tcss_run_makes_its_first_step_on_policy(tmp_path: Path) -> None:
    """Under fixed TCSS a step's early micro-batches come from the previous version, which a
    resumed run does not have: its first step is on-policy, the next ones stale again."""
    extra = [
        "runtime.schedule.max_staleness=1",
        "runtime.schedule.staleness_ratio=0.5",
        "runtime.schedule.tag=none",
    ]
    run_config(_cfg("disaggregated", 2, extra), tmp_path)
    resumed = run_config(_cfg("disaggregated", 4, extra), tmp_path, resume=True)
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    stale = [r["stale_microbatches"] for r in rows]
    assert stale[0] == 0 and stale[1] > 0  # the first step of a run has no older version
    assert stale[2] == 0 and stale[3] == stale[1]  # resumed at 2: on-policy, then as before
    assert resumed.first_step == 2
    # the profiler's estimates travel with the checkpoint: BTS resumes with the run's costs
    from digen.checkpoint import latest_checkpoint
    from digen.runtime.driver.loop import Driver
    from digen.sched.costs import OnlineProfiler

    ckpt = latest_checkpoint(tmp_path)
    saved = OnlineProfiler.load(ckpt.path / "profiler.json")
    assert saved.count("gen") >= 4 and saved.estimate("gen") > 0  # every step's generations
    driver = Driver(
        _cfg("disaggregated", 6, extra), None, PromptSet.builtin(), Trace(), resume=ckpt
    )
    assert driver.accounts.profiler.to_dict() == saved.to_dict()


@pytest.mark.slow
def test_sharded_trainers_resume_exactly_and_a_checkpoint_moves_between_layouts(
    tmp_path: Path,
) -> None:
    """Two FSDP trainers write a checkpoint, each its own shards (torch.distributed.checkpoint
    in safetensors: nobody gathers the model); two FSDP trainers resume it bit for bit, and
    one unsharded trainer loads the same files (to float precision: a different summation
    order). With NFT, whose old policy and moving average are sharded beside the weights and
    the optimizer state every algorithm has (the others resume unsharded above)."""
    import shutil

    from safetensors import safe_open

    algo, lag = "nft", ["algo.params.decay_rate=0.2"]  # the old policy well behind theta
    fsdp = [
        "runtime.trainers=2",
        "runtime.placement.trainer_parallel=fsdp",
        "runtime.schedule.tag=none",
        *lag,
    ]
    whole = run_config(_cfg("disaggregated", 3, fsdp, algo), tmp_path / "whole")
    split = run_config(_cfg("disaggregated", 2, fsdp, algo), tmp_path / "split")
    files = sorted((split.checkpoint / "sharded").iterdir())
    assert len(files) == 2 and not (split.checkpoint / "weights.safetensors").exists()
    manifest = json.loads((split.checkpoint / "manifest.json").read_text())["files"]
    assert {f"sharded/{f.name}" for f in files} <= manifest.keys()
    total = sum(v.numel() for v in split.final_state.values())
    for f in files:  # each trainer wrote about half of every trained tensor
        with safe_open(str(f), framework="pt") as fh:
            names = [k for k in fh.keys() if k.startswith("weights::")]  # noqa: SIM118
            held = [fh.get_slice(k).get_shape() for k in names]
            kept = {k.split("::")[0] for k in fh.keys()} - {"weights", "optimizer"}  # noqa: SIM118
        assert kept == {"old", "ema"}
        numel = sum(torch.Size(shape).numel() for shape in held)
        assert len(held) == len(split.final_state) and 0.3 * total < numel < 0.7 * total
    shutil.copytree(tmp_path / "split", tmp_path / "moved")
    resumed = run_config(_cfg("disaggregated", 3, fsdp, algo), tmp_path / "split", resume=True)
    one = ["runtime.schedule.tag=none", *lag]
    moved = run_config(_cfg("disaggregated", 3, one, algo), tmp_path / "moved", resume=True)
    for name, value in whole.final_state.items():
        assert torch.equal(resumed.final_state[name], value), name
    assert_trained_alike(moved.final_state, whole.final_state)  # its last step summed apart
    assert _rows(tmp_path / "split")[-1]["loss"] == _rows(tmp_path / "whole")[-1]["loss"]
