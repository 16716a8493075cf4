"""``digen simulate``: the schedule on modelled costs, and the layout ``--recommend`` plans."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from cli._shared import user_errors
from digen.errors import DigenError
from digen.registry.models import MODEL_NAMES


def _option(*decls: str, **attrs: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    return decls, attrs


_OPTIONS = [
    _option(
        "--microbatches",
        "-b",
        type=int,
        default=32,
        show_default=True,
        help="Micro-batches per train step.",
    ),
    _option(
        "--generators", "-g", type=int, default=4, show_default=True, help="Generator workers."
    ),
    _option("--trainers", "-t", type=int, default=4, show_default=True, help="Trainer workers."),
    _option(
        "--profile",
        "profile_path",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Costs from a run's profile.json (overrides the cost flags).",
    ),
    _option(
        "--gen",
        type=float,
        default=1.0,
        show_default=True,
        help="Seconds to generate a micro-batch on a generator.",
    ),
    _option(
        "--update-gen-ratio",
        type=float,
        default=0.5,
        show_default=True,
        help="Update time as a multiple of --gen.",
    ),
    _option(
        "--gen-tag", type=float, help="Seconds to generate on a trainer (TAG) [default: --gen]."
    ),
    _option(
        "--score",
        type=float,
        default=0.02,
        show_default=True,
        help="Seconds to score a micro-batch.",
    ),
    _option(
        "--step-cost",
        type=float,
        default=0.0,
        show_default=True,
        help="Seconds of one optimizer step.",
    ),
    _option(
        "--sync-cost",
        type=float,
        default=0.0,
        show_default=True,
        help="Seconds of one weight sync.",
    ),
    _option("--steps", type=int, default=4, show_default=True, help="Train steps to simulate."),
    _option("--static-k", type=int, help="k of the static-k policy [default: --trainers]."),
    _option(
        "--mbs-per-group",
        type=int,
        default=1,
        show_default=True,
        help="Micro-batches per group (GAP).",
    ),
    _option(
        "--max-staleness", type=int, default=1, show_default=True, help="TCSS W for the +tcss rows."
    ),
    _option(
        "--staleness-ratio",
        type=float,
        default=0.25,
        show_default=True,
        help="TCSS ratio for the +tcss rows.",
    ),
    _option(
        "--recommend",
        is_flag=True,
        help="Rank colocated and every generator/trainer split of --devices, by time and cost.",
    ),
    _option("--devices", type=int, help="Devices to lay out (with --recommend)."),
    _option(
        "--hardware",
        "hardware_path",
        type=click.Path(dir_okay=False, path_type=Path),
        help="With --recommend: a YAML/JSON description of the devices (kinds, memory, links, "
        "prices; see docs/RUNTIME.md), to add the GPU costs of each layout.",
    ),
    _option(
        "--device",
        "device_kind",
        help="With --recommend: every device of this kind (h100, h200, a100, a100-40gb, l40s, "
        "l4), with its spec-sheet defaults.",
    ),
    _option(
        "--model",
        "model_name",
        type=click.Choice(MODEL_NAMES),
        help="With --hardware/--device: the backbone whose published sizes are moved and stored.",
    ),
    _option(
        "--lora-rank",
        type=int,
        default=8,
        show_default=True,
        help="With --model: the LoRA rank trained (0: full fine-tuning).",
    ),
    _option(
        "--reward-params",
        type=float,
        default=0.0,
        show_default=True,
        help="With --model: parameters of a reward model that sits beside the sampler.",
    ),
    _option(
        "--tokens",
        type=int,
        default=0,
        show_default=True,
        help="With --model: tokens one sample's denoiser pass attends over (latent patches and "
        "text); activation memory is then planned for, blocks checkpointed where they must be.",
    ),
    _option(
        "--sampling-passes",
        type=int,
        default=10,
        show_default=True,
        help="With --model: denoiser passes to sample one micro-batch (sampling steps).",
    ),
    _option(
        "--update-tsp",
        type=float,
        help="With --recommend: seconds of an update with TSP, to rank layouts with and without.",
    ),
    _option(
        "--tsp-degree",
        type=int,
        default=4,
        show_default=True,
        help="The TSP degree of --update-tsp.",
    ),
    _option(
        "--trained-timesteps",
        type=int,
        default=1,
        show_default=True,
        help="With --recommend: trained timesteps a sample (an update's terms: samples x these).",
    ),
    _option(
        "--shard-deal",
        type=click.Choice(["terms", "samples", "sequence"]),
        default="terms",
        show_default=True,
        help="With --recommend: what sharded trainers deal over their members "
        "(runtime.placement.shard_deal).",
    ),
    _option(
        "--guided",
        is_flag=True,
        default=False,
        help="With --recommend: sampling runs both branches of classifier-free guidance "
        "(rollout.guidance_scale > 1), which a generator may put on two devices.",
    ),
    _option(
        "--samples-per-microbatch",
        type=int,
        default=1,
        show_default=True,
        help="With --recommend: samples in one micro-batch (for the cost per 1,000 samples).",
    ),
    _option(
        "--by",
        type=click.Choice(["time", "cost"]),
        default="time",
        show_default=True,
        help="With --recommend: rank by step time or by cost per 1,000 samples.",
    ),
    _option(
        "--plot",
        "plot_path",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Draw the BTS schedule to this PNG.",
    ),
    _option(
        "--score-overlap/--no-score-overlap",
        default=True,
        show_default=True,
        help="Score beside generation on a lane per generator, as runs do by default.",
    ),
    _option(
        "--loss-rate",
        type=float,
        help="Losses of each generator per hour (preemptions): price generators that come and go.",
    ),
    _option(
        "--rejoin-s",
        type=float,
        default=300.0,
        show_default=True,
        help="With --loss-rate: seconds until a lost generator is back, on average.",
    ),
    _option(
        "--generator-price", type=float, default=0.0, show_default=True, help="Per device-hour."
    ),
    _option(
        "--preemptible-price",
        type=float,
        help="Per device-hour of a generator that comes and goes [default: --generator-price].",
    ),
    _option("--trainer-price", type=float, default=0.0, show_default=True, help="Per device-hour."),
    _option("--json", "as_json", is_flag=True, help="Machine-readable output."),
    _option("--quiet", is_flag=True, help="No progress lines on stderr (--recommend)."),
]
"""Every option of ``digen simulate``: the subcommands each take their share."""

_BY_NAME = {decls[0].lstrip("-"): (decls, attrs) for decls, attrs in _OPTIONS}
_COSTS = (
    "microbatches", "generators", "trainers", "profile", "gen", "update-gen-ratio",
    "gen-tag", "score", "step-cost", "sync-cost", "steps", "mbs-per-group", "score-overlap",
    "json",
)  # fmt: skip
"""What every job reads: the pools, the costs, the run's shape, the output."""
_SCHEDULE = ("static-k", "max-staleness", "staleness-ratio")
_JOBS: dict[str, tuple[str, ...]] = {
    "policies": _COSTS + _SCHEDULE + ("plot",),
    "recommend": _COSTS
    + _SCHEDULE
    + (
        "devices",
        "hardware",
        "device",
        "model",
        "lora-rank",
        "reward-params",
        "tokens",
        "sampling-passes",
        "update-tsp",
        "tsp-degree",
        "trained-timesteps",
        "shard-deal",
        "guided",
        "samples-per-microbatch",
        "by",
        "generator-price",
        "trainer-price",
        "quiet",
    ),  # fmt: skip
    "losses": _COSTS
    + ("loss-rate", "rejoin-s", "generator-price", "preemptible-price", "trainer-price"),
}
"""The options of each subcommand."""


