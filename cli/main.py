"""The ``digen`` command: its group, and the process entry (``entry``) that runs it.

    digen run                                    # the shipped shapes FLUX + Flow-GRPO on the CPU
    digen run --model hunyuanvideo --algo dancegrpo
    digen run --config my.yaml rollout.n=8 train.lr=1e-4

Each command is a module of this package: :mod:`cli.run`, :mod:`cli.algos`,
:mod:`cli.models`, :mod:`cli.simulate`, :mod:`cli.join`, :mod:`cli.reward_server` and
:mod:`cli.bench`; what they share is in :mod:`cli._shared`.

Bad input (unknown model, missing files, a reward hook that does not import, a config value
that is not allowed) prints one sentence and exits with code 2; ``--debug`` shows the
traceback too.
"""

from __future__ import annotations

import contextlib
import faulthandler
import itertools
import logging
import os
import sys
from typing import Any

import click

from cli.algos import algos
from cli.bench import bench
from cli.join import join
from cli.models import models
from cli.reward_server import reward_server
from cli.run import run
from cli.simulate import simulate

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="digen")
def main() -> None:
    """digen: disaggregated RL post-training for diffusion and flow-matching models."""
    _check_torch()


for _command in (run, algos, models, simulate, join, reward_server, bench):
    main.add_command(_command)


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
