"""Host memory across a full fine-tuning run, as multiples of the model's size.

Two runs that differ only in the transformer's size (the tiny SD3, and one 250 MB wider):
what a process's peak grows by between them is what it holds of the model. The driver holds
none of it: the weights and the evaluation's moving average go from trainer 0 to the
generators and to the disk, and the final state a caller gets is read from the saved files
when it is used.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import read_jsonl, wider_sd3

ARGS = ["--model", "sd3", "--mode", "disaggregated", "--steps", "2", "--quiet"]
ARGS += ["train.lora_rank=0", "runtime.trainers=2", "runtime.trainer_parallel=fsdp"]
ARGS += ["rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=3"]
ARGS += ["data.train_batch_size=1", "train.mini_batch_size=null", "save_every=0"]
ARGS += ["runtime.sync_bucket_mb=16", "model.dtype=float32"]  # buckets: a small part of it


def _peaks(out: Path, *extra: str) -> dict[str, float]:
    """The run's largest peak of each process kind, in GB (the driver's to the run's end).
    It evaluates the trainers' moving average before the first step and after the last."""
    out.mkdir(parents=True)
    (out / "eval.txt").write_text("a red apple\n")
    evaluation = [
        "eval.every=2",
        "eval.ema=0.9",
        "eval.samples=1",
        f"eval.prompts={out / 'eval.txt'}",
    ]
    cmd = [sys.executable, "-m", "cli.main", "run", *ARGS, *evaluation, "--out", str(out), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_jsonl(out / "metrics.jsonl")
    peaks = {k: max(r[f"memory/peak_gb/{k}"] for r in rows) for k in ("trainer", "generator")}
    return {**peaks, "driver": json.loads(done.stdout.splitlines()[-1])["peak_memory_gb"]}


@pytest.mark.slow
def test_the_driver_holds_no_weights_of_a_full_fine_tune(tmp_path: Path) -> None:
    size_gb = wider_sd3(tmp_path / "wider", heads=12, head_dim=64, layers=3) / 1e9
    tiny = _peaks(tmp_path / "tiny")
    wider = _peaks(tmp_path / "run", "--model-path", str(tmp_path / "wider"))
    grown = {k: (wider[k] - tiny[k]) / size_gb for k in tiny}
    print(f"peak growth in copies of the {size_gb:.2f} GB transformer: {grown}")
    # one copy would be 1.0; allocator noise is a few MB of the 250 MB
    assert grown["driver"] < 0.25, grown
    assert grown["generator"] > 0.9  # the measurement sees a copy where there is one
    from digen.checkpoint import SavedWeights

    saved = SavedWeights(tmp_path / "run" / "transformer", ["proj_out.weight"])
    assert saved["proj_out.weight"].shape[1] == 768  # the wider model's, from the disk
