"""Shared test set-up: a per-session cache for tiny flavours and a small thread budget."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session", autouse=True)
def _tiny_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tiny flavours are built once per session and loaded back through ``from_pretrained``."""
    if "DIGEN_CACHE" not in os.environ:
        os.environ["DIGEN_CACHE"] = str(tmp_path_factory.mktemp("digen-cache"))
