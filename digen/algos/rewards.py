"""Rewards: built-in JPEG rewards, user hooks, and their weighted combination.

A reward hook scores decoded samples::

    def hook(samples, prompts, metadata) -> Sequence[float]      # or `async def`
    # samples: [B, F, H, W, 3] uint8 (F = 1 for images); prompts: B strings;
    # metadata: B dicts; returns B finite floats (list, tuple, 1-D tensor or array)

Hooks are named by ``module:function`` or ``path/to/file.py:function`` (a class there is
instantiated once, without arguments, and its instances called), or passed as callables.
:class:`CompositeReward` runs all of them concurrently: async hooks on the event loop, plain
ones in a worker thread so a slow scorer never blocks the loop. Every failure is a
:class:`~digen.errors.RewardError` whose one sentence names the hook.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import io
import math
import numbers
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from digen.config import RewardSpec
from digen.errors import RewardError

__all__ = [
    "BUILTIN_REWARDS",
    "CompositeReward",
    "RewardFn",
    "RewardHook",
    "RewardResult",
    "build_reward",
    "jpeg_compressibility",
    "jpeg_incompressibility",
    "jpeg_size_kb",
    "load_hook",
]

RewardHook = Callable[..., Any]
"""``(samples [B,F,H,W,3] uint8, prompts: list[str], metadata: list[dict]) -> B floats``
(or an awaitable of them)."""

JPEG_QUALITY = 95


def _check_samples(samples: Any) -> None:
    if not isinstance(samples, torch.Tensor) or samples.dtype != torch.uint8:
        what = samples.dtype if isinstance(samples, torch.Tensor) else type(samples).__name__
        raise ValueError(f"samples must be a uint8 tensor [B, F, H, W, 3], got {what}.")
    if samples.ndim != 5 or samples.shape[-1] != 3:
        raise ValueError(f"samples must be [B, F, H, W, 3], got shape {list(samples.shape)}.")


# --------------------------------------------------------------------------- built-ins


def jpeg_size_kb(samples: torch.Tensor) -> torch.Tensor:
    """JPEG size (quality 95) in kB (bytes / 1000) of each sample, averaged over frames.

    samples: ``[B, F, H, W, 3]`` uint8 -> ``[B]`` float64.
    """
    _check_samples(samples)
    frames = samples.detach().cpu().numpy()  # [B, F, H, W, 3]
    sizes = np.empty(frames.shape[:2], dtype=np.float64)  # [B, F]
    for b in range(frames.shape[0]):
        for f in range(frames.shape[1]):
            buffer = io.BytesIO()
            Image.fromarray(frames[b, f]).save(buffer, format="JPEG", quality=JPEG_QUALITY)
            sizes[b, f] = buffer.tell() / 1000.0
    return torch.from_numpy(sizes.mean(axis=1))


def jpeg_incompressibility(
    samples: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> torch.Tensor:
    """Reward = +JPEG size in kB: detailed, hard-to-compress samples score higher."""
    return jpeg_size_kb(samples)


def jpeg_compressibility(
    samples: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> torch.Tensor:
    """Reward = -JPEG size in kB: smooth, easy-to-compress samples score higher (always <= 0)."""
    return -jpeg_size_kb(samples)


BUILTIN_REWARDS: dict[str, RewardHook] = {
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
}


# --------------------------------------------------------------------------- loading hooks


def load_hook(ref: str) -> RewardHook:
    """Resolve a built-in name, ``module:function`` or ``path/to/file.py:function`` to a callable.

    ``function`` may be dotted (``Class.method``); a class is instantiated without arguments.
    Raises :class:`RewardError` when the hook cannot be loaded or does not take
    ``(samples, prompts, metadata)``.
    """
    if ref in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[ref]
    source, sep, attr_path = ref.rpartition(":")
    if not sep or not source or not attr_path:
        raise RewardError(
            f"reward {ref!r} is neither a built-in ({', '.join(BUILTIN_REWARDS)}) "
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
    if inspect.isclass(obj):
        try:
            obj = obj()
        except Exception as exc:
            raise RewardError(
                f"reward hook {ref!r} cannot be loaded: creating {attr_path}() raised "
                f"{_describe(exc)}."
            ) from exc
    _check_callable(ref, obj)
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
            f"reward hook {ref!r} cannot be loaded: importing {name!r} raised {_describe(exc)}."
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
            f"reward hook {ref!r} cannot be loaded: running '{path}' raised {_describe(exc)}."
        ) from exc
    return module


def _check_callable(name: str, fn: Any) -> None:
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


def _describe(exc: BaseException) -> str:
    """``ValueError: boom`` -- the exception's first line, without a closing period."""
    text = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# --------------------------------------------------------------------------- scoring


