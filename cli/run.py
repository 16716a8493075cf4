"""``digen run``: train a policy with RL.

Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set, or ``--launcher torchrun``) every rank
runs the same command: rank 0 is the driver and writes the outputs, the others become the
workers named by :func:`~digen.runtime.transport.torchrun.role_for_rank` (docs/RUNTIME.md,
"Multi-node with torchrun").
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from cli._shared import (
    check_writable,
    one_of,
    pretty,
    quiet_imports,
    quiet_progress_bars,
    refuse,
    run_async,
    user_errors,
)
from digen.registry.algos import ALGO_NAMES
from digen.registry.models import MODEL_NAMES


@click.command(context_settings={"ignore_unknown_options": False})
@click.option("--model", help=f"{one_of(MODEL_NAMES)} [default: flux]; see `digen models`.")
@click.option("--algo", help=f"{one_of(ALGO_NAMES)} [default: flowgrpo]; see `digen algos`.")
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
    "model.device=cuda, else the CPU cores over runtime.placement.threads_per_worker].",
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
    default=None,
    help="Output directory  [default: a new runs/<date>_<time>, with runs/latest a link to it]",
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
@user_errors
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
    quiet_imports()
    if flavour is not None:  # an override like any other, so a later one still wins
        overrides = (f"model.flavour={flavour}", *overrides)
    if resume_dir is not None and overwrite:
        refuse("--resume continues the run in its folder and --overwrite replaces it; give one.")
    if sample_every < 1:
        refuse(f"--sample-every = {sample_every} is not allowed: it must be at least 1.")
    if resume_dir is not None and out_dir is not None and out_dir != resume_dir:
        refuse("--resume continues the run in the folder it names; leave --out out.")
    dated = resume_dir is None and out_dir is None
    if resume_dir is not None:
        out_dir = resume_dir
    elif out_dir is None:
        from digen.checkpoint import new_run_dir

        out_dir = new_run_dir()
    try:
        result = _run(
            RunRequest(
                model=model,
                algo=algo,
                config_path=config_path,
                model_path=model_path,
                mode=mode,
                devices=devices,
                steps=steps,
                seed=seed,
                prompts=prompts,
                out_dir=out_dir,
                sample_every=sample_every,
                quiet=quiet,
                overrides=overrides,
                launcher=launcher,
                resume=resume_dir is not None,
                overwrite=overwrite,
                dated=dated,
            )
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
    if len(result.verdicts) >= 2 and result.verdicts[0] and result.verdicts[-1]:
        from digen.run.paired import paired_changes

        changes = paired_changes(result.verdicts[0], result.verdicts[-1])
        every = changes.pop("all")
        summary["eval_images_gained"], summary["eval_images_lost"] = every.gained, every.lost
        summary["eval_rise_p"] = round(every.p, 4)  # McNemar, exact: the same images paired
        summary["eval_by_category"] = {
            g: {"first": c.before, "last": c.after, "gained": c.gained, "lost": c.lost, "p": c.p}
            for g, c in changes.items()
        }
        if not quiet:  # one readable line per category
            summary["eval_by_category"] = "".join(
                f"\n    {g}: {c.before:.3f} -> {c.after:.3f} "
                f"({c.gained} gained, {c.lost} lost; p = {c.p:.3g})"
                for g, c in changes.items()
            )
    click.echo(json.dumps(summary) if quiet else pretty(summary))
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


@dataclass(frozen=True, slots=True)
class RunRequest:
    """What ``digen run`` was asked: its options, with ``--out`` and ``--resume`` resolved
    to the one folder the run uses."""

    model: str | None
    algo: str | None
    config_path: Path | None
    model_path: Path | None
    mode: str | None
    devices: int | None
    steps: int | None
    seed: int | None
    prompts: Path | None
    out_dir: Path
    sample_every: int
    quiet: bool
    overrides: tuple[str, ...]
    launcher: str = "local"
    resume: bool = False
    """Continue the run in ``out_dir``."""
    overwrite: bool = False
    dated: bool = False
    """``out_dir`` is a new folder of its own under ``runs/``, which ``runs/latest`` points
    at once the run starts."""


def _run(req: RunRequest):
    """Resolve ``req`` to a config, check what can be checked before torch loads, and run
    it (or serve as one rank of a torchrun launch)."""
    mode, overrides = req.mode, req.overrides
    from digen.config import load_config
    from digen.errors import DigenError

    auto = mode == "auto"
    if auto and req.resume:
        raise DigenError(
            "--mode auto chooses a new run's layout; a resumed run keeps the one its "
            "config.yaml records (leave --mode out)."
        )
    if req.devices is not None and not auto:
        raise DigenError(
            "--devices is the number of devices --mode auto lays out; add --mode auto."
        )
    if req.devices is not None and req.devices < 2:
        raise DigenError(f"--devices = {req.devices} is not allowed: it must be at least 2.")
    if auto:
        mode = "colocated"  # the preset's layer; the probe and the plan choose the layout

    if req.resume and not (req.out_dir / "config.yaml").is_file():
        raise DigenError(f"'{req.out_dir}' holds no run to resume (it has no config.yaml).")
    if req.resume and req.config_path is not None:
        raise DigenError(
            "--resume continues a run with its own config.yaml, so --config cannot be given "
            "with it (--steps and overrides can)."
        )

    if req.model_path is not None and not req.model_path.exists():
        raise DigenError(f"--model-path '{req.model_path}' does not exist.")
    cli: dict[str, Any] = {}
    if req.model_path is not None:
        cli.setdefault("model", {})["path"] = str(req.model_path)
    if req.steps is not None:
        cli["steps"] = req.steps
    if req.seed is not None:
        cli["seed"] = req.seed
    if req.prompts is not None:
        cli.setdefault("data", {})["prompts"] = str(req.prompts)
    if req.resume:
        cfg = load_config(req.out_dir / "config.yaml", overrides, base=cli, preset=False)
        given = {
            "--model": (req.model, cfg.model.name),
            "--algo": (req.algo, cfg.algo.name),
            "--mode": (mode, cfg.runtime.mode),
        }
        differ = [
            f"{k} {v} (the run's is {own})" for k, (v, own) in given.items() if v and v != own
        ]
        if differ:
            raise DigenError(
                f"--resume continues the run in '{req.out_dir}' as it was configured, and this "
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
        flavour = _run_flavour(req.model, req.model_path, req.config_path, req.prompts, overrides)
        if flavour is not None:  # first, so the user's own overrides still win
            overrides = (f"model.flavour={flavour}", *overrides)
        cfg = load_config(
            req.config_path,
            overrides,
            base=cli,
            model=req.model,
            algo=req.algo,
            mode=mode,
            preset=True,
        )
    from digen.prompts import PromptSet

    PromptSet.load(cfg.data.prompts)  # a bad prompt file is reported before torch loads
    if (
        cfg.runtime.elastic.join_secret_file is not None
    ):  # unreadable or short: said before torch loads
        from digen.runtime.transport.join_secret import read_secret

        read_secret(cfg.runtime.elastic.join_secret_file, "runtime.elastic.join_secret_file")
    if cfg.model.path is not None:
        from digen.models.checks import check_model_dir

        check_model_dir(cfg.model.path, cfg.model.name)
    from digen.runtime.transport.torchrun import under_torchrun

    if req.launcher == "torchrun" or (req.launcher == "auto" and under_torchrun(os.environ)):
        if auto:
            raise DigenError(
                "--mode auto starts its own workers; under torchrun give the layout "
                "(--mode colocated or disaggregated)."
            )
        return _run_torchrun(cfg, req.out_dir, req.quiet, req.sample_every, req.dated)
    from digen.checkpoint import check_out_dir

    # a previous run in --out, or a checkpoint of other weights: said before torch loads
    check_out_dir(req.out_dir, cfg, resume=req.resume, overwrite=req.overwrite, checksums=False)
    check_writable(req.out_dir, "--out")
    from digen.runtime.placement import check_devices_here

    check_devices_here(cfg)  # a GPU this machine does not have: before anything is written
    if cfg.runtime.mode == "disaggregated" or auto:
        from digen.runtime.transport.forkserver import start_fork_server

        start_fork_server()  # the workers' imports, beside the driver's below
    quiet_progress_bars()  # imports diffusers: only once the config is good
    from digen.run.runner import DigenRunner

    record = None
    if auto:
        from digen.run.auto import choose_layout

        choice = run_async(choose_layout(cfg, devices=req.devices, progress=not req.quiet))
        cfg, record = choice.cfg, choice.record
        click.echo(f"mode auto: {choice.line}", err=True)

    if req.dated:
        _say_latest(req.out_dir)
    runner = DigenRunner(
        cfg,
        out_dir=req.out_dir,
        progress=not req.quiet,
        sample_every=req.sample_every,
        resume=req.resume,
        overwrite=req.overwrite,
        plan=record,
    )
    return run_async(runner.run())


# --- torchrun: one command on every rank ------------------------------------------------


def _run_torchrun(cfg, out_dir, quiet, sample_every, dated=False):
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
        if dated:
            _say_latest(out_dir)
        runner = DigenRunner(cfg, out_dir=out_dir, progress=not quiet, sample_every=sample_every)
        with external_launch(ExternalLaunch(address, port, world)):
            return run_async(runner.run())
    spec = WorkerSpec(
        role_for_rank(rank, rt.generators, rt.trainers, rt.placement.generator_group),
        threads=rt.placement.threads_per_worker,
    )
    serve_worker(spec, rank, world, address, port, rpc_timeout_s=rt.transport.rpc_timeout_s)
    return None


def _say_latest(out_dir: Path) -> None:
    from digen.checkpoint import point_latest

    note = point_latest(out_dir)
    if note is not None:
        click.echo(f"note: {note}.", err=True)


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
    from digen.registry.models import get_backbone

    flavour = get_backbone(model or given.get("model.name", "flux")).run_flavour
    return None if flavour == "tiny" else flavour
