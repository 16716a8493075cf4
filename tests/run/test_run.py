"""`digen run` and `DigenRunner`: the outputs of a run, bad input, Ctrl-C, data parallelism."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from helpers import SMOOTH_REWARD, assert_trained_alike, read_jsonl, run_config, tiny_config

from cli.main import main
from digen import DigenRunner, load_config
from digen.config import config_to_dict
from digen.errors import DigenError
from digen.models import MODEL_NAMES, get_adapter_class
from digen.presets import ALGO_NAMES, preset
from digen.registry.algos import get_algorithm
from digen.run.outputs import MIN_TILE_WIDTH

SMALL = ["rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=4"]
SMALL.append("model.flavour=tiny")  # digen run's own default for flux is the shapes model
METRIC_KEYS = {
    "step",
    "reward_mean",
    "reward_std",
    "reward_min",
    "reward_max",
    "loss",
    "kl",
    "clip_fraction",
    "approx_kl",
    "step_time_s",
    "time/generate_s",
    "time/score_s",
    "time/train_s",
    "reward/jpeg_incompressibility",
    "reward_latency_ms/jpeg_incompressibility",
}


def _invoke(*args: str):
    return CliRunner().invoke(main, ["run", *args], catch_exceptions=False)


@pytest.mark.slow
@pytest.mark.parametrize("algo", ALGO_NAMES)
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_run_every_model_and_algo(tmp_path: Path, model: str, algo: str) -> None:
    out = tmp_path / "out"
    res = _invoke(
        "--model", model, "--algo", algo, "--steps", "1", "--out", str(out), "--quiet", *SMALL
    )
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["steps"] == 1 and summary["interrupted"] is False

    cfg = load_config(out / "config.yaml")  # the resolved config loads back as it ran
    assert (cfg.model.name, cfg.algo.name, cfg.rollout.n, cfg.steps) == (model, algo, 2, 1)
    assert cfg.rollout.sde_type == get_algorithm(algo).sde_types[0]

    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 1 and set(rows[0]) >= METRIC_KEYS
    row = rows[0]
    assert row["step"] == 0 and row["samples"] == 4 and row["policy_version"] == 1
    assert row["optimizer_steps"] == 2  # the preset's two mini-batches
    assert row["reward_min"] <= row["reward_mean"] <= row["reward_max"]
    assert row["reward_mean"] == pytest.approx(row["reward/jpeg_incompressibility"], rel=1e-6)
    assert row["reward_mean"] > 0  # a JPEG of a decoded sample has a size
    assert row["step_time_s"] >= row["time/generate_s"] + row["time/train_s"]

    grid = out / "samples" / "step_0000.png"
    from PIL import Image

    with Image.open(grid) as im:
        adapter_cls = get_adapter_class(model)
        frames = 3 if adapter_cls.is_video else 1
        tile = (cfg.model.width or adapter_cls.tiny_width) * frames
        zoom = -(-MIN_TILE_WIDTH // tile)  # tiny samples are scaled up to show their captions
        assert im.width == 4 * tile * zoom  # 4 samples in one row
    log = read_jsonl(out / "trainer.log")
    assert [e["event"] for e in log][0] == "run_start" and log[-1]["event"] == "run_end"
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_saved_lora_loads_into_the_diffusers_pipeline(tmp_path: Path) -> None:
    cfg = tiny_config("flux", "flowgrpo", [*SMALL, "steps=1"])
    result = run_config(cfg, tmp_path)
    cls = get_adapter_class("flux")
    pipe = cls.pipeline_class.from_pretrained(str(cls.tiny_path()))
    pipe.load_lora_weights(str(result.weights))
    loaded = {n: p for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    trained = {n.replace(".default", ""): p for n, p in result.final_state.items()}
    assert len(loaded) == len(trained) > 0
    diffs = []
    for name, p in loaded.items():
        key = name.replace(".default_0", "")
        diffs.append(float((p - trained[key]).abs().max()))
    assert max(diffs) == 0.0
    assert any(float(p.abs().max()) > 0 for n, p in loaded.items() if "lora_B" in n)


@pytest.mark.asyncio
async def test_runner_api_with_async_reward_hook(tmp_path: Path) -> None:
    seen: list[int] = []

    async def mean_red(samples, prompts, metadata):
        seen.append(samples.shape[0])
        return samples[..., 0].float().mean(dim=(1, 2, 3)).tolist()

    cfg = tiny_config("sd3", "flowgrpo", [*SMALL, "steps=2"])
    result = await DigenRunner(
        cfg, rewards=[(mean_red, 2.0)], out_dir=tmp_path, progress=False
    ).run()
    assert [m["step"] for m in result.metrics] == [0, 1]
    assert seen == [4, 4]
    for m in result.metrics:
        assert m["reward_mean"] == pytest.approx(2.0 * m["reward/mean_red"], rel=1e-6)
        assert 0 < m["reward/mean_red"] < 255
    assert result.metrics == read_jsonl(tmp_path / "metrics.jsonl")


@pytest.mark.asyncio
async def test_api_run_is_quiet_and_says_where_it_writes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Python API: no per-prompt tokenizer warnings (one note in trainer.log instead),
    no loading bars, and a temporary output directory that is announced and returned."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where out_dir=None goes
    prompts = tmp_path / "long.txt"
    prompts.write_text(
        "a very long prompt about a lighthouse on a rocky coast at dusk, waves, gulls\n"
        "another long prompt about a red bicycle parked by a lamp post in the rain\n"
    )
    over = [*SMALL, "steps=1", f"data.prompts={prompts}"]
    capfd.readouterr()
    result = await DigenRunner(load_config(overrides=over)).run()
    err = capfd.readouterr().err
    assert result.out_dir.parent == tmp_path and result.out_dir.name.startswith("digen-run-")
    assert err.count(f"writing to {result.out_dir} ") == 1
    for noise in ("truncated", "Token indices", "Loading", "torchvision"):
        assert noise not in err, err
    log = read_jsonl(result.out_dir / "trainer.log")
    notes = [e["text"] for e in log if e["event"] == "note"]
    assert len(notes) == 1 and "truncated" in notes[0], notes


@pytest.mark.slow
def test_disaggregated_workers_note_into_the_run_log(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Worker processes' notes (a prompt the text encoders truncate) go to trainer.log, one
    per worker that encoded it and naming the worker, never to the terminal."""
    prompts = tmp_path / "long.txt"
    prompts.write_text(
        "a very long prompt about a lighthouse on a rocky coast at dusk, waves, gulls\n"
        "another long prompt about a red bicycle parked by a lamp post in the rain\n"
    )
    over = [*SMALL, "steps=1", f"data.prompts={prompts}", "runtime.generators=2"]
    over += ["runtime.schedule.tag=none", "save_every=0"]
    cfg = tiny_config("flux", "flowgrpo", over, mode="disaggregated")
    capfd.readouterr()
    run_config(cfg, tmp_path / "out")
    err = capfd.readouterr().err
    assert "truncated" not in err and "Token indices" not in err, err
    log = read_jsonl(tmp_path / "out" / "trainer.log")
    notes = [e for e in log if e["event"] == "note"]
    by = Counter(e.get("worker") for e in notes)
    # both generators encoded a long prompt; each says so once (trainers take the embeddings)
    assert by == {"generator-0": 1, "generator-1": 1}, notes
    assert all("truncated" in e["text"] for e in notes)


