"""The ``digen`` command.

    digen run                                    # the shipped shapes FLUX + Flow-GRPO on the CPU
    digen run --model hunyuanvideo --algo dancegrpo
    digen run --config my.yaml rollout.n=8 train.lr=1e-4

Bad input (unknown model, missing files, a reward hook that does not import, a config value
that is not allowed) prints one sentence and exits with code 2; ``--debug`` shows the
traceback too.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set, or ``--launcher torchrun``) every rank
runs the same command: rank 0 is the driver and writes the outputs, the others become the
workers named by :func:`~digen.runtime.transport.torchrun.role_for_rank` (docs/RUNTIME.md, "Multi-node with torchrun").
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import itertools
import json
import logging
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from digen.algos.registry import ALGO_NAMES, get_algorithm
from digen.models.registry import BACKBONES, MODEL_NAMES

__all__ = ["main"]


def _quiet_imports() -> None:
    """Keep optional-dependency notices of third-party libraries off the user's terminal
    (read when they are imported, which is only once the config is known to be good)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _quiet_progress_bars() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


def _or(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="digen")
def main() -> None:
    """digen: disaggregated RL post-training for diffusion and flow-matching models."""
    _check_torch()


def _check_torch() -> None:
    """One sentence, exit 2, when the installed torch is older than the floor in digen's own
    requirements (read from the installed package, not imported: this is quick)."""
    from importlib import metadata

    floor = next(
        (
            r.split(">=", 1)[1].split(",")[0].split(";")[0].strip()
            for r in _requires("digen")
            if r.replace(" ", "").startswith("torch>=")
        ),
        None,
    )
    try:
        installed = metadata.version("torch")
    except metadata.PackageNotFoundError:
        installed = None
    if floor is None or installed is None:
        return  # a source checkout without metadata; an import error will say it
    if _release(installed) < _release(floor):
        click.echo(
            f"error: digen needs torch {floor} or newer (FSDP2's sum reduction and the Hugging "
            f"Face checkpoint reader and writer), but torch {installed} is installed; install "
            f"a newer one first (pip install 'torch>={floor}').",
            err=True,
        )
        sys.exit(2)


def _requires(package: str) -> list[str]:
    from importlib import metadata

    try:
        return metadata.requires(package) or []
    except metadata.PackageNotFoundError:
        return []


def _release(version: str) -> tuple[int, ...]:
    """``2.13.0+cpu`` -> ``(2, 13, 0)``."""
    parts = []
    for part in version.split("+")[0].split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


@main.command(context_settings={"ignore_unknown_options": False})
@click.option("--model", help=f"{_or(MODEL_NAMES)} [default: flux]; see `digen models`.")
@click.option("--algo", help=f"{_or(ALGO_NAMES)} [default: flowgrpo]; see `digen algos`.")
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A YAML config file.",
)
@click.option(
    "--model-path",
    type=click.Path(path_type=Path),
    help="Local diffusers model directory (default: the model's --flavour).",
)
@click.option(
    "--flavour",
    help="Weights without --model-path (model.flavour): tiny, medium or shapes (flux's and "
    "sd3's pretrained shapes-world models, 32 px) [default: shapes for flux, else tiny; tiny "
    "with --config].",
)
@click.option(
    "--mode",
    type=click.Choice(["colocated", "disaggregated", "auto"]),
    help="colocated (one pool alternates), disaggregated (generator + trainer pools), or "
    "auto (time the tasks, then run the layout the planner predicts fastest) [default: "
    "colocated].",
)
@click.option(
    "--devices",
    type=int,
    help="With --mode auto: devices to lay out [default: the visible GPUs with "
    "model.device=cuda, else the CPU cores over runtime.threads_per_worker].",
)
@click.option("--steps", type=int, help="Training steps.")
@click.option("--seed", type=int, help="Run seed.")
@click.option(
    "--prompts",
    type=click.Path(path_type=Path),
    help="Prompt file: .txt (one per line) or .jsonl; or a shipped set: default, ocr, shapes, shapes-heldout.",
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
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Continue the run in this directory from its newest checkpoint (--steps is the "
    "total; its config is used, with any overrides).",
)
@click.option("--overwrite", is_flag=True, help="Replace a previous run in --out.")
@click.option("--quiet", is_flag=True, help="No progress bar; print only the final summary.")
@click.option(
    "--launcher",
    type=click.Choice(["auto", "local", "torchrun"]),
    default="auto",
    show_default=True,
    help="local: this process spawns the workers; torchrun: every rank runs this command "
    "(rank 0 the driver); auto: torchrun when RANK and WORLD_SIZE are set.",
)
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.argument("overrides", nargs=-1)
def run(
    model: str | None,
    algo: str | None,
    config_path: Path | None,
    model_path: Path | None,
    flavour: str | None,
    mode: str | None,
    devices: int | None,
    steps: int | None,
    seed: int | None,
    prompts: Path | None,
    out_dir: Path,
    sample_every: int,
    resume_dir: Path | None,
    overwrite: bool,
    quiet: bool,
    launcher: str,
    debug: bool,
    overrides: tuple[str, ...],
) -> None:
    """Train a policy with RL. OVERRIDES are dotted key=value settings, e.g. rollout.n=8.

    Exit codes: 0 done, 1 a failure (a worker died, ...), 2 bad input, 130 / 143 stopped by
    SIGINT / SIGTERM at the next micro-batch boundary (with a checkpoint to --resume from).
    """
    _quiet_imports()
    if flavour is not None:  # an override like any other, so a later one still wins
        overrides = (f"model.flavour={flavour}", *overrides)
    if resume_dir is not None:
        out_dir = resume_dir
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
            launcher,
            resume=resume_dir is not None,
            overwrite=overwrite,
            devices=devices,
        )
    except KeyboardInterrupt:
        click.echo("interrupted; outputs written so far are in place.", err=True)
        sys.exit(130)
    except Exception as exc:  # one sentence for the user's mistakes, tracebacks for ours
        from digen.errors import DigenError

        if debug:
            raise
        actors = sys.modules.get(
            "digen.runtime.transport.actors"
        )  # a worker can only die once imported
        if actors is not None and isinstance(exc, actors.WorkerDied):  # nothing to debug here
            click.echo(f"error: {exc} {_after_failure(out_dir)}", err=True)
            sys.exit(1)
        if not isinstance(exc, DigenError):
            # one line here; the whole traceback (a worker's too) is in trainer.log
            log = out_dir / "trainer.log"
            where = f"; the traceback is in {log}" if log.is_file() else ""
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            click.echo(
                f"error: {type(exc).__name__}: {first}{where}. {_after_failure(out_dir)} "
                "(--debug shows the traceback here)",
                err=True,
            )
            sys.exit(1)
        from digen.errors import NonFiniteError, RewardError

        # a reward hook or a value that failed mid-run: what the run left, as for a crash
        ran = isinstance(exc, (RewardError, NonFiniteError)) and (out_dir / "checkpoints").is_dir()
        click.echo(f"error: {exc}" + (f" {_after_failure(out_dir)}" if ran else ""), err=True)
        sys.exit(1 if isinstance(exc, NonFiniteError) else 2)  # a failure, not bad input
    if result is None:  # a torchrun worker rank: it served until the driver stopped it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skips an interpreter teardown that can trip over RPC's native threads
    last = result.metrics[-1] if result.metrics else {}
    summary = {
        "out_dir": str(result.out_dir),
        "steps": result.first_step + len(result.metrics),
        "interrupted": result.interrupted,
        "reward_mean_first": result.metrics[0]["reward_mean"] if result.metrics else None,
        "reward_mean_last": last.get("reward_mean"),
        "weights": str(result.weights) if result.weights else None,
        "checkpoint": str(result.checkpoint) if result.checkpoint else None,
        "peak_memory_gb": round(result.peak_memory_gb, 3),
    }
    if result.evals:  # held-out accuracy where the prompts have one, else the reward
        key = "accuracy" if "eval/accuracy" in result.evals[0] else "reward_mean"
        summary[f"eval_{key}_first"] = result.evals[0][f"eval/{key}"]
        summary[f"eval_{key}_last"] = result.evals[-1][f"eval/{key}"]
    click.echo(json.dumps(summary) if quiet else _pretty(summary))
    if result.interrupted:
        click.echo(f"stopped early; continue with: digen run --resume {out_dir}", err=True)
        sys.stdout.flush()
        sys.exit(143 if result.stop_signal == "SIGTERM" else 130)


