"""``digen models``: the registered backbones."""

from __future__ import annotations

import click

from digen.registry.models import BACKBONES


@click.command()
def models() -> None:
    """The registered backbones and the sampling size of their published recipes."""
    for name, b in BACKBONES.items():
        r = b.recipe
        size = f"{r['width']}x{r['height']}" + (f" x {r['num_frames']} frames" if b.video else "")
        click.echo(f"{name}: {'video' if b.video else 'image'}, {size}, CFG {r['guidance_scale']}")
