"""Keeping what diffusers, transformers and torch print off the user's terminal, said once.

The libraries report, call after call, things a training run does on purpose or cannot act
on: loading bars, optional dependencies they miss at import, TensorPipe closing its pipes.

- :data:`QUIET_ENV`: the environment that lowers their verbosity; read as they import, so it
  is set before (by the CLI in its own process, :func:`quiet_env`, and for every worker
  process and the fork server that starts them);
- :func:`no_progress_bars`: no loading bars for good (a CLI run, a worker process, whose bars
  would interleave with the run's own progress);
- :func:`hf_quiet`: the same, for the duration of a block only, putting the user's settings
  back after (the Python API loading a model or a reward).

Warnings about the weights themselves (missing or unexpected keys) still show. A leaf:
it imports the libraries only inside its functions.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

__all__ = ["QUIET_ENV", "hf_quiet", "no_progress_bars", "quiet_env"]

QUIET_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # TensorPipe logs every closed pipe at shutdown
}
"""The environment that keeps the libraries quiet (each reads its variable as it imports)."""


def quiet_env() -> None:
    """:data:`QUIET_ENV` into this process's environment, where the user has not set it."""
    for name, value in QUIET_ENV.items():
        os.environ.setdefault(name, value)


_BAR_SWITCHES = ("diffusers.utils.logging", "transformers.utils.logging")
"""The modules whose ``disable_progress_bar()`` turns a library's bars off."""


def no_progress_bars() -> None:
    """No loading or saving progress bars from diffusers and transformers in this process:
    at once for a library already imported, else as it is imported. Importing them costs
    seconds (diffusers pulls in torch's compiler), which a process that never loads a model
    (the disaggregated driver) does not pay for this."""
    for name in _BAR_SWITCHES:
        if name in sys.modules:
            sys.modules[name].disable_progress_bar()
        elif not any(isinstance(f, _BarsOff) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _BarsOff(name))


class _BarsOff(importlib.abc.MetaPathFinder):
    """Turns module ``name``'s progress bars off as it is imported, then steps aside."""

    def __init__(self, name: str) -> None:
        self.name = name

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the finders after it find the module itself
        for finder in sys.meta_path:
            spec = getattr(finder, "find_spec", lambda *a: None)(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            module.disable_progress_bar()

        spec.loader.exec_module = exec_module  # this module's loader only
        return spec


@contextlib.contextmanager
def hf_quiet(*, notices: bool = True, bars: bool = True) -> Iterator[None]:
    """Within the block: transformers' notices below errors off (``notices``: optional
    dependencies an import misses, ...) and diffusers' and transformers' progress bars off
    (``bars``); each setting as it was after."""
    from transformers.utils import logging as transformers_logging

    libs = [transformers_logging]
    if bars:
        from diffusers.utils import logging as diffusers_logging

        libs.insert(0, diffusers_logging)
    verbosity = transformers_logging.get_verbosity()
    lower = notices and verbosity < logging.ERROR
    barred = [lib for lib in libs if bars and lib.is_progress_bar_enabled()]
    if lower:
        transformers_logging.set_verbosity_error()
    for lib in barred:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        if lower:
            transformers_logging.set_verbosity(verbosity)
        for lib in barred:
            lib.enable_progress_bar()