def _after_failure(out_dir: Path) -> str:
    """What a failed run left, and the command that continues it."""
    from digen.checkpoint import latest_checkpoint

    ckpt = latest_checkpoint(out_dir, checksums=False)  # sizes only: a large one hashes slowly
    if ckpt is None:
        return f"No checkpoint was written yet; outputs so far are in {out_dir}."
    return (
        f"The last checkpoint is {ckpt.path.name} ({ckpt.step} steps); continue with: "
        f"digen run --resume {out_dir}"
    )


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
    launcher="local",
    resume=False,
    overwrite=False,
    devices=None,
):
    from digen.config import load_config
    from digen.errors import DigenError

    auto = mode == "auto"
    if auto and resume:
        raise DigenError(
            "--mode auto chooses a new run's layout; a resumed run keeps the one its "
            "config.yaml records (leave --mode out)."
        )
    if devices is not None and not auto:
        raise DigenError(
            "--devices is the number of devices --mode auto lays out; add --mode auto."
        )
    if devices is not None and devices < 2:
        raise DigenError(f"--devices = {devices} is not allowed: it must be at least 2.")
    if auto:
        mode = "colocated"  # the preset's layer; the probe and the plan choose the layout

    if resume and not (out_dir / "config.yaml").is_file():
        raise DigenError(f"'{out_dir}' holds no run to resume (it has no config.yaml).")
    if resume and config_path is not None:
        raise DigenError(
            "--resume continues a run with its own config.yaml, so --config cannot be given "
            "with it (--steps and overrides can)."
        )

    if model_path is not None and not model_path.exists():
        raise DigenError(f"--model-path '{model_path}' does not exist.")
    cli: dict[str, Any] = {}
    if model_path is not None:
        cli.setdefault("model", {})["path"] = str(model_path)
    if steps is not None:
        cli["steps"] = steps
    if seed is not None:
        cli["seed"] = seed
    if prompts is not None:
        cli.setdefault("data", {})["prompts"] = str(prompts)
    if resume:
        cfg = load_config(out_dir / "config.yaml", overrides, base=cli, preset=False)
        given = {
            "--model": (model, cfg.model.name),
            "--algo": (algo, cfg.algo.name),
            "--mode": (mode, cfg.runtime.mode),
        }
        differ = [
            f"{k} {v} (the run's is {own})" for k, (v, own) in given.items() if v and v != own
        ]
        if differ:
            raise DigenError(
                f"--resume continues the run in '{out_dir}' as it was configured, and this "
                f"differs from it: {', '.join(differ)}."
            )
        code = [r.name for r in cfg.rewards if ":" in r.name]  # file.py:fn, module:fn
        if code:
            click.echo(
                f"note: resuming loads the reward hooks its config names, running their code "
                f"in this run's processes: {', '.join(code)}.",
                err=True,
            )
    else:
        flavour = _run_flavour(model, model_path, config_path, prompts, overrides)
        if flavour is not None:  # first, so the user's own overrides still win
            overrides = (f"model.flavour={flavour}", *overrides)
        cfg = load_config(
            config_path, overrides, base=cli, model=model, algo=algo, mode=mode, preset=True
        )
    from digen.prompts import PromptSet

    PromptSet.load(cfg.data.prompts)  # a bad prompt file is reported before torch loads
    if cfg.runtime.join_secret_file is not None:  # unreadable or short: said before torch loads
        from digen.runtime.transport.join_secret import read_secret

        try:
            read_secret(cfg.runtime.join_secret_file, "runtime.join_secret_file")
        except ValueError as exc:
            raise DigenError(str(exc)) from None
    if cfg.model.path is not None:
        from digen.models.checks import check_model_dir

        check_model_dir(cfg.model.path, cfg.model.name)
    from digen.runtime.transport.torchrun import under_torchrun

    if launcher == "torchrun" or (launcher == "auto" and under_torchrun(os.environ)):
        if auto:
            raise DigenError(
                "--mode auto starts its own workers; under torchrun give the layout "
                "(--mode colocated or disaggregated)."
            )
        return _run_torchrun(cfg, out_dir, quiet, sample_every)
    from digen.checkpoint import check_out_dir

    # a previous run in --out, or a checkpoint of other weights: said before torch loads
    check_out_dir(out_dir, cfg, resume=resume, overwrite=overwrite, checksums=False)
    if cfg.runtime.mode == "disaggregated" or auto:
        from digen.runtime.transport.forkserver import start_fork_server

        start_fork_server()  # the workers' imports, beside the driver's below
    _quiet_progress_bars()  # imports diffusers: only once the config is good
    from digen.run.runner import DigenRunner

    record = None
    if auto:
        from digen.run.auto import choose_layout

        choice = _run_async(choose_layout(cfg, devices=devices, progress=not quiet))
        cfg, record = choice.cfg, choice.record
        click.echo(f"mode auto: {choice.line}", err=True)

    runner = DigenRunner(
        cfg,
        out_dir=out_dir,
        progress=not quiet,
        sample_every=sample_every,
        resume=resume,
        overwrite=overwrite,
        plan=record,
    )
    return _run_async(runner.run())


