"""``digen bench``: the ablation ladder, and time to a held-out quality (``--quality``)."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from cli._shared import (
    check_writable,
    one_of,
    quiet_imports,
    quiet_progress_bars,
    user_errors,
)
from digen.registry.algos import ALGO_NAMES
from digen.registry.models import MODEL_NAMES


@click.command()
@click.option(
    "--quick", is_flag=True, help="A few minutes on a 2-core laptop: 64 px, 4 steps, 1 repeat."
)
@click.option("--model", default="flux", show_default=True, help=f"{one_of(MODEL_NAMES)}.")
@click.option("--algo", default="flowgrpo", show_default=True, help=f"{one_of(ALGO_NAMES)}.")
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
    help="Worker processes in every rung (disaggregated: generators + trainers) "
    "[default: 2; --sharded 3].",
)
@click.option(
    "--sharded",
    is_flag=True,
    help="Measure sharded trainers instead of the ladder: 1 generator and --workers - 1 FSDP "
    "trainers, micro-batches of one sample, samples dealt against (sample, timestep) terms "
    "dealt, with the planner's prediction.",
)
@click.option(
    "--sequence",
    is_flag=True,
    help="Measure one generator's sampling on one process, and on two sharing each sample's "
    "tokens (sequence parallelism) or the guidance branches (CFG parallelism), with the "
    "planner's prediction of each [--size default: 768; --quick 128].",
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
@user_errors
def bench(
    quick: bool,
    model: str,
    algo: str,
    size: int | None,
    steps: int | None,
    repeats: int | None,
    workers: int | None,
    sharded: bool,
    sequence: bool,
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

    With --sharded: measure 1 generator and --workers - 1 FSDP trainers dealing each update's
    samples, then its (sample, timestep) terms, and the planner's prediction of the second.
    """
    quiet_imports()

    if sequence:
        if sharded or quality:
            from digen.errors import DigenError

            other = "--sharded" if sharded else "--quality"
            raise DigenError(f"--sequence and {other} measure different things; choose one")
        _bench_sequence(
            model=model,
            size=size,
            repeats=repeats,
            quick=quick,
            overrides=overrides,
            json_path=json_path,
            quiet=quiet,
        )
        return

    if quality:
        if sharded:
            from digen.errors import DigenError

            raise DigenError("--quality and --sharded measure different things; choose one")
        workers = 2 if workers is None else workers
        _bench_quality(**{k: v for k, v in locals().items() if k in _QUALITY_OPTIONS})
        return

    settings = _bench_settings(**{k: v for k, v in locals().items() if k in _SETTINGS_OPTIONS})
    from digen.run import bench as b

    b.rung_configs(settings)  # a setting no rung allows fails here, before any run
    quiet_progress_bars()

    def say(text: str) -> None:
        if not quiet:
            click.echo(f"bench: {text}", err=True)

    rungs = len(b.rungs(settings))
    say(
        f"{settings.model} / {settings.algo}, {settings.size} px, {settings.steps} steps, "
        f"{rungs} runs x {settings.repeats} repeats on {settings.workers} workers"
    )
    runs = _measuring(lambda: b.run_bench(settings, out_dir=out_dir, progress=say), debug)
    command = (
        f"digen bench --model {settings.model} --algo {settings.algo} --size {settings.size} "
        f"--steps {settings.steps} --repeats {settings.repeats} --workers {settings.workers}"
        + (" --sharded" if sharded else "")
    )
    command = " ".join([command, *(shlex.quote(o) for o in overrides)])
    report = b.summarise(settings, runs, command=command)
    click.echo(b.format_table(report))
    _write_report(report, json_path, plot_path, lambda path: b.plot_bench(report, runs, path), say)


