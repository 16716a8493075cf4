"""One loaded tiny adapter per backbone for the whole session, shared by the backbone tests.

Tests must not change a shared adapter: one that attaches LoRA or swaps a component works on
``backbone_helpers.private_copy`` or on a pipeline of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

from digen.models import get_adapter_class
from digen.models.base import DiffusionAdapter


@pytest.fixture(scope="session")
def tiny_adapter() -> Callable[[str], DiffusionAdapter]:
    """``tiny_adapter(name)``: the tiny flavour, loaded once through ``from_pretrained``."""
    return functools.cache(lambda name: get_adapter_class(name).tiny())
