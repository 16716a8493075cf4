"""What the fork server does once for every worker it forks (the last module of
:data:`~digen.runtime.transport.forkserver.PRELOAD`): each backbone's adapter and pipeline
imported, and the caches that loading a text encoder fills made (transformers' checkpoint
conversion mapping and the patterns it compiles), so a worker finds them ready instead of
making them again. Nothing here changes what a worker computes."""

from __future__ import annotations

import contextlib

from digen.models import MODEL_NAMES, get_adapter_class

__all__: list[str] = []


def _warm() -> None:
    """Only time is at stake: whatever fails here fails again, with its own message, in the
    worker that needs it (a fork server whose preload raised would start no worker)."""
    for name in MODEL_NAMES:
        with contextlib.suppress(Exception):
            get_adapter_class(name)
    with contextlib.suppress(Exception):  # a cache of one transformers release
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        get_checkpoint_conversion_mapping("clip_text_model")


_warm()
