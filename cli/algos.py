"""``digen algos``: the registered algorithms and their settings."""

from __future__ import annotations

import click

from digen.algos.registry import ALGO_NAMES, get_algorithm


@click.command()
def algos() -> None:
    """The registered algorithms: their step kinds, KL convention and own settings."""
    for name in ALGO_NAMES:
        algo = get_algorithm(name)
        click.echo(f"{name}: {algo.title}")
        click.echo(f"  rollout.sde_type: {', '.join(algo.sde_types)} (default {algo.sde_types[0]})")
        click.echo(f"  algo.kl_type default: {algo.kl_type}")
        for key, param in algo.params.items():
            click.echo(f"  algo.params.{key} = {param.default!r}: {param.doc}")