# --- torchrun: one command on every rank ------------------------------------------------


def _run_torchrun(cfg, out_dir, quiet, sample_every):
    """Rank 0: the usual driver, joining workers torchrun started. Others: serve as one."""
    from digen.run.runner import DigenRunner
    from digen.runtime.transport.actors import (
        ExternalLaunch,
        WorkerSpec,
        external_launch,
        serve_worker,
    )
    from digen.runtime.transport.torchrun import role_for_rank, torchrun_world

    rank, world, address, port = torchrun_world(os.environ, cfg)
    rt = cfg.runtime
    if rank == 0:
        runner = DigenRunner(cfg, out_dir=out_dir, progress=not quiet, sample_every=sample_every)
        with external_launch(ExternalLaunch(address, port, world)):
            return _run_async(runner.run())
    spec = WorkerSpec(
        role_for_rank(rank, rt.generators, rt.trainers), threads=rt.threads_per_worker
    )
    serve_worker(spec, rank, world, address, port, rpc_timeout_s=rt.rpc_timeout_s)
    return None


def _run_flavour(model, model_path, config_path, prompts, overrides) -> str | None:
    """The flavour a ``digen run`` that names no weights trains (the backbone's
    ``run_flavour``: flux's pretrained shapes model), or None when the user named weights
    (``--model-path``, ``--flavour``, ``model.path=`` / ``model.flavour=``), prompts other
    than the shapes world's (``--prompts``, ``data.prompts=``: the shapes model draws only
    its world) or a config file, which then decide."""
    given = dict(o.split("=", 1) for o in overrides if "=" in o)
    given = {k.strip(): v.strip() for k, v in given.items()}
    if (model_path, config_path) != (None, None) or {"model.path", "model.flavour"} & given.keys():
        return None
    own = [str(p) for p in (prompts, given.get("data.prompts")) if p is not None]
    if any(p not in ("shapes", "shapes-heldout") for p in own):
        return None
    from digen.models.registry import get_backbone

    flavour = get_backbone(model or given.get("model.name", "flux")).run_flavour
    return None if flavour == "tiny" else flavour


