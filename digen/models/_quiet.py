"""What diffusers and transformers print while digen uses them, kept off the user's terminal.

The libraries report on stderr, call after call, things a training run does on purpose or
cannot act on: loading bars, optional dependencies they miss at import, and every prompt a
text encoder truncates. The CLI lowers their verbosity before importing them; these scoped
guards (:func:`digen.quiet.hf_quiet`) make the Python API as quiet without changing the
user's own settings for good.
Warnings about the weights themselves (missing or unexpected keys) still show.

A prompt cut by a tokenizer is noted once per adapter on the ``digen.models`` logger (a run
writes it to ``trainer.log``), not once per prompt on the terminal.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from digen.quiet import hf_quiet

NOTES = logging.getLogger("digen.models")
"""Where adapters note what a user may want to know once (a run logs it to trainer.log)."""

_CUT_MARKS = (
    "was truncated because",  # diffusers' pipelines, per encode call
    "Token indices sequence length is longer than",  # transformers' tokenizers, once each
)
_TOKENIZER_LOGGER = "transformers.tokenization_utils_base"


def quiet_import() -> contextlib.AbstractContextManager[None]:
    """No notices about optional dependencies while an adapter's pipeline is imported
    (transformers names every image processor that misses torchvision)."""
    return hf_quiet(bars=False)


def no_loading_bars() -> contextlib.AbstractContextManager[None]:
    """No loading or saving progress bars while a model is built, saved or loaded."""
    return hf_quiet(notices=False)


class _Cuts(logging.Filter):
    """Drops the truncation warnings it sees and keeps one's text (the first, or the first
    of diffusers'); passes the rest as the logger's own level would (``floors``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None
        self.floors: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not any(mark in text for mark in _CUT_MARKS):
            return record.levelno >= self.floors.get(record.name, logging.NOTSET)
        if self.first is None or (_CUT_MARKS[0] in text and _CUT_MARKS[0] not in self.first):
            self.first = text  # diffusers' says which encoder and limit: preferred
        return False


@contextlib.contextmanager
def caught_truncation(pipe: object) -> Iterator[_Cuts]:
    """Keep the truncation warnings of ``pipe``'s prompt encoding off the terminal; the
    yielded filter's ``first`` holds the first one's text (None: nothing was cut).

    The filter sits on the loggers that emit them (the pipeline's modules and transformers'
    tokenizer base), so it acts whatever handlers the user configured; those loggers hear
    warnings for the call even where the libraries' verbosity is lower (the CLI's), and
    pass on only what that verbosity would.
    """
    names = {c.__module__ for c in type(pipe).__mro__ if c.__module__.startswith("diffusers.")}
    loggers = [logging.getLogger(n) for n in sorted(names | {_TOKENIZER_LOGGER})]
    levels = [lg.level for lg in loggers]
    cuts = _Cuts()
    for lg in loggers:
        cuts.floors[lg.name] = lg.getEffectiveLevel()
        lg.setLevel(min(cuts.floors[lg.name], logging.WARNING))
        lg.addFilter(cuts)
    try:
        yield cuts
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeFilter(cuts)
            lg.setLevel(level)


def truncation_note(model: str, warning: str) -> str:
    """One sentence for the run's log from the first truncation warning of ``model``."""
    reason = warning.partition("because ")[2].partition(":")[0].strip()
    if not reason and "(" in warning:  # transformers: "... for this model (37 > 32). ..."
        reason = "a tokenizer's limit: " + warning.partition("(")[2].partition(")")[0] + " tokens"
    reason = " ".join(reason.split()) or warning.strip().splitlines()[0]
    return (
        f"prompts longer than the {model} text encoders take are truncated ({reason}); "
        "noted once, not per prompt"
    )
