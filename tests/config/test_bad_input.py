"""Bad input is one sentence and exit 2, found before torch or diffusers are imported where
the input can be checked without them: damaged or mismatched model directories, prompt
files that are not text, LoRA targets the backbone does not have."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from digen.errors import DigenError
from digen.models import get_adapter_class

# the CLI with torch and diffusers made unimportable: a check that needs them fails loudly
_NO_TORCH = (
    "import sys; sys.modules['torch'] = None; sys.modules['diffusers'] = None; "
    "sys.argv[0] = 'digen'; from cli.main import main; main()"
)


def _cli_without_torch(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", _NO_TORCH, "run", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return get_adapter_class("sd3").tiny_path()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _damage(path: Path) -> None:
    path.write_text(path.read_text()[:-20])  # cut off mid-object


@pytest.mark.parametrize(
    ("case", "model", "message"),
    [
        ("index", "sd3", "model_index.json' is not valid JSON"),
        ("transformer", "sd3", "transformer/config.json' is not valid JSON"),
        ("scheduler", "sd3", "scheduler/scheduler_config.json' is not valid JSON"),
        ("folder", "sd3", "names a vae component in model_index.json but has no vae/ folder"),
        (
            "other",
            "flux",
            "holds a StableDiffusion3Pipeline pipeline (a sd3 model: use --model sd3), but "
            "--model flux needs a FluxPipeline directory",
        ),
    ],
)
def test_a_damaged_or_mismatched_model_dir(
    tmp_path: Path, sd3_dir: Path, case: str, model: str, message: str
) -> None:
    d = _copy(sd3_dir, tmp_path / "model")
    if case == "index":
        _damage(d / "model_index.json")
    elif case == "transformer":
        _damage(d / "transformer" / "config.json")
    elif case == "scheduler":
        _damage(d / "scheduler" / "scheduler_config.json")
    elif case == "folder":
        shutil.rmtree(d / "vae")
    res = _cli_without_torch("--model", model, "--model-path", str(d), "--out", str(tmp_path / "o"))
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_damaged_weights_are_one_sentence_from_the_loader(tmp_path: Path, sd3_dir: Path) -> None:
    d = _copy(sd3_dir, tmp_path / "model")
    weights = next((d / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(DigenError, match=r"model path '.*' cannot be loaded: ") as err:
        get_adapter_class("sd3").from_pretrained(d)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "is a binary file"),
        ("un caf\u00e9\n".encode("latin-1"), "is not UTF-8 text (byte 0xe9 on line 1)"),
        (b'{"text": 1}\nnot json\n', "has no usable prompts (2 unusable lines; line 1 has no"),
    ],
)
def test_a_prompt_file_that_is_not_prompts(tmp_path: Path, content: bytes, message: str) -> None:
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(content)
    res = _cli_without_torch("--prompts", str(f), "--out", str(tmp_path / "o"))
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], lines


def test_lora_targets_the_backbone_lacks(sd3_dir: Path) -> None:
    from digen.models.lora import apply_lora

    adapter = get_adapter_class("sd3").from_pretrained(sd3_dir)
    with pytest.raises(DigenError, match=r"\['to_qq'\] name no layer of the SD3Transformer2DModel"):
        apply_lora(adapter.transformer, rank=2, alpha=2, targets=["to_q", "to_qq"])
    assert not any("lora_" in n for n, _ in adapter.transformer.named_parameters())
    with pytest.raises(DigenError, match="its layers are called: .*to_k, to_q, to_v"):
        apply_lora(adapter.transformer, rank=2, alpha=2, targets=["attn"])


def test_an_out_dir_that_refuses_the_run_is_said_before_torch_loads(tmp_path: Path) -> None:
    """A previous run in --out, a checkpoint of other weights, a run already done, nothing
    to resume: each one sentence and exit 2 from a CLI that cannot import torch, and the
    run directory is left byte for byte as it was."""
    import torch
    import yaml

    from digen import load_config
    from digen.checkpoint import CheckpointWriter, checkpoint_identity, write_trainer_state
    from digen.config import config_to_dict
    from digen.presets import preset

    out = tmp_path / "run"
    cfg = load_config(base=preset("sd3", "flowgrpo"), overrides=["steps=4"])
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    (out / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    writer = CheckpointWriter(out, keep=2)
    tmp = writer.begin(2)
    write_trainer_state(tmp, {"w": torch.ones(4)}, {"state": {}, "param_groups": []})
    writer.finish(tmp, 2, 2, checkpoint_identity(cfg), "steps: 4\n")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cases = [
        (["--out", str(out)], f"'{out}' holds a previous run (metrics.jsonl, checkpoints)"),
        (
            ["--resume", str(out), "train.lora_rank=4"],
            "was written with lora_rank = 16, but this run has lora_rank = 4",
        ),
        (["--resume", str(out), "--steps", "2"], "has already trained 2 steps"),
        # the run's own model, algorithm and mode may be said again; a different one may not
        (
            ["--resume", str(out), "--model", "sd3", "--algo", "flowgrpo", "--steps", "2"],
            "has already trained 2 steps",
        ),
        (
            ["--resume", str(out), "--model", "flux", "--mode", "colocated"],
            "differs from it: --model flux (the run's is sd3).",
        ),
        (
            ["--resume", str(out), "--algo", "dancegrpo", "--mode", "disaggregated"],
            "differs from it: --algo dancegrpo (the run's is flowgrpo), --mode disaggregated "
            "(the run's is colocated).",
        ),
        (["--resume", str(out), "--config", str(out / "config.yaml")], "--config cannot be"),
        (["--resume", str(tmp_path / "none")], "holds no run to resume"),
    ]
    for args, message in cases:
        res = _cli_without_torch(*args)
        assert res.returncode == 2, res.stderr[-2000:]
        assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
        assert message in res.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_reads_an_older_runs_flat_runtime_before_torch_loads(tmp_path: Path) -> None:
    """An older run's config.yaml (every runtime key directly under ``runtime``) is the
    run's config to --resume: its mode and steps are compared with what the command says."""
    import torch
    import yaml
    from helpers import flat_runtime

    from digen import load_config
    from digen.checkpoint import CheckpointWriter, checkpoint_identity, write_trainer_state
    from digen.config import config_to_dict
    from digen.presets import preset

    out = tmp_path / "run"
    over = ["steps=4", "runtime.generators=2", "runtime.schedule.tag=static"]
    cfg = load_config(base=preset("sd3", "flowgrpo", mode="disaggregated"), overrides=over)
    out.mkdir()
    (out / "config.yaml").write_text(yaml.safe_dump(flat_runtime(config_to_dict(cfg))))
    assert "tag" in yaml.safe_load((out / "config.yaml").read_text())["runtime"]
    writer = CheckpointWriter(out, keep=2)
    tmp = writer.begin(2)
    write_trainer_state(tmp, {"w": torch.ones(4)}, {"state": {}, "param_groups": []})
    writer.finish(tmp, 2, 2, checkpoint_identity(cfg), "steps: 4\n")
    for args, message in [
        (
            ["--mode", "colocated"],
            "differs from it: --mode colocated (the run's is disaggregated).",
        ),
        (["--mode", "disaggregated", "--steps", "2"], "has already trained 2 steps"),
    ]:
        res = _cli_without_torch("--resume", str(out), *args)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
        assert message in res.stderr