def _run_async(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux / macOS
        return asyncio.run(coro)
    return uvloop.run(coro)  # an ImportError raised by the run itself is the run's error


def _pretty(summary: dict[str, Any]) -> str:
    width = max(map(len, summary), default=0)
    return "\n".join(f"{k:>{width}}: {v}" for k, v in summary.items())


@main.command()
def algos() -> None:
    """The registered algorithms: their step kinds, KL convention and own settings."""
    for name in ALGO_NAMES:
        algo = get_algorithm(name)
        click.echo(f"{name}: {algo.title}")
        click.echo(f"  rollout.sde_type: {', '.join(algo.sde_types)} (default {algo.sde_types[0]})")
        click.echo(f"  algo.kl_type default: {algo.kl_type}")
        for key, param in algo.params.items():
            click.echo(f"  algo.params.{key} = {param.default!r}: {param.doc}")


@main.command()
def models() -> None:
    """The registered backbones and the sampling size of their published recipes."""
    for name, b in BACKBONES.items():
        r = b.recipe
        size = f"{r['width']}x{r['height']}" + (f" x {r['num_frames']} frames" if b.video else "")
        click.echo(f"{name}: {'video' if b.video else 'image'}, {size}, CFG {r['guidance_scale']}")


@main.command()
@click.option(
    "--microbatches",
    "-b",
    type=int,
    default=32,
    show_default=True,
    help="Micro-batches per train step.",
)
@click.option(
    "--generators", "-g", type=int, default=4, show_default=True, help="Generator workers."
)
@click.option("--trainers", "-t", type=int, default=4, show_default=True, help="Trainer workers.")
@click.option(
    "--profile",
    "profile_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Costs from a run's profile.json (overrides the cost flags).",
)
@click.option(
    "--gen",
    type=float,
    default=1.0,
    show_default=True,
    help="Seconds to generate a micro-batch on a generator.",
)
@click.option(
    "--update-gen-ratio",
    type=float,
    default=0.5,
    show_default=True,
    help="Update time as a multiple of --gen.",
)
@click.option(
    "--gen-tag", type=float, help="Seconds to generate on a trainer (TAG) [default: --gen]."
)
@click.option(
    "--score", type=float, default=0.02, show_default=True, help="Seconds to score a micro-batch."
)
@click.option(
    "--step-cost", type=float, default=0.0, show_default=True, help="Seconds of one optimizer step."
)
@click.option(
    "--sync-cost", type=float, default=0.0, show_default=True, help="Seconds of one weight sync."
)
@click.option("--steps", type=int, default=4, show_default=True, help="Train steps to simulate.")
@click.option("--static-k", type=int, help="k of the static-k policy [default: --trainers].")
@click.option(
    "--mbs-per-group", type=int, default=1, show_default=True, help="Micro-batches per group (GAP)."
)
@click.option(
    "--max-staleness", type=int, default=1, show_default=True, help="TCSS W for the +tcss rows."
)
@click.option(
    "--staleness-ratio",
    type=float,
    default=0.25,
    show_default=True,
    help="TCSS ratio for the +tcss rows.",
)
@click.option(
    "--recommend",
    is_flag=True,
    help="Rank colocated and every generator/trainer split of --devices, by time and cost.",
)
@click.option("--devices", type=int, help="Devices to lay out (with --recommend).")
@click.option(
    "--hardware",
    "hardware_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --recommend: a YAML/JSON description of the devices (kinds, memory, links, "
    "prices; see docs/RUNTIME.md), to add the GPU costs of each layout.",
)
@click.option(
    "--device",
    "device_kind",
    help="With --recommend: every device of this kind (h100, h200, a100, a100-40gb, l40s, "
    "l4), with its spec-sheet defaults.",
)
@click.option(
    "--model",
    "model_name",
    type=click.Choice(MODEL_NAMES),
    help="With --hardware/--device: the backbone whose published sizes are moved and stored.",
)
@click.option(
    "--lora-rank",
    type=int,
    default=8,
    show_default=True,
    help="With --model: the LoRA rank trained (0: full fine-tuning).",
)
@click.option(
    "--reward-params",
    type=float,
    default=0.0,
    show_default=True,
    help="With --model: parameters of a reward model that sits beside the sampler.",
)
@click.option(
    "--sampling-passes",
    type=int,
    default=10,
    show_default=True,
    help="With --model: denoiser passes to sample one micro-batch (sampling steps).",
)
@click.option(
    "--update-tsp",
    type=float,
    help="With --recommend: seconds of an update with TSP, to rank layouts with and without.",
)
@click.option(
    "--tsp-degree", type=int, default=4, show_default=True, help="The TSP degree of --update-tsp."
)
@click.option(
    "--samples-per-microbatch",
    type=int,
    default=1,
    show_default=True,
    help="With --recommend: samples in one micro-batch (for the cost per 1,000 samples).",
)
@click.option(
    "--by",
    type=click.Choice(["time", "cost"]),
    default="time",
    show_default=True,
    help="With --recommend: rank by step time or by cost per 1,000 samples.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw the BTS schedule to this PNG.",
)
@click.option(
    "--score-overlap/--no-score-overlap",
    default=True,
    show_default=True,
    help="Score beside generation on a lane per generator, as runs do by default.",
)
@click.option(
    "--loss-rate",
    type=float,
    help="Losses of each generator per hour (preemptions): price generators that come and go.",
)
@click.option(
    "--rejoin-s",
    type=float,
    default=300.0,
    show_default=True,
    help="With --loss-rate: seconds until a lost generator is back, on average.",
)
@click.option(
    "--generator-price", type=float, default=0.0, show_default=True, help="Per device-hour."
)
@click.option(
    "--preemptible-price",
    type=float,
    help="Per device-hour of a generator that comes and goes [default: --generator-price].",
)
@click.option(
    "--trainer-price", type=float, default=0.0, show_default=True, help="Per device-hour."
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--quiet", is_flag=True, help="No progress lines on stderr (--recommend).")
def simulate(
    microbatches: int,
    generators: int,
    trainers: int,
    profile_path: Path | None,
    gen: float,
    update_gen_ratio: float,
    gen_tag: float | None,
    score: float,
    step_cost: float,
    sync_cost: float,
    steps: int,
    static_k: int | None,
    mbs_per_group: int,
    max_staleness: int,
    staleness_ratio: float,
    recommend: bool,
    devices: int | None,
    hardware_path: Path | None,
    device_kind: str | None,
    model_name: str | None,
    lora_rank: int,
    reward_params: float,
    sampling_passes: int,
    update_tsp: float | None,
    tsp_degree: int,
    samples_per_microbatch: int,
    by: str,
    plot_path: Path | None,
    score_overlap: bool,
    loss_rate: float | None,
    rejoin_s: float,
    generator_price: float,
    preemptible_price: float | None,
    trainer_price: float,
    as_json: bool,
    quiet: bool,
) -> None:
    """Predict step times of TAG / TCSS policies (none, static-k, BTS) before renting a cluster.

    Costs come from the flags (seconds per micro-batch) or from a run's profile.json.
    """
    from digen.sched import simulate_cli as sc

    try:
        if profile_path is not None:
            if not profile_path.is_file():
                raise ValueError(f"profile file '{profile_path}' does not exist")
            costs = sc.load_costs(profile_path)
        else:
            from digen.sched.costs import Costs

            costs = Costs(
                gen=gen,
                update=gen * update_gen_ratio,
                gen_tag=gen_tag,
                score=score,
                step=step_cost,
                sync=sync_cost,
            )
        for name, value, low in (
            ("--microbatches", microbatches, 1),
            ("--generators", generators, 1),
            ("--trainers", trainers, 1),
            ("--steps", steps, 1),
            ("--mbs-per-group", mbs_per_group, 1),
            ("--max-staleness", max_staleness, 0),
        ):
            if value < low:
                raise ValueError(f"{name} = {value} is not allowed: it must be at least {low}")
        kw = dict(
            steps=steps,
            static_k=static_k,
            mbs_per_group=mbs_per_group,
            max_staleness=max_staleness,
            staleness_ratio=staleness_ratio,
            score_overlap=score_overlap,
        )
        if loss_rate is not None:
            got = sc.with_losses(
                costs,
                microbatches,
                generators,
                trainers,
                loss_rate_per_h=loss_rate,
                rejoin_s=rejoin_s,
                generator_price=generator_price,
                trainer_price=trainer_price,
                preemptible_price=preemptible_price,
                steps=steps,
                mbs_per_group=mbs_per_group,
                score_overlap=score_overlap,
            )
            if as_json:
                click.echo(json.dumps(got))
                return
            click.echo(sc.format_losses(got, generators, trainers, loss_rate, rejoin_s))
            return
        if recommend:
            _recommend(
                costs,
                microbatches,
                devices,
                hardware=hardware_path if device_kind is None else {"device": device_kind},
                model_name=model_name,
                lora_rank=lora_rank,
                reward_params=reward_params,
                passes=sampling_passes,
                update_tsp=update_tsp,
                tsp_degree=tsp_degree,
                samples=samples_per_microbatch,
                by=by,
                prices=(generator_price, trainer_price),
                as_json=as_json,
                quiet=quiet,
                kw=kw,
            )
            return
        table = sc.compare_policies(costs, microbatches, generators, trainers, **kw)
        if plot_path is not None:
            from digen.sched.simulator import simulate as run_sim
            from digen.sched.tag import BTS

            res = run_sim(
                costs,
                microbatches,
                generators,
                trainers,
                BTS(),
                steps=steps,
                mbs_per_group=mbs_per_group,
                score_overlap=score_overlap,
            )
            sc.plot_simulation(
                res, plot_path, title=f"simulated BTS: G={generators} T={trainers} B={microbatches}"
            )
    except ValueError as exc:
        click.echo(f"error: {str(exc).rstrip('.')}.", err=True)
        sys.exit(2)
    if as_json:
        click.echo(json.dumps(table))
    else:
        click.echo(sc.format_table(table))


@main.command()
@click.argument("rendezvous", metavar="ADDRESS:PORT")
@click.option(
    "--secret-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The run's join secret, in a file (the run writes it to OUT/join-secret)  "
    "[default: the environment variable DIGEN_JOIN_SECRET]",
)
@click.option(
    "--threads",
    type=int,
    default=None,
    help="CPU threads of this generator  [default: the run's runtime.threads_per_worker]",
)
@click.option(
    "--device",
    default=None,
    help="Device of this generator on this machine (cuda:1, cpu): give each joiner of one "
    "machine its own GPU  [default: the device of its join number in the run's "
    "runtime.generator_devices]",
)
@click.option(
    "--wait",
    "wait_s",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds to wait for the run to be there and take joins.",
)
def join(
    rendezvous: str,
    secret_file: Path | None,
    threads: int | None,
    device: str | None,
    wait_s: float,
) -> None:
    """Join a running run as one more generator, until it ends.

    The run must have been started with runtime.accept_generators=true; ADDRESS:PORT is
    its rendezvous, printed when it starts and kept in its workers.json (set
    runtime.address to an address this machine reaches, and runtime.port to fix the port).
    This process proves that it knows the run's join secret (--secret-file, or the
    environment variable DIGEN_JOIN_SECRET), and joins only a run that proves it knows it
    too. It joins at the run's next step boundary with that step's weights. Ctrl-C or
    SIGTERM ends it, and the run goes on without it, making its work again elsewhere.
    The run and this process can run code in each other: join only runs you trust, from
    machines you control, on a private network.
    """
    from digen.runtime.transport.join_secret import SECRET_ENV, check_secret, read_secret

    host, _, port_text = rendezvous.rpartition(":")
    host = host.strip("[]")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        click.echo(
            f"error: {rendezvous!r} is not ADDRESS:PORT (e.g. 10.0.0.5:29400): the run's "
            "rendezvous, in its workers.json.",
            err=True,
        )
        sys.exit(2)
    if threads is not None and threads < 1:
        click.echo(f"error: --threads must be at least 1, not {threads}.", err=True)
        sys.exit(2)
    if device is not None:
        import re

        if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", device):
            click.echo(
                f"error: --device {device!r} is not a device: cpu, cuda or cuda:N.", err=True
            )
            sys.exit(2)
        from digen.runtime.placement import DEVICE_ENV

        os.environ[DEVICE_ENV] = device  # the joiner's actors read it (their own process)
    try:
        if secret_file is not None:
            secret = read_secret(secret_file, "--secret-file")
        else:
            secret = os.environ.get(SECRET_ENV, "").strip()
            if not secret:
                raise ValueError(
                    "digen join needs the run's join secret: pass --secret-file FILE (the run "
                    f"writes it to its output directory as join-secret) or set {SECRET_ENV}."
                )
            check_secret(secret, SECRET_ENV)
    except ValueError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)

    from digen.runtime.transport.actors import JoinRefused, join_world

    def joined(name: str) -> None:
        click.echo(f"joined the run at {rendezvous} as {name}; serving until it ends", err=True)

    try:
        name = join_world(
            host, int(port_text), secret=secret, threads=threads, wait_s=wait_s, on_joined=joined
        )
    except JoinRefused as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    click.echo(f"{name}: the run ended", err=True)


@main.command("reward-server")
@click.option(
    "--reward", required=True, help="A built-in, module:function or path/to/file.py:function."
)
@click.option("--port", type=int, default=8000, show_default=True, help="Port; 0 picks a free one.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--options",
    "options_text",
    default=None,
    help="Keyword arguments for a reward that is a class, as YAML/JSON: '{model_dir: /m}'.",
)
@click.option(
    "--max-body-mib", type=int, default=256, show_default=True, help="Largest request body, MiB."
)
@click.option(
    "--max-samples", type=int, default=256, show_default=True, help="Most samples a request."
)
@click.option(
    "--max-frames", type=int, default=256, show_default=True, help="Most frames a sample."
)
@click.option(
    "--max-pixels",
    type=int,
    default=1 << 26,
    show_default=True,
    help="Most pixels a request (samples x frames x height x width), checked before decoding.",
)
@click.option(
    "--max-concurrent",
    type=int,
    default=4,
    show_default=True,
    help="Requests read, decoded and scored at once.",
)
@click.option(
    "--max-queued",
    type=int,
    default=64,
    show_default=True,
    help="Requests waiting for a slot; one more is answered 429.",
)
@click.option(
    "--read-timeout-s",
    type=int,
    default=60,
    show_default=True,
    help="Seconds a request may take to arrive (headers, then body); a slower client is dropped.",
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A bearer token POST /score must carry, in a file  [default: the environment "
    "variable DIGEN_REWARD_TOKEN, else none]",
)
@click.option(
    "--debug",
    is_flag=True,
    help="Send a failing reward's error text to the client, not only the log.",
)
def reward_server(
    reward: str,
    port: int,
    host: str,
    options_text: str | None,
    token_file: Path | None,
    debug: bool,
    **limits: int,
) -> None:
    """Serve a reward over HTTP (POST /score, GET /health); see docs/REWARD_SERVER.md."""
    import logging

    import yaml

    from digen.errors import DigenError
    from digen.rewards.server import TOKEN_ENV, ServerLimits, check_token, serve

    try:
        options = yaml.safe_load(options_text) if options_text else {}
    except yaml.YAMLError:
        options = None
    if not isinstance(options, dict):
        click.echo(
            f"error: --options must be a mapping such as '{{size: 2}}', not {options_text!r}.",
            err=True,
        )
        sys.exit(2)

    token = os.environ.get(TOKEN_ENV, "").strip() or None
    where = f"the environment variable {TOKEN_ENV}"
    try:
        if token_file is not None:
            where = f"--token-file {str(token_file)!r}"
            token = token_file.read_text(encoding="utf-8").strip()
        if token is not None:
            check_token(token, where)
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        click.echo(f"error: {where} cannot be read: {why.lower()}.", err=True)
        sys.exit(2)
    except DigenError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)

    def ready(url: str) -> None:
        guard = "; POST /score needs the bearer token" if token else ""
        click.echo(f"serving reward {reward!r} on {url} (GET /health){guard}; Ctrl-C stops it")

    # The server's log (a failing reward's traceback, undecodable requests) goes to stderr.
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("digen.rewards.server").addHandler(handler)
    try:
        asyncio.run(serve(reward, host, port, ready, options, ServerLimits(**limits), debug, token))
    except DigenError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)


