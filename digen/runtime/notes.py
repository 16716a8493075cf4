"""digen's notes in the run's log, from the driver's process and from every worker's.

digen says small things a user may want to know (``logging.getLogger("digen")``: a prompt a
text encoder truncates, ...). During a run they become lines of the run's structured log
(``trainer.log``) rather than terminal output: :class:`NotesToRunLog` sends them to a
logger, the driver's own (structlog) or, in a worker, :class:`AppendedLog`, which appends
to the same file line by line so workers and driver can share it. The driver names the file
in each worker's environment (:data:`NOTES_ENV`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from datetime import UTC, datetime
from typing import Any

__all__ = ["NOTES_ENV", "AppendedLog", "NotesToRunLog", "notes_to_run_log"]

NOTES_ENV = "DIGEN_NOTES_LOG"
"""In a worker's environment: the run's log (``trainer.log``), where its notes go."""


class NotesToRunLog(logging.Handler):
    """digen's notes as ``note`` events of ``log`` (anything with ``info(event, **fields)``),
    naming the worker that noted them when ``worker`` is given."""

    def __init__(self, log: Any, worker: str | None = None) -> None:
        super().__init__(logging.INFO)
        self.log, self.worker = log, worker

    def emit(self, record: logging.LogRecord) -> None:
        fields = {"text": record.getMessage(), "source": record.name}
        if self.worker is not None:
            fields["worker"] = self.worker
        try:
            self.log.info("note", **fields)
        except OSError:
            self.handleError(record)


class AppendedLog:
    """The run's log as a worker writes it: one JSON line per event, in the driver's format
    (``event``, ``level``, ``timestamp``), appended whole."""

    def __init__(self, path: str) -> None:
        self.path = path

    def info(self, event: str, **fields: Any) -> None:
        now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        line = {**fields, "event": event, "level": "info", "timestamp": now}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")


_LOCK = threading.Lock()
"""A generator's actors (it and its scoring actor) are built on threads of their own, at once."""


def notes_to_run_log(worker: str) -> None:
    """Once per worker process: its notes to the run's log, when the driver named one."""
    path = os.environ.get(NOTES_ENV)
    notes = logging.getLogger("digen")
    with _LOCK:
        if path and not any(isinstance(h, NotesToRunLog) for h in notes.handlers):
            notes.addHandler(NotesToRunLog(AppendedLog(path), worker))