@pytest.mark.slow
def test_data_parallel_equals_single_process(tmp_path: Path) -> None:
    over = ["steps=1", "rollout.n=4", "train.micro_batch_size=2", "rollout.num_inference_steps=4"]
    over.append("train.lr=1e-3")
    over.append(SMOOTH_REWARD)  # each process samples its share: last bits may differ
    base = preset("flux", "flowgrpo")
    one = run_config(load_config(base=base, overrides=over), tmp_path / "a")
    pinned = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
    before = {k: os.environ.get(k) for k in pinned}
    two = run_config(
        load_config(base=base, overrides=[*over, "train.num_devices=2"]), tmp_path / "b"
    )
    # the group's transports were pinned to loopback for the run only
    assert {k: os.environ.get(k) for k in pinned} == before
    assert one.metrics[0]["reward_mean"] == pytest.approx(two.metrics[0]["reward_mean"], rel=1e-6)
    assert_trained_alike(two.final_state, one.final_state)


@pytest.mark.slow
def test_data_parallel_workers_load_config_hooks_by_name_and_a_failed_start_is_named(
    tmp_path: Path,
) -> None:
    """A hook named by file path in the config reaches the second worker (it is loaded there
    again by name); a worker that fails while starting ends the run at once with its rank
    and exit code, instead of the lead waiting for it to join."""
    hook = tmp_path / "lead_only.py"
    hook.write_text(
        "import os\n"
        "if os.environ.get('ONLY_IN') not in (None, str(os.getpid())):\n"
        "    raise RuntimeError('this hook loads in the lead only')\n"
        "def score(samples, prompts, metadata):\n"
        "    return [float(s.float().mean()) for s in samples]\n"
    )
    over = ["steps=1", "rollout.n=4", "train.micro_batch_size=2", "rollout.num_inference_steps=4"]
    over += ["train.num_devices=2", f"rewards=[{{name: '{hook}:score'}}]"]
    cfg = tiny_config("flux", "flowgrpo", over)
    result = run_config(cfg, tmp_path / "a")
    assert [m["step"] for m in result.metrics] == [0]
    assert 0.0 < result.metrics[0]["reward_mean"] < 255.0  # the mean pixel
    os.environ["ONLY_IN"] = str(os.getpid())
    try:
        t0 = time.monotonic()
        with pytest.raises(DigenError, match=r"data-parallel worker 1 exited with code 1 while"):
            run_config(cfg, tmp_path / "b")
        assert time.monotonic() - t0 < 120  # not the process group's 30-minute wait
    finally:
        del os.environ["ONLY_IN"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "sdxl"], "unknown model 'sdxl'"),
        (["--algo", "ppo"], "unknown algorithm 'ppo'"),
        (["--model-path", "/no/such/dir"], "does not exist"),
        (["--prompts", "/no/such/file.txt"], "prompt file '/no/such/file.txt' does not exist"),
        (["rewards.0.name=no_such_module_xyz:fn"], "no_such_module_xyz"),
        (["rollout.n=1"], "rollout.n = 1"),
        (["rollout.nn=3"], "unknown config key 'rollout.nn'"),
    ],
)
def test_bad_input_is_one_sentence_and_exit_2(tmp_path: Path, args, message) -> None:
    res = CliRunner().invoke(main, ["run", "--out", str(tmp_path / "o"), *args])
    assert res.exit_code == 2, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert "Traceback" not in res.output