@main.command()
@click.option(
    "--quick", is_flag=True, help="A few minutes on a 2-core laptop: 64 px, 4 steps, 1 repeat."
)
@click.option("--model", default="flux", show_default=True, help=f"{_or(MODEL_NAMES)}.")
@click.option("--algo", default="flowgrpo", show_default=True, help=f"{_or(ALGO_NAMES)}.")
@click.option("--size", type=int, help="Image height and width in px [default: 128; --quick 64].")
@click.option(
    "--steps", type=int, help="Train steps a run; the first is warm-up [default: 8; --quick 4]."
)
@click.option(
    "--repeats", type=int, help="Runs of every rung, interleaved [default: 3; --quick 1]."
)
@click.option(
    "--workers",
    type=int,
    default=2,
    show_default=True,
    help="Worker processes in every rung (disaggregated: generators + trainers).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the results as JSON to this file.",
)
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw every rung's timeline and the speed-ups to this PNG.",
)
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keep the runs' directories here [default: a temporary directory, removed].",
)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr.")
@click.option("--debug", is_flag=True, help="Show tracebacks on errors.")
@click.option(
    "--quality",
    is_flag=True,
    help="Race time to a held-out quality on the shapes task instead: colocated, "
    "disaggregated, + TCSS and every algorithm, over several seeds.",
)
@click.option(
    "--seeds", default="0,1,2", show_default=True, help="--quality: seeds, comma-separated."
)
@click.option(
    "--target", type=float, default=0.5, show_default=True, help="--quality: the quality to reach."
)
@click.option(
    "--eval-every",
    type=int,
    default=5,
    show_default=True,
    help="--quality: steps between evaluations.",
)
@click.option(
    "--flavour",
    default="shapes",
    show_default=True,
    help="--quality: the weights every arm starts from.",
)
@click.argument("overrides", nargs=-1)
def bench(
    quick: bool,
    model: str,
    algo: str,
    size: int | None,
    steps: int | None,
    repeats: int | None,
    workers: int,
    json_path: Path | None,
    plot_path: Path | None,
    out_dir: Path | None,
    quiet: bool,
    debug: bool,
    quality: bool,
    seeds: str,
    target: float,
    eval_every: int,
    flavour: str,
    overrides: tuple[str, ...],
) -> None:
    """Measure the ablation ladder on this machine: colocated (the best of the colocated
    configurations), naive disaggregated, + pipelining, + GAP, + TSP, + TAG, + TCSS.

    Every rung trains the same model, algorithm, batch and seed on the same worker processes;
    repetitions are interleaved. OVERRIDES (key=value) apply to every rung.

    With --quality: train the shapes task to a held-out accuracy instead, in every mode and
    with every algorithm, and report time and steps to --target (docs/BENCHMARKS.md).
    """
    _quiet_imports()
    from digen.errors import DigenError

    if quality:
        _bench_quality(**{k: v for k, v in locals().items() if k in _QUALITY_OPTIONS})
        return

    try:
        settings = _bench_settings(
            quick, model, algo, size, steps, repeats, workers, json_path, plot_path, overrides
        )
        from digen.run import bench as b

        b.rung_configs(settings)  # a setting no rung allows fails here, before any run
    except DigenError as exc:
        click.echo(f"error: {str(exc).rstrip('.')}.", err=True)
        sys.exit(2)
    _quiet_progress_bars()

    def say(text: str) -> None:
        if not quiet:
            click.echo(f"bench: {text}", err=True)

    rungs = len(b.colocated_variants(settings)) + len(b.ladder(settings))
    say(
        f"{settings.model} / {settings.algo}, {settings.size} px, {settings.steps} steps, "
        f"{rungs} runs x {settings.repeats} repeats on {settings.workers} workers"
    )
    runs = _measuring(lambda: b.run_bench(settings, out_dir=out_dir, progress=say), debug)
    command = (
        f"digen bench --model {settings.model} --algo {settings.algo} --size {settings.size} "
        f"--steps {settings.steps} --repeats {settings.repeats} --workers {settings.workers}"
    )
    command = " ".join([command, *(shlex.quote(o) for o in overrides)])
    report = b.summarise(settings, runs, command=command)
    click.echo(b.format_table(report))
    _write_report(report, json_path, plot_path, lambda path: b.plot_bench(report, runs, path), say)


