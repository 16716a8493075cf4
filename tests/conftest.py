"""Shared test set-up: a per-session cache for tiny flavours, a small thread budget, and the
fork server every run's workers start from."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def pytest_configure(config: pytest.Config) -> None:
    """Start the fork server with the runs' imports now: the first system to start one
    decides what it imports, and the actor tests' bare systems would import nothing."""
    from digen.runtime.forkserver import start_fork_server

    start_fork_server()


@pytest.fixture(scope="session", autouse=True)
def _tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tiny flavours are built once per session and loaded back through ``from_pretrained``."""
    if "DIGEN_CACHE" not in os.environ:
        os.environ["DIGEN_CACHE"] = str(tmp_path_factory.mktemp("digen-cache"))