def _options(names: Sequence[str], *, hidden: bool = False) -> Callable[[Any], Any]:
    """Decorate a command with the options ``names`` (in :data:`_OPTIONS`' order)."""

    def apply(f: Any) -> Any:
        for decls, attrs in reversed(_OPTIONS):
            if decls[0].lstrip("-") in names:
                text = attrs.get("help", "")
                if not hidden and text.startswith("With --recommend: "):  # it is the command
                    text = text.removeprefix("With --recommend: ")
                    attrs = {**attrs, "help": text[0].upper() + text[1:]}
                f = click.option(*decls, **attrs, hidden=hidden)(f)
        return f

    return apply


class _Simulate(click.Group):
    """``digen simulate``: three jobs as subcommands; the flags alone (no subcommand) still
    work as they always did, ``--recommend`` and ``--loss-rate`` choosing the job."""

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "COMMAND [OPTIONS]")


@click.group(cls=_Simulate, invoke_without_command=True)
@_options([decls[0].lstrip("-") for decls, _ in _OPTIONS], hidden=True)
@click.pass_context
@user_errors
def simulate(ctx: click.Context, **options: Any) -> None:
    """The schedule on modelled costs, before renting a cluster.

    \b
    digen simulate policies    step times of the TAG / TCSS policies (none, static-k, BTS)
    digen simulate recommend   colocated and every split of --devices, ranked
    digen simulate losses      the price of generators that come and go (--loss-rate)

    Costs come from flags (seconds per micro-batch) or from a run's profile.json
    (--profile); see each command's --help. The flags without a command (the form
    earlier releases took, with --recommend or --loss-rate choosing the job) still work.
    """
    if ctx.invoked_subcommand is None:
        _simulate(**options)
        return
    given = [
        _PARAMS[name][0][0]
        for name in options
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        raise DigenError(
            f"{', '.join(given)} must come after the command "
            f"(digen simulate {ctx.invoked_subcommand} [OPTIONS])"
        )


_PARAMS = {click.Option(decls, **attrs).name: (decls, attrs) for decls, attrs in _OPTIONS}
"""Each option by its parameter name: its flags and attributes, written once above."""


def _default(attrs: dict[str, Any]) -> Any:
    """An option's value when it is not given."""
    return attrs.get("default", False if attrs.get("is_flag") else None)


def _job(name: str, summary: str, *, needs: str | None = None, **fixed: Any) -> None:
    """Add subcommand ``name`` with its options (:data:`_JOBS`): ``needs``, a parameter it
    cannot go without; ``fixed``, what it sets."""

    @simulate.command(name, help=summary)
    @_options(_JOBS[name])
    @user_errors
    def command(**options: Any) -> None:
        if needs is not None and options[needs] is None:
            raise DigenError(f"digen simulate {name} needs {_PARAMS[needs][0][0]}")
        defaults = {k: _default(attrs) for k, (_, attrs) in _PARAMS.items() if k not in options}
        _simulate(**{**defaults, **options, **fixed})


_job(
    "policies",
    "Step times of the TAG / TCSS policies (none, static-k, BTS) on these pools and costs.",
)
_job(
    "recommend",
    "Rank colocated and every generator/trainer split of --devices, by time or cost.",
    recommend=True,
)
_job(
    "losses",
    "Price generators that come and go: --loss-rate losses of each per hour.",
    needs="loss_rate",
)


def _simulate(
    *,
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
    tokens: int,
    sampling_passes: int,
    update_tsp: float | None,
    tsp_degree: int,
    trained_timesteps: int,
    shard_deal: str,
    guided: bool,
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
    """Run the job the options choose (``recommend``, ``loss_rate``; else the policies)."""
    from digen.planning import simulate as sc

    if profile_path is not None:
        if not profile_path.is_file():
            raise DigenError(f"profile file '{profile_path}' does not exist")
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
    if plot_path is not None and not plot_path.parent.is_dir():
        raise DigenError(f"--plot {plot_path}: the directory '{plot_path.parent}' does not exist")
    if plot_path is not None and plot_path.suffix.lower() != ".png":
        raise DigenError(f"--plot {plot_path} must name a .png file")
    for name, value, low in (
        ("--microbatches", microbatches, 1),
        ("--generators", generators, 1),
        ("--trainers", trainers, 1),
        ("--steps", steps, 1),
        ("--mbs-per-group", mbs_per_group, 1),
        ("--max-staleness", max_staleness, 0),
    ):
        if value < low:
            raise DigenError(f"{name} = {value} is not allowed: it must be at least {low}")
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
            tokens=tokens,
            passes=sampling_passes,
            update_tsp=update_tsp,
            tsp_degree=tsp_degree,
            timesteps=trained_timesteps,
            shard_deal=shard_deal,
            guided=guided,
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
    if as_json:
        click.echo(json.dumps(table))
    else:
        click.echo(sc.format_table(table))


def _recommend(
    costs: Any,
    microbatches: int,
    devices: int | None,
    *,
    hardware: Path | dict[str, str] | None,
    model_name: str | None,
    lora_rank: int,
    reward_params: float,
    tokens: int,
    passes: int,
    update_tsp: float | None,
    tsp_degree: int,
    timesteps: int,
    shard_deal: str,
    guided: bool,
    samples: int,
    by: str,
    prices: tuple[float, float],
    as_json: bool,
    quiet: bool,
    kw: dict[str, Any],
) -> None:
    """``simulate --recommend``: every layout ranked, with its GPU terms when hardware is given."""
    from digen.planning import layouts as planner
    from digen.planning.hardware import ModelSize, describe, load_hardware

    hw = None
    if hardware is not None:
        if isinstance(hardware, Path) and not hardware.is_file():
            raise DigenError(f"hardware file '{hardware}' does not exist")
        hw = load_hardware(hardware)
        if model_name is None:
            raise DigenError("--hardware and --device need --model, whose sizes they move")
    elif model_name is not None:
        raise DigenError("--model needs --hardware or --device, the devices it runs on")
    if devices is None and (hw is None or hw.generators is None):
        raise DigenError("--recommend needs --devices N, the number of devices to lay out")
    for name, value in (
        ("--sampling-passes", passes),
        ("--tsp-degree", tsp_degree),
        ("--trained-timesteps", timesteps),
    ):
        if value < 1:
            raise DigenError(f"{name} = {value} is not allowed: it must be at least 1")
    if lora_rank < 0:
        raise DigenError(f"--lora-rank = {lora_rank} is not allowed: it must be at least 0")
    if tokens < 0:
        raise DigenError(f"--tokens = {tokens} is not allowed: it must be at least 0")
    model = None
    if model_name is not None:
        model = ModelSize.of(
            model_name, lora_rank=lora_rank, reward_params=reward_params, tokens=tokens
        )
    work = planner.Workload(
        costs=costs,
        microbatches=microbatches,
        samples_per_microbatch=samples,
        mbs_per_group=kw["mbs_per_group"],
        update_tsp=update_tsp,
        tsp_degree=tsp_degree if update_tsp is not None else 1,  # the degree of --update-tsp
        passes=passes,
        timesteps=timesteps,
        shard_deal=shard_deal,
        guided=guided,
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
        raise DigenError("no layout fits: " + "; ".join(skipped))
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
        if not done:  # the table's "left out" says why
            click.echo(f"G={generators} T={trainers}: does not fit", err=True)
        else:
            best = min(done, key=lambda c: c.step_time)
            click.echo(
                f"G={generators} T={trainers}: best {best.label} at "
                f"{best.step_time:.3f} s a step ({now - last:.1f} s to simulate)",
                err=True,
            )
        last = now

    return report
