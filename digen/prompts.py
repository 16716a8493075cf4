"""Prompt sets: the shipped one, or a user's ``.txt`` (one prompt a line) / ``.jsonl`` file.

The order is a seeded permutation per epoch, so step ``s`` of a run with seed ``k`` always
gets the same prompts, whatever process asks and however often.

A prompt file must be UTF-8 text: a binary file (NUL bytes) or one that does not decode is
refused in one sentence. Lines that cannot be prompts (control characters in a ``.txt``
line; invalid JSON or no string ``"prompt"`` in a ``.jsonl`` line) are skipped and counted
(:attr:`PromptSet.skipped`, with the first such line in :attr:`PromptSet.skip_note`); a file
with no valid line is refused. Loading imports no torch, so the CLI checks a prompt file
before anything heavy loads.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from digen.errors import DigenError

__all__ = ["BUILTIN_SETS", "HELD_OUT_SETS", "PromptSet"]

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")
"""Characters no prompt holds (tab is allowed)."""


BUILTIN_SETS = {
    "default": "prompts.txt",
    "ocr": "ocr_prompts.txt",
    "shapes": "shapes_prompts.txt",
    "shapes-heldout": "shapes_heldout_prompts.txt",
}
"""Prompt sets shipped with digen, by the name ``data.prompts`` / ``--prompts`` accepts."""

HELD_OUT_SETS: dict[str, str] = {"shapes": "shapes-heldout"}
"""A shipped training set -> its held-out set, the prompts an evaluation uses by default
(``eval.prompts``): compositions that no training prompt has."""


@dataclass(frozen=True)
class PromptSet:
    prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)
    skipped: int = 0
    """Lines of the file that could not be prompts and were left out."""
    skip_note: str = ""
    """Which line was the first one skipped, and why (empty when none was)."""

    def __post_init__(self) -> None:
        if not self.metadata:
            object.__setattr__(self, "metadata", [{} for _ in self.prompts])

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def builtin(cls, name: str = "default") -> PromptSet:
        """A prompt set shipped with digen: ``default`` (objects, counting, colours, scenes,
        text), ``ocr`` (text to render, in quotes, for the OCR reward), or ``shapes`` and
        ``shapes-heldout`` (the shapes world's training and held-out captions, for the
        shapes reward; :mod:`digen.shapes`)."""
        file = BUILTIN_SETS[name]
        text = resources.files("digen.data").joinpath(file).read_text(encoding="utf-8")
        return cls._from_lines(text.splitlines(), f"the built-in prompt set {name!r}")

    @classmethod
    def for_eval(cls, prompts: str | None, training: str | None) -> PromptSet:
        """An evaluation's prompts: ``prompts`` (``eval.prompts``), else the held-out set of
        the shipped ``training`` set (``data.prompts``) when it has one, else ``training``."""
        if prompts is None:
            prompts = HELD_OUT_SETS.get(training or "default", training)
        return cls.load(prompts)

    @classmethod
    def load(cls, path: str | Path | None) -> PromptSet:
        """Prompts from ``path`` (``.jsonl`` with a ``prompt`` field, else one per line), or
        the shipped set of that name (:data:`BUILTIN_SETS`); None: the default set."""
        if path is None:
            return cls.builtin()
        if str(path) in BUILTIN_SETS and not Path(path).exists():
            return cls.builtin(str(path))
        path = Path(path)
        if not path.is_file():
            raise DigenError(f"prompt file '{path}' does not exist.")
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DigenError(f"prompt file '{path}' cannot be read ({exc.strerror}).") from None
        if b"\0" in data:
            raise DigenError(
                f"prompt file '{path}' is a binary file; give UTF-8 text, one prompt a line "
                '(.txt) or one JSON object with a "prompt" a line (.jsonl).'
            )
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            line = data[: exc.start].count(b"\n") + 1
            raise DigenError(
                f"prompt file '{path}' is not UTF-8 text (byte 0x{data[exc.start]:02x} on line "
                f"{line}); save it as UTF-8."
            ) from None
        if path.suffix == ".jsonl":
            return cls._from_jsonl(text, path)
        return cls._from_lines(text.splitlines(), f"prompt file '{path}'")

    @classmethod
    def _from_lines(cls, lines: list[str], where: str) -> PromptSet:
        prompts, bad = [], []
        for no, line in enumerate(lines, start=1):
            line = line.strip()
            if not line:
                continue
            if _CONTROL.search(line):
                bad.append(f"line {no} holds control characters")
                continue
            prompts.append(line)
        return cls._checked(prompts, [], bad, where)

    @classmethod
    def _from_jsonl(cls, text: str, path: Path) -> PromptSet:
        prompts, metadata, bad = [], [], []
        for no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                bad.append(f"line {no} is not valid JSON ({exc.msg})")
                continue
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                bad.append(f'line {no} has no string field "prompt"')
                continue
            if not row["prompt"].strip():
                bad.append(f"line {no} has an empty prompt")
                continue
            prompts.append(row["prompt"])
            metadata.append({k: v for k, v in row.items() if k != "prompt"})
        return cls._checked(prompts, metadata, bad, f"prompt file '{path}'")

    @classmethod
    def _checked(
        cls, prompts: list[str], metadata: list[dict], bad: list[str], where: str
    ) -> PromptSet:
        if not prompts:
            why = f" ({len(bad)} unusable lines; {bad[0]})" if bad else ""
            raise DigenError(f"{where} has no usable prompts{why}.")
        note = f"{where}: skipped {len(bad)} unusable lines (first: {bad[0]})" if bad else ""
        return cls(prompts, metadata, skipped=len(bad), skip_note=note)

    def indices_for_step(self, seed: int, step: int, batch_size: int) -> list[int]:
        """Dataset indices of the ``batch_size`` prompts of train step ``step``.

        Epochs are seeded permutations laid end to end; step ``s`` reads positions
        ``[s * B, (s + 1) * B)`` of that endless sequence.
        """
        n = len(self.prompts)
        out = []
        for pos in range(step * batch_size, (step + 1) * batch_size):
            epoch, offset = divmod(pos, n)
            out.append(self._permutation(seed, epoch)[offset])
        return out

    def for_step(self, seed: int, step: int, batch_size: int) -> tuple[list[str], list[dict]]:
        """Texts and metadata of the prompts of train step ``step``, in position order."""
        idx = self.indices_for_step(seed, step, batch_size)
        return [self.prompts[i] for i in idx], [self.metadata[i] for i in idx]

    def _permutation(self, seed: int, epoch: int) -> list[int]:
        import torch

        from digen.seeding import derive_seed

        g = torch.Generator().manual_seed(derive_seed("prompts", seed, epoch))
        return torch.randperm(len(self.prompts), generator=g).tolist()
