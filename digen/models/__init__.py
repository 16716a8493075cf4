"""Backbone adapters: one file per model, all behind :class:`DiffusionAdapter`."""

from __future__ import annotations

import importlib

from digen.errors import DigenError
from digen.models.base import DiffusionAdapter, PromptEmbeds

__all__ = ["MODEL_NAMES", "DiffusionAdapter", "PromptEmbeds", "get_adapter_class", "load_adapter"]

#: registry name -> "module:Class"
_ADAPTERS = {
    "hunyuanvideo": "digen.models.hunyuanvideo:HunyuanVideoAdapter",
    "wan": "digen.models.wan:WanAdapter",
    "flux": "digen.models.flux:FluxAdapter",
    "qwenimage": "digen.models.qwenimage:QwenImageAdapter",
    "sd3": "digen.models.sd3:SD3Adapter",
}
MODEL_NAMES = tuple(_ADAPTERS)


def get_adapter_class(name: str) -> type[DiffusionAdapter]:
    """The adapter class registered under ``name``."""
    if name not in _ADAPTERS:
        raise DigenError(f"unknown model '{name}'; choose one of: {', '.join(MODEL_NAMES)}.")
    module, cls = _ADAPTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def load_adapter(name: str, path: str | None = None, **kwargs) -> DiffusionAdapter:
    """Real weights from a local diffusers directory, or the tiny flavour when ``path`` is None."""
    cls = get_adapter_class(name)
    if path is None:
        return cls.tiny(**kwargs)
    return cls.from_pretrained(path, **kwargs)
