"""Checks of a model directory before anything loads it (no torch, no diffusers).

A diffusers directory is ``model_index.json`` (the pipeline class and its components) plus a
subfolder per component, each with its own config file. :func:`check_model_dir` reads them
as JSON and compares the pipeline class with the backbone's, so a corrupt file or a
directory of another model is one sentence, not a traceback from deep inside a loader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from digen.errors import DigenError
from digen.registry.models import BACKBONES

__all__ = ["check_model_dir", "model_of_dir"]

_CONFIG_FILES = ("config.json", "scheduler_config.json", "tokenizer_config.json")
"""The config file a component folder may hold (models, schedulers, tokenizers)."""


def check_model_dir(path: str | os.PathLike, backbone: str) -> None:
    """Raise :class:`DigenError` unless ``path`` looks like a loadable ``backbone`` model."""
    path = Path(path)
    if not path.is_dir():
        raise DigenError(f"model path '{path}' does not exist or is not a directory.")
    index_file = path / "model_index.json"
    if not index_file.is_file():
        raise DigenError(
            f"model path '{path}' is not a diffusers model directory (no model_index.json)."
        )
    index = _read_json(index_file)
    want = BACKBONES[backbone].pipeline
    got = index.get("_class_name")
    if want and got != want:
        others = [b.name for b in BACKBONES.values() if b.pipeline == got]
        hint = f" (a {others[0]} model: use --model {others[0]})" if others else ""
        raise DigenError(
            f"model path '{path}' holds a {got or 'unnamed'} pipeline{hint}, but "
            f"--model {backbone} needs a {want} directory."
        )
    for key, entry in index.items():
        if key.startswith("_") or not _is_component(entry):
            continue
        folder = path / key
        if not folder.is_dir():
            raise DigenError(
                f"model path '{path}' names a {key} component in model_index.json but has "
                f"no {key}/ folder."
            )
        for name in _CONFIG_FILES:
            if (folder / name).is_file():
                _read_json(folder / name)


def model_of_dir(path: str | os.PathLike) -> str:
    """The backbone whose pipeline class ``path``'s ``model_index.json`` names; one sentence
    when it names none digen knows."""
    index_file = Path(path) / "model_index.json"
    if not index_file.is_file():
        raise DigenError(
            f"model path '{path}' is not a diffusers model directory (no model_index.json)."
        )
    got = _read_json(index_file).get("_class_name")
    for b in BACKBONES.values():
        if b.pipeline and b.pipeline == got:
            return b.name
    raise DigenError(f"model path '{path}' holds a {got or 'unnamed'} pipeline, no backbone's.")


def _is_component(entry: Any) -> bool:
    """``[library, class]`` with both given (``[null, null]`` is an absent component)."""
    return isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)


def _read_json(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise DigenError(f"'{file}' cannot be read ({exc}).") from None
    except json.JSONDecodeError as exc:
        raise DigenError(
            f"'{file}' is not valid JSON ({exc.msg} at line {exc.lineno}); the model "
            "directory is damaged."
        ) from None
    if not isinstance(data, dict):
        raise DigenError(f"'{file}' is not a JSON object; the model directory is damaged.")
    return data
