"""The ``digen`` command.

    digen run                                    # tiny FLUX + Flow-GRPO on the CPU
    digen run --model hunyuanvideo --algo dancegrpo
    digen run --config my.yaml rollout.n=8 train.lr=1e-4

Bad input (unknown model, missing files, a reward hook that does not import, a config value
that is not allowed) prints one sentence and exits with code 2; ``--debug`` shows the
traceback too.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import click

__all__ = ["main"]


def _quiet_imports() -> None:
    """Keep optional-dependency notices of third-party libraries off the user's terminal."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="digen")
def main() -> None:
    """digen: disaggregated RL post-training for diffusion and flow-matching models."""


@main.command(context_settings={"ignore_unknown_options": False})
@click.option("--model", help="hunyuanvideo, wan, flux, qwenimage or sd3 [default: flux].")
@click.option("--algo", help="flowgrpo or dancegrpo [default: flowgrpo].")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A YAML config file.",
)
@click.option(
    "--model-path",
    type=click.Path(path_type=Path),
    help="Local diffusers model directory (default: the tiny flavour).",
)
@click.option(
    "--mode",
    type=click.Choice(["colocated", "disaggregated"]),
    help="colocated (one pool alternates) or disaggregated (generator + trainer pools) [default: colocated].",
)
@click.option("--steps", type=int, help="Training steps.")
@click.option("--seed", type=int, help="Run seed.")
@click.option(
    "--prompts", type=click.Path(path_type=Path), help="Prompt file: .txt (one per line) or .jsonl."
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/latest"),
    show_default=True,
    help="Output directory.",
)
@click.option(
    "--sample-every",
    type=int,
    default=5,
    show_default=True,
    help="Save a sample grid every K steps.",
)
@click.option("--quiet", is_flag=True, help="No progress bar; print only the final summary.")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.argument("overrides", nargs=-1)
def run(
    model: str | None,
    algo: str | None,
    config_path: Path | None,
    model_path: Path | None,
    mode: str | None,
    steps: int | None,
    seed: int | None,
    prompts: Path | None,
    out_dir: Path,
    sample_every: int,
    quiet: bool,
    debug: bool,
    overrides: tuple[str, ...],
) -> None:
    """Train a policy with RL. OVERRIDES are dotted key=value settings, e.g. rollout.n=8."""
    _quiet_imports()
    try:
        result = _run(
            model,
            algo,
            config_path,
            model_path,
            mode,
            steps,
            seed,
            prompts,
            out_dir,
            sample_every,
            quiet,
            overrides,
        )
    except KeyboardInterrupt:
        click.echo("interrupted; outputs written so far are in place.", err=True)
        sys.exit(130)
    except Exception as exc:  # one sentence for the user's mistakes, tracebacks for ours
        from digen.errors import DigenError
        from digen.runtime.actors import WorkerDied

        if debug:
            raise
        if isinstance(exc, WorkerDied):  # not the user's mistake, but nothing to debug here
            click.echo(f"error: {exc} Outputs so far are in {out_dir}.", err=True)
            sys.exit(1)
        if not isinstance(exc, DigenError):
            raise
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    last = result.metrics[-1] if result.metrics else {}
    summary = {
        "out_dir": str(result.out_dir),
        "steps": len(result.metrics),
        "interrupted": result.interrupted,
        "reward_mean_first": result.metrics[0]["reward_mean"] if result.metrics else None,
        "reward_mean_last": last.get("reward_mean"),
        "weights": str(result.weights) if result.weights else None,
    }
    click.echo(json.dumps(summary) if quiet else _pretty(summary))


def _run(
    model,
    algo,
    config_path,
    model_path,
    mode,
    steps,
    seed,
    prompts,
    out_dir,
    sample_every,
    quiet,
    overrides,
):
    from digen.config import load_config
    from digen.errors import DigenError
    from digen.presets import preset
    from digen.runner import DigenRunner

    if model_path is not None and not model_path.exists():
        raise DigenError(f"--model-path '{model_path}' does not exist.")
    if model_path is not None and not (model_path / "model_index.json").is_file():
        raise DigenError(
            f"--model-path '{model_path}' is not a diffusers model directory (no model_index.json)."
        )
    cli: dict[str, Any] = {}
    if model_path is not None:
        cli.setdefault("model", {})["path"] = str(model_path)
    if steps is not None:
        cli["steps"] = steps
    if seed is not None:
        cli["seed"] = seed
    if prompts is not None:
        cli.setdefault("data", {})["prompts"] = str(prompts)
    model, algo, mode = _names_from_yaml(config_path, model, algo, mode, overrides)
    base = preset(model, algo, real_weights=model_path is not None, mode=mode)
    cli.setdefault("runtime", {})["mode"] = mode
    cli.setdefault("model", {}).setdefault("name", model)
    cli.setdefault("algo", {}).setdefault("name", algo)
    cfg = load_config(config_path, overrides, base=cli, preset=base)
    runner = DigenRunner(cfg, out_dir=out_dir, progress=not quiet, sample_every=sample_every)
    return _run_async(runner.run())


def _names_from_yaml(
    path: Path | None,
    model: str | None,
    algo: str | None,
    mode: str | None,
    overrides: tuple[str, ...],
) -> tuple[str, str, str]:
    """Model, algorithm and mode pick the preset: a flag wins, then an override, then the
    YAML file, then the defaults (flux, flowgrpo, colocated)."""
    data: dict[str, Any] = {}
    if path is not None and path.is_file():
        import yaml

        try:
            loaded = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            loaded = None  # load_config reports it in one sentence
        data = loaded if isinstance(loaded, dict) else {}

    def pick(section: str, key: str, given: str | None, default: str) -> str:
        if given is not None:
            return given
        for item in reversed(overrides):
            name, sep, value = item.partition("=")
            if sep and name.strip() == f"{section}.{key}":
                return value.strip()
        sec = data.get(section)
        value = sec.get(key) if isinstance(sec, dict) else None
        return value if isinstance(value, str) else default

    return (
        pick("model", "name", model, "flux"),
        pick("algo", "name", algo, "flowgrpo"),
        pick("runtime", "mode", mode, "colocated"),
    )


def _run_async(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux / macOS
        return asyncio.run(coro)


def _pretty(summary: dict[str, Any]) -> str:
    lines = [f"{k:>18}: {v}" for k, v in summary.items()]
    return "\n".join(lines)


if __name__ == "__main__":  # pragma: no cover
    main()
