"""Backbone adapters: one file per model, all behind :class:`DiffusionAdapter`.

The registry (:mod:`digen.models.registry`) is light; the adapters, and the base classes
they share, import diffusers only when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from digen.errors import DigenError
from digen.models.registry import BACKBONES, MODEL_NAMES, Backbone

if TYPE_CHECKING:
    from digen.models.base import DiffusionAdapter, PromptEmbeds

__all__ = [
    "BACKBONES",
    "MODEL_NAMES",
    "Backbone",
    "DiffusionAdapter",
    "PromptEmbeds",
    "get_adapter_class",
    "load_adapter",
]


def __getattr__(name: str) -> Any:
    if name in ("DiffusionAdapter", "PromptEmbeds"):
        return getattr(importlib.import_module("digen.models.base"), name)
    raise AttributeError(f"module 'digen.models' has no attribute {name!r}")


def get_adapter_class(name: str) -> type[DiffusionAdapter]:
    """The adapter class registered under ``name``."""
    if name not in BACKBONES:
        raise DigenError(f"unknown model '{name}'; choose one of: {', '.join(MODEL_NAMES)}.")
    module, cls = BACKBONES[name].adapter.split(":")
    return getattr(importlib.import_module(module), cls)


def load_adapter(name: str, path: str | None = None, **kwargs: Any) -> DiffusionAdapter:
    """Real weights from a local diffusers directory, or the tiny flavour when ``path`` is None."""
    cls = get_adapter_class(name)
    if path is None:
        return cls.tiny(**kwargs)
    return cls.from_pretrained(path, **kwargs)
