"""Shared test set-up: a per-session cache for tiny flavours, a small thread budget, the
fork server every run's workers start from, and :class:`RunMark` (``run_mark``).

Plain helpers the test files share -- ``tiny_config`` (a preset with overrides),
``run_config`` (a config run to its end), ``read_jsonl`` (``metrics.jsonl`` and the like) and
``free_port`` -- live in ``helpers.py`` beside this file: ``from helpers import run_config``.

Tiers: ``pytest -m "not slow"`` is the quick run while working; plain ``pytest`` runs all."""

from __future__ import annotations

import os

import pytest
import torch

# the cores shared among the test processes running at once (``pytest -n N``: N of them), at
# most 2 each: threads that outnumber the cores wait for each other at every barrier
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _WORKERS)))
# a process the tests start that dies of a signal (an abort in native code) prints its Python
# stack, so a failure seen once says where it happened
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def pytest_configure(config: pytest.Config) -> None:
    """Start the fork server with the runs' imports now: the first system to start one
    decides what it imports, and the actor tests' bare systems would import nothing. (Not
    in the process that hands tests to ``pytest -n`` workers: it runs none.)"""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        return
    from digen.runtime.transport.forkserver import start_fork_server

    start_fork_server()


_LONGEST = ("test_shapes_learning.py", "test_memory.py")
"""The files whose slow tests take minutes: run first, so the other processes of ``pytest -n``
run everything else beside them, not after them."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The minutes-long tests first, the rest in their usual order (quick and slow ones mixed,
    so that two process-heavy tests seldom run at once), and the processes of ``pytest -n``
    end together."""
    items.sort(key=lambda item: item.path.name not in _LONGEST)


@pytest.fixture(scope="session", autouse=True)
def _tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tiny flavours are built once per session and loaded back through ``from_pretrained``."""
    if "DIGEN_CACHE" not in os.environ:
        os.environ["DIGEN_CACHE"] = str(tmp_path_factory.mktemp("digen-cache"))


class RunMark:
    """An environment marked with a value of its own: every process a command started in it
    inherits the mark (its fork server and workers too), so :meth:`left` finds any of them
    still alive -- with no pid list to trust -- once the command has returned."""

    def __init__(self) -> None:
        import uuid

        self.value = uuid.uuid4().hex
        self.env = {**os.environ, "DIGEN_TEST_RUN_MARK": self.value}

    def left(self) -> list[int]:
        """Pids of live (not zombie) processes carrying the mark."""
        from pathlib import Path

        needle = f"DIGEN_TEST_RUN_MARK={self.value}".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes()
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:  # gone meanwhile, or not ours to read
                continue
            if needle in environ.split(b"\0") and state != "Z":
                pids.append(int(proc.name))
        return pids


@pytest.fixture
def run_mark() -> RunMark:
    return RunMark()


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported lives as long as the process: kept out of the collector's
    passes (each full pass would walk every object torch and diffusers made at import)."""
    import gc

    gc.collect()
    gc.freeze()
