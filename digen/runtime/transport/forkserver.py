"""The fork server every local worker process starts from.

A run's local workers (a disaggregated run's generators and trainers, a colocated run's
data-parallel ranks) are forked from a fork server: a clean process (never the driver,
whose RPC and OpenMP threads would not survive a fork) that has imported torch, diffusers
and the backbones once, and made the caches every worker would make (:data:`PRELOAD`). A
child leaves what it inherits out of the garbage collector's passes (``gc.freeze``): a pass
over it would cost time and copy the pages it shares with the server. The first process
started here starts the server; :func:`start_fork_server` starts it sooner, while the driver
is still importing the same modules, so the two imports run side by side on a machine with a
core to spare.

:func:`process` gives each child what a spawned one would inherit at its start: the
environment, working directory, ``sys.path``, stdout and stderr. Where there is no fork
server (not Linux or macOS), children are spawned. Torch-free: the command line calls
:func:`start_fork_server` before it imports torch.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import multiprocessing.context
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from digen.quiet import QUIET_ENV

__all__ = [
    "PRELOAD",
    "WORKER_ENV",
    "kill_started",
    "patched_env",
    "process",
    "start",
    "start_fork_server",
    "stop_fork_server",
]

PRELOAD = (
    "digen.runtime.worker.generator",
    "digen.runtime.worker.trainer",
    "digen.runtime.worker.preload",
)
"""What the fork server imports before it forks the first worker (the last one readies what
every worker would otherwise make for itself)."""

WORKER_ENV = dict(QUIET_ENV)
"""Environment of every worker; read by those libraries as they import, so the fork server
must start with it too."""

_server_started = False
"""Whether this process started the fork server (with its stdout and stderr kept out)."""

_started: weakref.WeakSet[multiprocessing.process.BaseProcess] = weakref.WeakSet()
"""Every process :func:`start` started and that is still referenced: what a hard exit kills."""


def start_fork_server(preload: Sequence[str] = PRELOAD) -> None:
    """Start the fork server now, importing ``preload`` in the background; returns at once.
    Nothing to do where there is no fork server, or once it runs (the first start decides
    what it imports)."""
    if _context(preload).get_start_method() == "forkserver":
        _ensure_server(WORKER_ENV)


def process(
    target: Callable[..., Any],
    args: tuple = (),
    *,
    env: dict[str, str] | None = None,
    name: str | None = None,
    daemon: bool = False,
    preload: Sequence[str] = PRELOAD,
) -> multiprocessing.process.BaseProcess:
    """A process (not started) that runs ``target(*args)`` forked from the fork server, in
    the environment ``env`` (default: this one's as it is now), this process's working
    directory and ``sys.path``, and its stdout and stderr as they are now (a pipe, a test's
    capture). Start it with :func:`start`."""
    env = dict(os.environ) if env is None else env
    stdio = tuple(_InheritFd(fd) if _is_open(fd) else None for fd in (1, 2))
    ctx = _context(preload)
    proc = ctx.Process(target=_run, args=(target, args, env, stdio), name=name, daemon=daemon)
    proc._digen_env = env  # type: ignore[attr-defined]
    proc._digen_forked = ctx.get_start_method() == "forkserver"  # type: ignore[attr-defined]
    return proc


def start(proc: multiprocessing.process.BaseProcess) -> None:
    """Start a :func:`process`; returns once the child exists. A fork server that starts
    now imports with the child's environment (some libraries read it as they import)."""
    env = proc._digen_env  # type: ignore[attr-defined]
    if proc._digen_forked:  # type: ignore[attr-defined]
        _ensure_server(env)
    with patched_env(env):
        proc.start()
    _started.add(proc)


def kill_started() -> list[int]:
    """SIGKILL every process :func:`start` started that is still running; their pids. Fit
    for a signal handler: it only polls and sends signals, nothing waits."""
    killed = []
    for proc in list(_started):
        pid = proc.pid
        if pid is None or proc.exitcode is not None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, 9)
            killed.append(pid)
    return killed


def stop_fork_server() -> None:
    """Stop the fork server this process started and wait until it has exited, so a command
    that returns leaves no process of its run behind (the server would otherwise notice its
    parent's exit a second or so later). The next :func:`start` starts a new one."""
    global _server_started
    if not _server_started:
        return
    from multiprocessing import forkserver

    # multiprocessing has no public stop; its own tests stop the server this way
    stop = getattr(getattr(forkserver, "_forkserver", None), "_stop", None)
    if stop is not None:
        with contextlib.suppress(OSError, ChildProcessError):
            stop()
    _server_started = False


def _ensure_server(env: dict[str, str]) -> None:
    """Start the fork server if it is not running, in ``env``, without this process's
    stdout and stderr: its children get them from :func:`process`, and a server holding them
    would keep a reader of this process's output waiting for its own slow exit."""
    global _server_started
    if _server_started:  # a server that died since is restarted by the start itself
        return
    from multiprocessing import forkserver

    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2) if _is_open(fd)}
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in saved:
            os.dup2(null, fd)
        with patched_env(env):
            forkserver.ensure_running()
        _server_started = True
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        os.close(null)


def _context(preload: Sequence[str]) -> multiprocessing.context.BaseContext:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    if preload:
        ctx.set_forkserver_preload(list(preload))  # no effect once the server runs
    return ctx


def _run(target: Callable[..., Any], args: tuple, env: dict[str, str], stdio: tuple) -> Any:
    """In the child: take the environment and stdout / stderr, then run the target."""
    gc.freeze()  # what the server imported lives as long as the child: never collected
    os.environ.clear()
    os.environ.update(env)
    for fd, into in zip(stdio, (1, 2), strict=True):
        if fd is not None and fd != into:
            os.dup2(fd, into)
            os.close(fd)
    return target(*args)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:  # a parent started with stdout or stderr closed
        return False
    return True


class _InheritFd:
    """A file descriptor of the starting process, handed to the child as it is now (a fork
    server's children would otherwise write where the server's stdout went)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        return (_inherited_fd, (reduction.DupFd(self.fd),))


def _inherited_fd(dup: Any) -> int:
    return dup.detach()


@contextlib.contextmanager
def patched_env(env: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` added for the block: what a process started in it (or a
    library reading the environment there) sees."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