def _to_scores(name: str, result: Any, batch: int, drop: bool = False) -> torch.Tensor:
    """A hook's return value as ``[B]`` float32, or a RewardError saying what is wrong.

    ``drop`` (``train.on_nonfinite = drop``): a non-finite value stays NaN, and a wrong count
    makes every score NaN, so the groups they belong to are dropped, not trained on.
    """
    if isinstance(result, torch.Tensor | np.ndarray):
        if result.ndim != 1:
            raise RewardError(
                f"reward hook {name!r} returned an array of shape {list(result.shape)}, "
                f"not one number per sample ({batch})."
            )
        real = (
            not (result.dtype.is_complex or result.dtype == torch.bool)
            if isinstance(result, torch.Tensor)
            else result.dtype.kind in "iuf"
        )
        if not real:
            raise RewardError(
                f"reward hook {name!r} returned {result.dtype} values, not real numbers."
            )
        if isinstance(result, torch.Tensor):
            values = result.detach().to("cpu", torch.float64).tolist()
        else:
            values = result.astype(np.float64).tolist()
    elif isinstance(result, list | tuple):
        values = []
        for i, v in enumerate(result):
            if isinstance(v, np.generic) or (isinstance(v, torch.Tensor) and v.numel() == 1):
                v = v.item()
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise RewardError(
                    f"reward hook {name!r} returned a non-number ({v!r}) for sample {i}."
                )
            values.append(float(v))
    else:
        raise RewardError(
            f"reward hook {name!r} returned {type(result).__name__}, not one number per sample "
            "(a list, tuple, 1-D tensor or array)."
        )
    if len(values) != batch:
        if drop:
            return torch.full((batch,), math.nan)
        raise RewardError(
            f"reward hook {name!r} returned {len(values)} values for {batch} samples."
        )
    for i, v in enumerate(values):
        if not math.isfinite(v):
            if drop:
                values[i] = math.nan
                continue
            raise RewardError(
                f"reward hook {name!r} returned a non-finite value ({v}) for sample {i} (set "
                "train.on_nonfinite=drop to leave such groups out instead)."
            )
    scores = torch.tensor(values, dtype=torch.float32)
    if drop:
        return torch.where(torch.isfinite(scores), scores, math.nan)
    if not torch.isfinite(scores).all():
        i = int((~torch.isfinite(scores)).nonzero()[0])
        raise RewardError(
            f"reward hook {name!r} returned a value too large for float32 ({values[i]}) "
            f"for sample {i}."
        )
    return scores


@dataclass(frozen=True, slots=True)
class RewardFn:
    """One named, weighted reward hook."""

    name: str
    """Name of the component (the config's reward name, or the callable's name)."""
    fn: RewardHook
    """The hook: plain or async, ``(samples, prompts, metadata) -> B floats``."""
    weight: float = 1.0
    """Weight of this component in the total."""

    async def score(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        drop: bool = False,
    ) -> torch.Tensor:
        """Run the hook and check its output: ``[B]`` float32 raw (unweighted) scores
        (``drop``: NaN where a score is non-finite or the count is wrong)."""
        try:
            if _is_async(self.fn):
                result = await self.fn(samples, prompts, metadata)
            else:
                # A plain hook may be slow (a reward model, an encoder): off the event loop.
                result = await asyncio.to_thread(self.fn, samples, prompts, metadata)
                if inspect.isawaitable(result):
                    result = await result
        except Exception as exc:
            raise RewardError(f"reward hook {self.name!r} raised {_describe(exc)}.") from exc
        return _to_scores(self.name, result, samples.shape[0], drop)


