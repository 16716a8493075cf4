"""``digen join``: a generator that joins a running run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from cli._shared import refuse, user_errors


@click.command()
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
    help="CPU threads of this generator  [default: the run's runtime.placement.threads_per_worker]",
)
@click.option(
    "--device",
    default=None,
    help="Device of this generator on this machine (cuda:1, cpu): give each joiner of one "
    "machine its own GPU  [default: the device of its join number in the run's "
    "runtime.placement.generator_devices]",
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(min=0),
    default=60.0,
    show_default=True,
    help="Seconds to wait for the run to be there and take joins.",
)
@user_errors
def join(
    rendezvous: str,
    secret_file: Path | None,
    threads: int | None,
    device: str | None,
    wait_s: float,
) -> None:
    """Join a running run as one more generator, until it ends.

    The run must have been started with runtime.elastic.accept_generators=true; ADDRESS:PORT is
    its rendezvous, printed when it starts and kept in its workers.json (set
    runtime.transport.address to an address this machine reaches, and runtime.transport.port
    to fix the port).
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
        refuse(
            f"{rendezvous!r} is not ADDRESS:PORT (e.g. 10.0.0.5:29400): the run's "
            "rendezvous, in its workers.json."
        )
    if threads is not None and threads < 1:
        refuse(f"--threads must be at least 1, not {threads}.")
    if device is not None:
        import re

        if not re.fullmatch(r"cpu|cuda(:\d+)?|mps", device):
            refuse(f"--device {device!r} is not a device: cpu, cuda or cuda:N.")
        from digen.runtime.placement import DEVICE_ENV

        os.environ[DEVICE_ENV] = device  # the joiner's actors read it (their own process)
    if secret_file is not None:
        secret = read_secret(secret_file, "--secret-file")
    else:
        secret = os.environ.get(SECRET_ENV, "").strip()
        if not secret:
            refuse(
                "digen join needs the run's join secret: pass --secret-file FILE (the run "
                f"writes it to its output directory as join-secret) or set {SECRET_ENV}."
            )
        check_secret(secret, SECRET_ENV)

    from digen.runtime.transport.actors import JoinRefused, join_world

    click.echo(
        f"joining the run at {rendezvous} (waiting up to {wait_s:g} s for it to take joins)",
        err=True,
    )

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