_QUALITY_OPTIONS = [
    "model",
    "algo",
    "steps",
    "workers",
    "json_path",
    "plot_path",
    "out_dir",
    "quiet",
    "debug",
    "seeds",
    "target",
    "eval_every",
    "flavour",
    "overrides",
]
"""The options of ``digen bench`` that ``--quality`` reads."""


def _bench_quality(
    *,
    model: str,
    algo: str,
    steps: int | None,
    workers: int,
    json_path: Path | None,
    plot_path: Path | None,
    out_dir: Path | None,
    quiet: bool,
    debug: bool,
    seeds: str,
    target: float,
    eval_every: int,
    flavour: str,
    overrides: tuple[str, ...],
) -> None:
    """``digen bench --quality`` (:mod:`digen.run.quality`)."""
    import shutil
    import tempfile

    from digen.errors import DigenError
    from digen.run import quality as q

    try:
        if model not in MODEL_NAMES:
            raise DigenError(f"--model {model!r} is not a model; choose {_or(MODEL_NAMES)}")
        if algo not in ALGO_NAMES:
            raise DigenError(f"--algo {algo!r} is not an algorithm; choose {_or(ALGO_NAMES)}")
        try:
            seed_list = tuple(int(x) for x in seeds.split(",") if x.strip())
        except ValueError:
            raise DigenError(f"--seeds {seeds!r} must be integers separated by commas") from None
        if not seed_list:
            raise DigenError("--seeds must name at least one seed")
        if steps is not None and steps < 1:
            raise DigenError(f"--steps {steps} is not allowed: it must be at least 1")
        if eval_every < 1:
            raise DigenError(f"--eval-every {eval_every} is not allowed: it must be at least 1")
        for flag, path in (("--json", json_path), ("--plot", plot_path)):
            if path is not None and not path.parent.is_dir():
                raise DigenError(f"{flag} {path}: the directory '{path.parent}' does not exist")
        settings = q.QualitySettings(
            model=model,
            flavour=flavour,
            algos=(algo, *(a for a in ALGO_NAMES if a != algo)),
            steps=steps or 30,
            seeds=seed_list,
            eval_every=eval_every,
            target=target,
            workers=workers,
            overrides=tuple(overrides),
        )
        for arm in q.arms(settings):  # a setting no arm allows fails here, before any run
            q.arm_config(settings, arm, seed_list[0])
    except DigenError as exc:
        click.echo(f"error: {str(exc).rstrip('.')}.", err=True)
        sys.exit(2)
    _quiet_progress_bars()

    def say(text: str) -> None:
        if not quiet:
            click.echo(f"bench: {text}", err=True)

    root = out_dir or Path(tempfile.mkdtemp(prefix="digen-quality-"))
    try:
        curves = _measuring(lambda: q.run_quality(settings, root, progress=say), debug)
    finally:
        if out_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    command = (
        f"digen bench --quality --model {model} --algo {algo} --steps {settings.steps} "
        f"--seeds {seeds} --target {target} --eval-every {eval_every} --flavour {flavour}"
    )
    command = " ".join([command, *(shlex.quote(o) for o in overrides)])
    report = q.summarise_quality(settings, curves, command=command)
    click.echo(q.format_quality(report))
    _write_report(report, json_path, plot_path, lambda path: q.plot_quality(report, path), say)


