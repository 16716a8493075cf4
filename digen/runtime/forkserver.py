"""The fork server local workers start from, started early.

A disaggregated run forks its local workers from a fork server that has imported torch,
diffusers and the backbones once (:class:`~digen.runtime.actors.ActorSystem` starts it with
the first workers). :func:`start_fork_server` starts it sooner, while the driver is still
importing the same modules, so the two imports run side by side on a machine with a core to
spare. Torch-free: the command line calls it before it imports torch.
"""

from __future__ import annotations

import multiprocessing
import os

__all__ = ["PRELOAD", "WORKER_ENV", "start_fork_server"]

PRELOAD = ("digen.runtime.workers",)
"""What the fork server imports before it forks the first worker."""

WORKER_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "DIFFUSERS_VERBOSITY": "error",
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # TensorPipe logs every closed pipe at shutdown
}
"""Environment of every worker; read by those libraries as they import, so the fork server
must start with it too."""


def start_fork_server() -> None:
    """Start the fork server now, importing :data:`PRELOAD` in the background; returns at
    once. Nothing to do where there is no fork server, or once it runs."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    from multiprocessing import forkserver

    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    saved = {key: os.environ.get(key) for key in WORKER_ENV}
    os.environ.update(WORKER_ENV)
    try:
        forkserver.ensure_running()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
