"""Reward hooks: what one is, how one is loaded by name, and how one is called.

A reward hook scores decoded samples::

    def hook(samples, prompts, metadata) -> Sequence[float]      # or `async def`
    # samples: [B, F, H, W, 3] uint8 (F = 1 for images); prompts: B strings;
    # metadata: B dicts; returns B finite floats (list, tuple, 1-D tensor or array)

Hooks are named by a built-in name (:mod:`digen.registry.rewards`), ``module:function`` or
``path/to/file.py:function`` (a class there is instantiated once, with the reward's
``options`` as keyword arguments, and its instance called), or passed as callables. A hook
may be plain or ``async``: :func:`call_hook` awaits an async one on the event loop and runs a
plain one in a worker thread, so a slow scorer never blocks the loop. Every failure is a
:class:`~digen.errors.RewardError` whose one sentence names the hook.

Loading a hook runs its code: ``module:function`` imports the module and
``path/to/file.py:function`` executes the file, in every process that scores.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from digen.errors import RewardError
from digen.registry.rewards import BUILTIN_REWARDS

__all__ = [
    "RewardHook",
    "call_hook",
    "check_callable",
    "check_samples",
    "describe",
    "is_async",
    "load_hook",
    "resolve",
]

RewardHook = Callable[..., Any]
"""``(samples [B,F,H,W,3] uint8, prompts: list[str], metadata: list[dict]) -> B floats``
(or an awaitable of them)."""

_BY_NAME = tuple(name for name, r in BUILTIN_REWARDS.items() if r.built_from != "url")
"""The built-ins :func:`load_hook` loads from their name alone."""


def check_samples(samples: Any) -> None:
    """A ValueError unless ``samples`` is a uint8 tensor ``[B, F, H, W, 3]``."""
    if not isinstance(samples, torch.Tensor) or samples.dtype != torch.uint8:
        what = samples.dtype if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"samples must be a uint8 tensor [B, F, H, W, 3], got {what}.")
    if samples.ndim != 5 or samples.shape[-1] != 3:
        raise ValueError(f"samples must be [B, F, H, W, 3], got shape {list(samples.shape)}.")


# --------------------------------------------------------------------------- loading


def load_hook(ref: str, options: Mapping[str, Any] | None = None) -> RewardHook:
    """Resolve a built-in name, ``module:function`` or ``path/to/file.py:function`` to a callable.

    ``function`` may be dotted (``Class.method``); a class is instantiated with ``options``
    as keyword arguments (a function takes none). Raises :class:`RewardError` when the hook
    cannot be loaded or does not take ``(samples, prompts, metadata)``.
    """
    options = dict(options or {})
    builtin = BUILTIN_REWARDS.get(ref)
    if builtin is not None:
        if builtin.built_from == "url":
            raise RewardError(
                f"reward {ref!r} needs its server's URL, so it is given as a config entry "
                f"({{name: {ref}, url: ...}}), not by name alone."
            )
        if builtin.built_from == "name" and options:
            raise RewardError(f"reward {ref!r} takes no options (got {', '.join(options)}).")
        ref = builtin.target
    obj = resolve(ref)
    attr_path = ref.rpartition(":")[2]
    if inspect.isclass(obj):
        try:
            obj = obj(**options)
        except Exception as exc:
            raise RewardError(
                f"reward hook {ref!r} cannot be loaded: creating {attr_path}() raised "
                f"{describe(exc)}."
            ) from exc
    elif options:
        raise RewardError(
            f"reward hook {ref!r} is a function, so it takes no options "
            f"(got {', '.join(options)}); make it a class to configure it."
        )
    check_callable(ref, obj)
    return obj


def resolve(ref: str) -> Any:
    """The object ``module:attr`` or ``path/to/file.py:attr`` names (``attr`` may be dotted),
    importing the module or running the file; a :class:`RewardError` naming ``ref`` when it
    cannot be loaded."""
    source, sep, attr_path = ref.rpartition(":")
    if not sep or not source or not attr_path:
        raise RewardError(
            f"reward {ref!r} is neither a built-in ({', '.join(_BY_NAME)}) "
            "nor of the form module:function or path/to/file.py:function."
        )
    is_file = source.endswith(".py") or "/" in source or "\\" in source
    module = _import_file(ref, source) if is_file else _import_module(ref, source)

    obj: Any = module
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise RewardError(
                f"reward hook {ref!r} cannot be loaded: {source!r} has no attribute {attr_path!r}."
            ) from None
    return obj


def _import_module(ref: str, name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise RewardError(
            f"reward hook {ref!r} cannot be loaded: no module named {exc.name or name!r}."
        ) from exc
    except Exception as exc:
        raise RewardError(
            f"reward hook {ref!r} cannot be loaded: importing {name!r} raised {describe(exc)}."
        ) from exc


def _import_file(ref: str, source: str) -> Any:
    path = Path(source).expanduser().resolve()
    if not path.is_file():
        raise RewardError(f"reward hook {ref!r} cannot be loaded: file '{path}' does not exist.")
    # A stable, unique module name per file, registered so pickling and dataclasses work.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"digen_reward_{path.stem}_{digest}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise RewardError(f"reward hook {ref!r} cannot be loaded: '{path}' is not a module.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise RewardError(
            f"reward hook {ref!r} cannot be loaded: running '{path}' raised {describe(exc)}."
        ) from exc
    return module


def check_callable(name: str, fn: Any) -> None:
    """A RewardError naming the hook unless ``fn`` can be called as ``fn(samples, prompts,
    metadata)``."""
    if not callable(fn):
        raise RewardError(f"reward hook {name!r} is not callable (it is {type(fn).__name__}).")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature: trust them
        return
    try:
        signature.bind(None, None, None)
    except TypeError:
        raise RewardError(
            f"reward hook {name!r} must take (samples, prompts, metadata) "
            f"but its signature is {signature}."
        ) from None


def describe(exc: BaseException) -> str:
    """``ValueError: boom`` -- the exception's first line, without a closing period."""
    text = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- calling


async def call_hook(
    fn: RewardHook,
    samples: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
) -> Any:
    """One call of a hook, as it returned: an async hook awaited on this loop, a plain one
    in a worker thread (it may be slow: a reward model, an encoder) so the loop is free."""
    if is_async(fn):
        return await fn(samples, prompts, metadata)
    result = await asyncio.to_thread(fn, samples, prompts, metadata)
    return await result if inspect.isawaitable(result) else result


def is_async(fn: Any) -> bool:
    """Whether calling ``fn`` returns a coroutine: an ``async def`` function, or an object whose
    class defines ``async def __call__``."""
    if inspect.iscoroutinefunction(fn):
        return True
    return inspect.iscoroutinefunction(type(fn).__call__)
