"""Prompt sets: the shipped one, or a user's ``.txt`` (one prompt a line) / ``.jsonl`` file.

The order is a seeded permutation per epoch, so step ``s`` of a run with seed ``k`` always
gets the same prompts, whatever process asks and however often.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from digen.errors import DigenError
from digen.seeding import derive_seed

__all__ = ["PromptSet"]


@dataclass(frozen=True)
class PromptSet:
    prompts: list[str]
    metadata: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.metadata:
            object.__setattr__(self, "metadata", [{} for _ in self.prompts])

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def builtin(cls) -> PromptSet:
        """The small prompt set shipped with digen (objects, counting, colours, scenes, text)."""
        text = resources.files("digen.data").joinpath("prompts.txt").read_text(encoding="utf-8")
        return cls._from_lines(text.splitlines(), "the built-in prompt set")

    @classmethod
    def load(cls, path: str | Path | None) -> PromptSet:
        """Prompts from ``path`` (``.jsonl`` with a ``prompt`` field, else one per line)."""
        if path is None:
            return cls.builtin()
        path = Path(path)
        if not path.is_file():
            raise DigenError(f"prompt file '{path}' does not exist.")
        text = path.read_text(encoding="utf-8")
        if path.suffix == ".jsonl":
            return cls._from_jsonl(text, path)
        return cls._from_lines(text.splitlines(), f"prompt file '{path}'")

    @classmethod
    def _from_lines(cls, lines: list[str], where: str) -> PromptSet:
        prompts = [line.strip() for line in lines if line.strip()]
        if not prompts:
            raise DigenError(f"{where} has no prompts.")
        return cls(prompts)

    @classmethod
    def _from_jsonl(cls, text: str, path: Path) -> PromptSet:
        prompts, metadata = [], []
        for no, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DigenError(f"line {no} of '{path}' is not valid JSON ({exc.msg}).") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise DigenError(f"line {no} of '{path}' has no string field \"prompt\".")
            prompts.append(row["prompt"])
            metadata.append({k: v for k, v in row.items() if k != "prompt"})
        if not prompts:
            raise DigenError(f"prompt file '{path}' has no prompts.")
        return cls(prompts, metadata)

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
        g = torch.Generator().manual_seed(derive_seed("prompts", seed, epoch))
        return torch.randperm(len(self.prompts), generator=g).tolist()