@pytest.mark.parametrize(("installed", "refused"), [("2.5.1", True), ("2.13.0+cpu", False)])
def test_a_torch_older_than_the_floor_is_one_sentence(
    monkeypatch: pytest.MonkeyPatch, installed: str, refused: bool
) -> None:
    """The floor is digen's own requirement (pyproject), read from the installed metadata."""
    import importlib.metadata

    from click.testing import CliRunner

    from cli.main import main

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: installed if name == "torch" else real(name)
    )
    res = CliRunner().invoke(main, ["models"])
    if refused:
        assert res.exit_code == 2
        assert res.output.strip() == (
            "error: digen needs torch 2.9 or newer (FSDP2's sum reduction and the Hugging Face "
            "checkpoint reader and writer), but torch 2.5.1 is installed; install a newer one "
            "first (pip install 'torch>=2.9')."
        )
    else:
        assert res.exit_code == 0 and "flux" in res.output


def test_resume_says_which_reward_hooks_its_config_loads(tmp_path: Path) -> None:
    """A resumed run's config.yaml may name code (``file.py:fn``, ``module:fn``): the
    command says so before anything loads it."""
    import yaml

    from digen import load_config
    from digen.config import config_to_dict

    out = tmp_path / "run"
    out.mkdir()
    rewards = "rewards=[{name: jpeg_incompressibility}, {name: '/hooks/mine.py:score'}]"
    cfg = load_config(overrides=[rewards])
    (out / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg)))
    res = _cli_without_torch("--resume", str(out))
    assert (
        "note: resuming loads the reward hooks its config names, running their code in this "
        "run's processes: /hooks/mine.py:score." in res.stderr
    ), res.stderr
    assert "jpeg_incompressibility" not in res.stderr.split("note:")[1].splitlines()[0]


