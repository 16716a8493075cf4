"""``digen algos``: the registered algorithms, their settings and their presets."""

from __future__ import annotations

from typing import Any

import click

from cli._shared import one_of, user_errors
from digen.registry.algos import ALGO_NAMES, get_algorithm
from digen.registry.models import MODEL_NAMES, get_backbone


@click.command()
@click.option(
    "--model",
    default="flux",
    show_default=True,
    type=click.Choice(MODEL_NAMES),
    help=f"The backbone whose published presets are shown: {one_of(MODEL_NAMES)}.",
)
@user_errors
def algos(model: str) -> None:
    """The registered algorithms: their sampling, KL convention, own settings, the
    settings of their published preset (what --model-path starts from) and the overrides
    that make the published code's other per-task configs."""
    backbone = get_backbone(model)
    for name in ALGO_NAMES:
        algo = get_algorithm(name)
        click.echo(f"{name}: {algo.title}")
        if algo.stochastic_sampling:
            kinds = ", ".join(algo.sde_types)
            click.echo(f"  rollout.sde_type: {kinds} (default {algo.sde_types[0]})")
        else:
            click.echo("  sampling: deterministic (ODE); rollout.sde_type does not apply")
        click.echo(f"  algo.kl_type default: {algo.kl_type}")
        for key, param in algo.params.items():
            click.echo(f"  algo.params.{key} = {param.default!r}: {param.doc}")
        published = _dotted(algo.preset(backbone, True))
        shown = ", ".join(f"{k}={v}" for k, v in published.items())
        click.echo(f"  preset for {model} with --model-path: {shown or 'the defaults'}")
        for task, overrides in algo.variants(backbone).items():
            click.echo(f"  published {task} config: the preset with {' '.join(overrides)}")


def _dotted(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"rollout": {"n": 8}}`` -> ``{"rollout.n": 8}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
