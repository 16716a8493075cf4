"""What the commands share: quiet imports and progress bars, the event loop a command
runs on, and how choices and summaries are written."""

from __future__ import annotations

import asyncio
import os
from typing import Any


def quiet_imports() -> None:
    """Keep optional-dependency notices of third-party libraries off the user's terminal
    (read when they are imported, which is only once the config is known to be good)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def quiet_progress_bars() -> None:
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    diffusers_logging.disable_progress_bar()
    transformers_logging.disable_progress_bar()


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