def _measuring(measure: Callable[[], Any], debug: bool) -> Any:
    """``measure()``, with Ctrl-C and a failure each one line and an exit code."""
    try:
        return measure()
    except KeyboardInterrupt:
        click.echo("interrupted.", err=True)
        sys.exit(130)
    except Exception as exc:
        if debug:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        click.echo(f"error: {type(exc).__name__}: {first} (--debug shows the traceback)", err=True)
        sys.exit(1)


def _write_report(
    report: dict[str, Any],
    json_path: Path | None,
    plot_path: Path | None,
    plot: Callable[[Path], None],
    say: Callable[[str], None],
) -> None:
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        say(f"wrote {json_path}")
    if plot_path is not None:
        plot(plot_path)
        say(f"wrote {plot_path}")


def _bench_settings(
    quick, model, algo, size, steps, repeats, workers, json_path, plot_path, overrides
):
    """The bench's settings from its options, or one sentence (DigenError) on bad input."""
    from digen.errors import DigenError
    from digen.run.bench import QUICK, BenchSettings

    if model not in MODEL_NAMES:
        raise DigenError(f"--model {model!r} is not a model; choose {_or(MODEL_NAMES)}")
    if algo not in ALGO_NAMES:
        raise DigenError(f"--algo {algo!r} is not an algorithm; choose {_or(ALGO_NAMES)}")
    base = dict(QUICK) if quick else {}
    given = {"size": size, "steps": steps, "repeats": repeats}
    values = {**base, **{k: v for k, v in given.items() if v is not None}}
    for name, low in (("size", 16), ("steps", 2), ("repeats", 1)):
        if name in values and values[name] < low:
            why = " (the first step is warm-up and not counted)" if name == "steps" else ""
            raise DigenError(
                f"--{name} {values[name]} is not allowed: it must be at least {low}{why}"
            )
    if values.get("size", 16) % 16:
        raise DigenError(f"--size {values['size']} is not allowed: it must be a multiple of 16")
    if workers < 2:
        raise DigenError(
            f"--workers {workers} is not allowed: disaggregation needs at least 2 "
            "(a generator and a trainer)"
        )
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None and not path.parent.is_dir():
            raise DigenError(f"{flag} {path}: the directory '{path.parent}' does not exist")
    if plot_path is not None and plot_path.suffix.lower() != ".png":
        raise DigenError(f"--plot {plot_path} must name a .png file")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return BenchSettings(
        model=model,
        algo=algo,
        workers=workers,
        cores=max(1, cores or 1),
        overrides=tuple(overrides),
        **values,
    )