def _is_async(fn: Any) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    # An object whose class defines `async def __call__`.
    return inspect.iscoroutinefunction(type(fn).__call__)


@dataclass(frozen=True, slots=True)
class RewardResult:
    """Scores of one batch."""

    total: torch.Tensor
    """``[B]`` float32: the weighted sum of the components."""
    components: dict[str, torch.Tensor]
    """Each component's raw ``[B]`` float32 scores, by reward name, in config order."""


class CompositeReward:
    """Several reward hooks combined by weight; call it (``await``) to score a batch."""

    def __init__(self, fns: Sequence[RewardFn], nonfinite: str = "fail") -> None:
        """``nonfinite``: ``fail`` (a non-finite score or wrong count raises) or ``drop``
        (it scores NaN; the trainer leaves its group out)."""
        self.nonfinite = nonfinite
        if not fns:
            raise RewardError("no reward was given; name at least one reward.")
        names = [fn.name for fn in fns]
        for name in names:
            if names.count(name) > 1:
                raise RewardError(f"reward {name!r} is given twice; list each reward once.")
        self.fns: tuple[RewardFn, ...] = tuple(fns)

    @property
    def names(self) -> list[str]:
        """Component names, in order."""
        return [fn.name for fn in self.fns]

    async def __call__(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Score ``samples`` ``[B, F, H, W, 3]`` uint8 with every hook at once."""
        _check_samples(samples)
        batch = samples.shape[0]
        prompts = list(prompts)
        metadata = [{} for _ in range(batch)] if metadata is None else list(metadata)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(
                f"got {batch} samples but {len(prompts)} prompts and {len(metadata)} metadata dicts."
            )
        try:
            async with asyncio.TaskGroup() as group:
                drop = self.nonfinite == "drop"
                tasks = [
                    group.create_task(fn.score(samples, prompts, metadata, drop)) for fn in self.fns
                ]
        except ExceptionGroup as failed:
            # The other hooks were cancelled; surface the first failure's single sentence.
            raise failed.exceptions[0]  # noqa: B904 -- its cause is the hook's own exception
        components = {fn.name: task.result() for fn, task in zip(self.fns, tasks)}
        total = torch.zeros(batch, dtype=torch.float64)
        for fn in self.fns:
            total += fn.weight * components[fn.name].double()
        return RewardResult(total=total.float(), components=components)

    def score_sync(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Blocking form of ``await self(...)`` for callers without an event loop."""
        return asyncio.run(self(samples, prompts, metadata))


def build_reward(
    specs: Sequence[RewardSpec | RewardFn | tuple[str | RewardHook, float] | str | RewardHook],
    nonfinite: str = "fail",
) -> CompositeReward:
    """Load every reward into one scorer.

    Each entry is a config :class:`RewardSpec`, a :class:`RewardFn`, a ``(name_or_callable,
    weight)`` pair, or a bare name or callable (weight 1). Import problems surface here,
    before any sample is generated.
    """
    fns = []
    for spec in specs:
        if isinstance(spec, RewardFn):
            _check_callable(spec.name, spec.fn)
            fn = spec
        else:
            if isinstance(spec, RewardSpec):
                target, weight = spec.name, spec.weight
            elif isinstance(spec, tuple):
                target, weight = spec
            else:
                target, weight = spec, 1.0
            if isinstance(target, str):
                fn = RewardFn(name=target, fn=load_hook(target), weight=weight)
            else:
                name = getattr(target, "__name__", type(target).__name__)
                _check_callable(name, target)
                fn = RewardFn(name=name, fn=target, weight=weight)
        if isinstance(fn.weight, bool) or not isinstance(fn.weight, numbers.Real):
            raise RewardError(f"reward {fn.name!r} has weight {fn.weight!r}, not a number.")
        if not math.isfinite(fn.weight):
            raise RewardError(f"reward {fn.name!r} has weight {fn.weight}, not a finite number.")
        fns.append(fn)
    return CompositeReward(fns, nonfinite)