def test_flavour_is_model_flavour_and_checked_before_torch_loads(tmp_path: Path) -> None:
    res = _cli_without_torch("--flavour", "huge", "--out", str(tmp_path / "o"))
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.flavour" in lines[0] and "shapes" in lines[0], lines
    assert not (tmp_path / "o").exists()


def test_a_join_secret_file_that_cannot_serve_is_said_before_torch_loads(tmp_path: Path) -> None:
    """``runtime.elastic.join_secret_file`` unreadable, or holding a secret too short to keep."""
    short = tmp_path / "short"
    short.write_text("abc\n")
    cases = [
        (
            tmp_path / "absent",
            f"'{tmp_path / 'absent'}' cannot be read: no such file or directory.",
        ),
        (short, f"'{short}' holds a join secret of 3 characters; use at least 16"),
    ]
    for path, message in cases:
        res = _cli_without_torch(
            "--mode",
            "disaggregated",
            "--out",
            str(tmp_path / "run"),
            "runtime.elastic.accept_generators=true",
            f"runtime.elastic.join_secret_file={path}",
        )
        assert res.returncode == 2, res.stderr[-2000:]
        said = f"error: runtime.elastic.join_secret_file {message}"
        assert res.stderr.startswith(said) and res.stderr.count("\n") == 1, res.stderr


_REFUSED = [
    (["run", "--mode", "colocated", "runtime.mode=disaggregated"], "--mode colocated and the "
     "override runtime.mode=disaggregated disagree; give one of them."),
    (["run", "model.device=gpu"], "model.device = 'gpu' is not allowed: name a torch device"),
    (["run", "model.device=cuda:99"], "model.device = cuda:99, but "),
    (["run", "train.lora_init=bogus"], "train.lora_init = 'bogus' is not allowed: name one of "
     "peft's initialisations: gaussian, true, false"),
    (["run", "--out", "a_file/run"], "--out 'a_file/run' cannot be written (not a directory)."),
    (["run", "--sample-every", "0"], "--sample-every = 0 is not allowed: it must be at least 1."),
    (["run", "--resume", "somewhere", "--overwrite"], "--resume continues the run in its folder "
     "and --overwrite replaces it; give one."),
    (["reward-server", "--port", "-1"], "-1 is not in the range 0<=x<=65535"),
    (["reward-server", "--port", "70000"], "70000 is not in the range 0<=x<=65535"),
    (["join", "127.0.0.1:5", "--wait", "-5"], "-5.0 is not in the range x>=0"),
    (["bench", "--quality", "--target", "-1"], "--target -1.0 is not allowed: it is a held-out "
     "accuracy, above 0 and at most 1."),
    (["bench", "--quality", "--workers", "1"], "--workers 1 is not allowed"),
    (["bench", "--quality", "--out", "a_file/q"], "--out 'a_file/q' cannot be written"),
    (["bench", "--out", "a_file/b"], "--out 'a_file/b' cannot be written"),
    (["simulate", "--plot", "missing/x.png"], "the directory 'missing' does not exist"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), _REFUSED, ids=[" ".join(a) for a, _ in _REFUSED])
def test_what_a_new_user_tries_is_refused_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    """Each is one sentence and exit 2, and leaves the folder it ran in as it was."""
    from click.testing import CliRunner

    from cli.main import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 2, res.output
    assert message in res.output.replace("\n", " "), res.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no runs/, no folder made


def test_load_config_refuses_one_string_of_overrides() -> None:
    from digen import load_config
    from digen.errors import ConfigError

    with pytest.raises(ConfigError, match=r"a list of key=value strings, not one string"):
        load_config(overrides="rollout.n=8")