def _recommend(
    costs: Any,
    microbatches: int,
    devices: int | None,
    *,
    hardware: Path | dict[str, str] | None,
    model_name: str | None,
    lora_rank: int,
    reward_params: float,
    passes: int,
    update_tsp: float | None,
    tsp_degree: int,
    samples: int,
    by: str,
    prices: tuple[float, float],
    as_json: bool,
    quiet: bool,
    kw: dict[str, Any],
) -> None:
    """``simulate --recommend``: every layout ranked, with its GPU terms when hardware is given."""
    from digen.sched import planner
    from digen.sched.hardware import ModelSize, describe, load_hardware

    hw = None
    if hardware is not None:
        if isinstance(hardware, Path) and not hardware.is_file():
            raise ValueError(f"hardware file '{hardware}' does not exist")
        hw = load_hardware(hardware)
        if model_name is None:
            raise ValueError("--hardware and --device need --model, whose sizes they move")
    elif model_name is not None:
        raise ValueError("--model needs --hardware or --device, the devices it runs on")
    if devices is None and (hw is None or hw.generators is None):
        raise ValueError("--recommend needs --devices N, the number of devices to lay out")
    for name, value in (("--sampling-passes", passes), ("--tsp-degree", tsp_degree)):
        if value < 1:
            raise ValueError(f"{name} = {value} is not allowed: it must be at least 1")
    if lora_rank < 0:
        raise ValueError(f"--lora-rank = {lora_rank} is not allowed: it must be at least 0")
    model = None
    if model_name is not None:
        model = ModelSize.of(model_name, lora_rank=lora_rank, reward_params=reward_params)
    work = planner.Workload(
        costs=costs,
        microbatches=microbatches,
        samples_per_microbatch=samples,
        mbs_per_group=kw["mbs_per_group"],
        update_tsp=update_tsp,
        tsp_degree=tsp_degree,
        passes=passes,
        model=model,
    )
    n = hw.generators + hw.trainers if hw is not None and hw.generators else devices
    if not quiet and n and n >= 2:
        where = f" ({describe(hw)})" if hw is not None else ""
        click.echo(f"simulating colocated and the splits of {n} devices{where}", err=True)
    ranked, skipped = planner.plan(
        work,
        devices,
        hw,
        steps=kw["steps"],
        static_k=kw["static_k"],
        max_staleness=kw["max_staleness"],
        staleness_ratio=kw["staleness_ratio"],
        score_overlap=kw["score_overlap"],
        prices=prices,
        on_split=None if quiet else _split_done(),
    )
    if by == "cost":
        ranked = planner.by_cost(ranked)
    if as_json:
        out = {
            "candidates": [c.to_dict() for c in ranked],
            "left_out": skipped,
            "choice": planner.explain(ranked),
        }
        click.echo(json.dumps(out))
        return
    if not ranked:
        raise ValueError("no layout fits: " + "; ".join(skipped))
    where = f" on {describe(hw)}" if hw is not None else ""
    click.echo(f"{n} devices{where}, {microbatches} micro-batches a step, best {by} first:")
    click.echo(planner.format_plan(ranked, skipped))
    click.echo(f"choice: {planner.explain(ranked)}")
    if ranked[0].terms:
        terms = ", ".join(f"{k} {v:.3f} s" for k, v in ranked[0].terms.items())
        click.echo(f"its GPU terms a step: {terms}")


def _split_done():
    """Progress of ``simulate --recommend`` on stderr: one line per split as it is done."""
    last = time.perf_counter()

    def report(generators: int, trainers: int, done: list[Any]) -> None:
        nonlocal last
        now = time.perf_counter()
        best = min(done, key=lambda c: c.step_time)
        click.echo(
            f"G={generators} T={trainers}: best {best.label} at "
            f"{best.step_time:.3f} s a step ({now - last:.1f} s to simulate)",
            err=True,
        )
        last = now

    return report


def entry() -> None:
    """The ``digen`` program: :func:`main`, then, with every output written, flushed and
    closed, an exit that skips the interpreter's teardown of torch and the model libraries
    (two to three seconds of nothing after a run)."""
    _open_closed_stdio()
    # a native crash (a segfault in a library's threads) then leaves every thread's Python
    # stack on stderr, not just an exit status
    with contextlib.suppress(Exception):  # a stderr with no file descriptor: no dump
        faulthandler.enable(all_threads=True)
    try:
        main()
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    forkserver = sys.modules.get("digen.runtime.transport.forkserver")
    if forkserver is not None:  # no process of the run outlives the command
        forkserver.stop_fork_server()
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _open_closed_stdio() -> None:
    """A program started with stdin, stdout or stderr closed (``>&-``) gets ``/dev/null``
    there, as daemons do: otherwise the first file or socket opened takes that number, and
    the event loop's library aborts when it closes a descriptor it takes for stdio."""
    for fd, mode in ((0, os.O_RDONLY), (1, os.O_WRONLY), (2, os.O_WRONLY)):
        try:
            os.fstat(fd)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, mode)
        if null != fd:
            os.dup2(null, fd)
            os.close(null)
        name = ("stdin", "stdout", "stderr")[fd]
        if getattr(sys, name) is None:  # Python leaves it None when the fd was closed
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))  # noqa: SIM115


if __name__ == "__main__":  # pragma: no cover
    entry()
