"""What the commands share: quiet imports and progress bars, the event loop a command
runs on, how choices and summaries are written, and the check that an output folder can be
written."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click

from digen.errors import DigenError

_Command = TypeVar("_Command", bound=Callable[..., Any])


def refuse(text: str) -> NoReturn:
    """Bad input: one sentence on stderr (``error: ...``, ending in a full stop) and exit
    code 2, what every command does with a mistake of its user."""
    click.echo(f"error: {str(text).strip().rstrip('.')}.", err=True)
    sys.exit(2)


def user_errors(command: _Command) -> _Command:
    """A command whose user's mistakes (a :class:`~digen.errors.DigenError`, raised by any
    layer: one sentence) are said with :func:`refuse` and exit 2. Put it under the click
    decorators; anything else still fails as itself."""

    @functools.wraps(command)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except DigenError as exc:
            refuse(str(exc))

    return checked  # type: ignore[return-value]


def quiet_imports() -> None:
    """Keep optional-dependency notices of third-party libraries off the user's terminal
    (read when they are imported, which is only once the config is known to be good)."""
    from digen.quiet import quiet_env

    quiet_env()


def quiet_progress_bars() -> None:
    """No loading bars in this process (the run's own progress bar is the one shown)."""
    from digen.quiet import no_progress_bars

    no_progress_bars()


def one_of(names: tuple[str, ...]) -> str:
    return ", ".join(names[:-1]) + " or " + names[-1]


def run_async(coro):
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux / macOS
        return asyncio.run(coro)
    return uvloop.run(coro)  # an ImportError raised by the run itself is the run's error


def pretty(summary: dict[str, Any]) -> str:
    width = max(map(len, summary), default=0)
    return "\n".join(f"{k:>{width}}: {v}" for k, v in summary.items())


def check_writable(out_dir: Path, flag: str) -> None:
    """``out_dir`` can be made and written here: said before anything starts (the folders
    this makes to find out are removed again)."""
    import tempfile

    from digen.errors import DigenError

    missing = [p for p in (out_dir, *out_dir.parents) if not p.exists()]
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=out_dir).close()
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise DigenError(f"{flag} '{out_dir}' cannot be written ({why.lower()}).") from None
    finally:
        for p in missing:  # deepest first
            with contextlib.suppress(OSError):
                p.rmdir()
