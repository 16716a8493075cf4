"""Backbone adapters: one file per model, all behind :class:`DiffusionAdapter`.

The registry (:mod:`digen.registry.models`) is light; the adapters, and the base classes
they share, import diffusers only when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from digen.registry.models import BACKBONES, MODEL_NAMES, Backbone, get_backbone

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
    module, cls = get_backbone(name).adapter.split(":")
    from digen.models._quiet import quiet_import

    with quiet_import():  # the pipeline's import names optional packages it misses
        return getattr(importlib.import_module(module), cls)


def load_adapter(
    name: str,
    path: str | None = None,
    *,
    flavour: str = "tiny",
    vae_tiling: bool = False,
    offload_text_encoders: bool = False,
    **kwargs: Any,
) -> DiffusionAdapter:
    """Real weights from a local diffusers directory, or the random-init ``flavour`` (``tiny``
    or ``medium``) when ``path`` is None.

    ``vae_tiling`` decodes in slices and tiles; ``offload_text_encoders`` keeps the text
    encoders on the CPU between prompt encodings. ``kwargs`` go to
    :meth:`~digen.models.base.DiffusionAdapter.from_pretrained`: ``device``, ``dtype`` and the
    geometry, where None takes the flavour's default (the tiny one's with real weights).
    """
    from digen.models._quiet import no_loading_bars

    cls = get_adapter_class(name)
    options = {"vae_tiling": vae_tiling, "offload_text_encoders": offload_text_encoders}
    with no_loading_bars():
        if path is None:
            return cls.random_init(flavour, **options, **kwargs)
        return cls.from_pretrained(path, **options, **kwargs)