def _bench_sequence(
    *,
    model: str,
    size: int | None,
    repeats: int | None,
    quick: bool,
    overrides: tuple[str, ...],
    json_path: Path | None,
    quiet: bool,
) -> None:
    """``--sequence``: the arms of :mod:`digen.run.bench_sequence`, a table and the JSON."""
    from digen.errors import DigenError

    if model not in MODEL_NAMES:
        raise DigenError(f"--model {model!r} is not a model; choose {one_of(MODEL_NAMES)}")
    size = size if size is not None else (128 if quick else 768)
    repeats = repeats if repeats is not None else (1 if quick else 3)
    if size < 16 or size % 16:
        raise DigenError(f"--size {size} is not allowed: it must be a multiple of 16")
    if repeats < 1:
        raise DigenError(f"--repeats {repeats} is not allowed: it must be at least 1")
    if json_path is not None and not json_path.parent.is_dir():
        raise DigenError(f"--json {json_path}: the directory '{json_path.parent}' does not exist")
    from digen.run import bench_sequence as bs

    settings = bs.SequenceBenchSettings(
        model=model, size=size, repeats=repeats, overrides=tuple(overrides)
    )
    bs.check_settings(settings)  # a bad override fails here, before any process starts
    quiet_progress_bars()

    def say(text: str) -> None:
        if not quiet:
            click.echo(f"bench: {text}", err=True)

    got = bs.run_sequence_bench(settings, say)
    command = f"digen bench --sequence --model {model} --size {size} --repeats {repeats}"
    command = " ".join([command, *(shlex.quote(o) for o in overrides)])
    report = bs.summarise_sequence(settings, got, command=command)
    click.echo(bs.format_sequence(report))
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
        say(f"wrote {json_path}")


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

    if model not in MODEL_NAMES:
        raise DigenError(f"--model {model!r} is not a model; choose {one_of(MODEL_NAMES)}")
    if algo not in ALGO_NAMES:
        raise DigenError(f"--algo {algo!r} is not an algorithm; choose {one_of(ALGO_NAMES)}")
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
    if not 0 < target <= 1:
        raise DigenError(
            f"--target {target} is not allowed: it is a held-out accuracy, above 0 and at most 1"
        )
    if workers < 2:
        raise DigenError(
            f"--workers {workers} is not allowed: disaggregation needs at least 2 "
            "(a generator and a trainer)"
        )
    if out_dir is not None:
        check_writable(out_dir, "--out")
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
    quiet_progress_bars()

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
    from digen.errors import RunStopped

    try:
        return measure()
    except KeyboardInterrupt:
        click.echo("interrupted.", err=True)
        sys.exit(130)
    except RunStopped as stop:
        click.echo(f"{stop}: the bench stops with the run it was measuring.", err=True)
        sys.exit(143 if stop.signal == "SIGTERM" else 130)
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


_SETTINGS_OPTIONS = [
    "quick", "model", "algo", "size", "steps", "repeats", "workers", "json_path", "plot_path",
    "overrides", "out_dir", "sharded",
]  # fmt: skip
"""The options of ``digen bench`` that the ladder and ``--sharded`` read."""


def _bench_settings(
    *, quick, model, algo, size, steps, repeats, workers, json_path, plot_path, overrides, out_dir,
    sharded,
):  # fmt: skip
    """The bench's settings from its options, or one sentence (DigenError) on bad input."""
    from digen.errors import DigenError
    from digen.run.bench import QUICK, BenchSettings

    if model not in MODEL_NAMES:
        raise DigenError(f"--model {model!r} is not a model; choose {one_of(MODEL_NAMES)}")
    if algo not in ALGO_NAMES:
        raise DigenError(f"--algo {algo!r} is not an algorithm; choose {one_of(ALGO_NAMES)}")
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
    workers = (3 if sharded else 2) if workers is None else workers
    if sharded and workers < 3:
        raise DigenError(
            f"--workers {workers} is not allowed with --sharded: it needs at least 3 "
            "(a generator and 2 sharded trainers)"
        )
    if workers < 2:
        raise DigenError(
            f"--workers {workers} is not allowed: disaggregation needs at least 2 "
            "(a generator and a trainer)"
        )
    for flag, path in (("--json", json_path), ("--plot", plot_path)):
        if path is not None and not path.parent.is_dir():
            raise DigenError(f"{flag} {path}: the directory '{path.parent}' does not exist")
    if out_dir is not None:
        check_writable(out_dir, "--out")
    if plot_path is not None and plot_path.suffix.lower() != ".png":
        raise DigenError(f"--plot {plot_path} must name a .png file")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return BenchSettings(
        model=model,
        algo=algo,
        workers=workers,
        cores=max(1, cores or 1),
        overrides=tuple(overrides),
        sharded=sharded,
        **values,
    )