def test_model_path_that_is_not_a_diffusers_dir(tmp_path: Path) -> None:
    res = CliRunner().invoke(main, ["run", "--model-path", str(tmp_path)])
    assert res.exit_code == 2 and "not a diffusers model directory" in res.output


def test_empty_prompt_file(tmp_path: Path) -> None:
    f = tmp_path / "empty.txt"
    f.write_text("\n")
    res = CliRunner().invoke(main, ["run", "--prompts", str(f)])
    assert res.exit_code == 2 and "has no usable prompts" in res.output


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_stops_with_a_checkpoint(
    tmp_path: Path, sig, code: int, run_mark
) -> None:
    """Ctrl-C, or SIGTERM (a scheduler's preemption), mid-run: the run stops with a
    checkpoint of the steps done, its weights, and an exit code scripts can tell from done;
    when the command returns, no process of its run (fork server included) is left."""
    out = tmp_path / "run"
    env = run_mark.env
    cmd = [
        sys.executable,
        "-m",
        "cli.main",
        "run",
        "--out",
        str(out),
        "--quiet",
        "--steps",
        "50",
        *SMALL,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text().strip()):
        time.sleep(0.2)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == code, stderr  # 128 + the signal: scripts can tell it from done
    assert run_mark.left() == []
    assert f"digen run --resume {out}" in stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["interrupted"] is True and 1 <= summary["steps"] < 50
    assert summary["checkpoint"] == str(out / "checkpoints" / f"step-{summary['steps']:06d}")
    rows = read_jsonl(metrics)
    assert [r["step"] for r in rows] == list(range(summary["steps"]))
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert yaml.safe_load((out / "config.yaml").read_text())["steps"] == 50
    assert config_to_dict(load_config(out / "config.yaml"))["steps"] == 50


@pytest.mark.slow
def test_a_run_with_its_stdout_closed_runs(tmp_path: Path, run_mark) -> None:
    """``digen run >&-`` (a daemon's way of starting it): the run completes with its outputs,
    and once the command returns no process of the run is left."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "cli.main", "run", "--out", str(out), "--steps", "1", *SMALL]
    line = " ".join(f"'{a}'" for a in cmd)
    res = subprocess.run(
        ["bash", "-c", f"exec {line} >&-"], env=run_mark.env, capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert run_mark.left() == []
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0]
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_full_finetune_with_kl_saves_a_transformer(tmp_path: Path) -> None:
    over = [*SMALL, "steps=2", "train.lora_rank=0", "train.lr=1e-3", "algo.kl_coef=0.1"]
    cfg = tiny_config("sd3", "flowgrpo", over)
    result = run_config(cfg, tmp_path)
    assert result.weights == tmp_path / "transformer"
    cls = get_adapter_class("sd3")
    saved = cls.pipeline_class.from_pretrained(str(cls.tiny_path())).transformer
    base = dict(saved.named_parameters())
    reloaded = type(saved).from_pretrained(str(result.weights))
    moved = 0.0
    for name, p in reloaded.named_parameters():
        torch.testing.assert_close(p, result.final_state[name])
        moved = max(moved, float((p - base[name]).abs().max()))
    assert moved > 1e-4  # every weight trains in full fine-tuning
    # step 0 trains from the reference itself; by step 1 the policy has left it
    assert result.metrics[0]["kl"] < result.metrics[1]["kl"] and result.metrics[1]["kl"] > 0
