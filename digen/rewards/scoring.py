"""Scoring a batch with a run's rewards: their weighted sum, time limits, retries, failures.

:func:`build_reward` loads the config's rewards (:mod:`digen.rewards.hooks`) into one
:class:`CompositeReward`, which runs all of them concurrently on a batch: async hooks on the
event loop, plain ones in a worker thread so a slow scorer never blocks the loop. Each reward
may have a timeout per call, retries with back-off, and a policy for a call that still fails
(``on_error``): stop the run, or leave out the groups of that batch and count them. A failure
is never turned into a zero reward. :meth:`CompositeReward.setup` and
:meth:`CompositeReward.close` run the hooks' own ``setup()`` / ``close()``
(:mod:`digen.rewards.loop` says when).

A plain hook runs one call at a time: a second call waits for the first. Its thread cannot
be stopped, so a call that outlives its timeout keeps running; until it returns, the hook
is neither retried nor called again (those calls fail at once, naming it), so copies of a
stuck hook never pile up.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from digen.config import RewardSpec
from digen.errors import RewardError
from digen.registry.rewards import BUILTIN_REWARDS
from digen.rewards.hooks import (
    RewardHook,
    check_callable,
    check_samples,
    describe,
    is_async,
    load_hook,
    resolve,
)

__all__ = [
    "RETRY_BACKOFF_S",
    "CompositeReward",
    "RewardFn",
    "RewardResult",
    "build_reward",
]


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


class _StillRunning(Exception):
    """A plain hook's earlier call is still running on its thread (its caller gave up on it)."""


class _OneCall:
    """One call at a time of one plain hook, on a worker thread.

    ``running`` is held by the worker thread for as long as the hook runs, so it outlives a
    caller that timed out or was cancelled; the per-loop ``asyncio.Lock`` makes the callers
    of one event loop wait their turn. A caller holding its loop's lock that still finds
    ``running`` held has met a call whose caller gave up on it.
    """

    __slots__ = ("_turns", "running")

    def __init__(self) -> None:
        self.running = threading.Lock()
        self._turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    def __reduce__(self) -> tuple[type, tuple]:
        return _OneCall, ()  # a hook sent to another process starts with no call running

    def turn(self) -> asyncio.Lock:
        """The lock the callers on the running loop queue on."""
        return self._turns.setdefault(asyncio.get_running_loop(), asyncio.Lock())

    async def call(self, fn: RewardHook, *args: Any) -> Any:
        """``fn(*args)`` on a worker thread, never beside another call of it."""

        def run() -> Any:
            # Taken here, on the thread, so a job cancelled before it starts holds nothing.
            if not self.running.acquire(blocking=False):
                raise _StillRunning
            try:
                return fn(*args)
            finally:
                self.running.release()

        async with self.turn():
            if self.running.locked():
                raise _StillRunning
            return await asyncio.to_thread(run)


@dataclass(frozen=True, slots=True)
class RewardFn:
    """One named, weighted reward hook, with how its calls may fail."""

    name: str
    """Name of the component (the config's reward name, or the callable's name)."""
    fn: RewardHook
    """The hook: plain or async, ``(samples, prompts, metadata) -> B floats``."""
    weight: float = 1.0
    """Weight of this component in the total."""
    timeout_s: float | None = None
    """Seconds one call may take (then it counts as failed); None: no limit."""
    retries: int = 0
    """Further tries after a failed call, ``RETRY_BACKOFF_S * 2**k`` seconds apart."""
    on_error: str = "fail"
    """After the last try: ``fail`` raises; ``drop`` scores the batch NaN (its groups are
    left out of training and counted)."""
    _calls: _OneCall = field(default_factory=_OneCall, init=False, repr=False, compare=False)
    """A plain hook's one call at a time (an async one is cancelled at its timeout)."""

    async def score(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        drop: bool = False,
    ) -> torch.Tensor:
        """Run the hook and check its output: ``[B]`` float32 raw (unweighted) scores
        (``drop``: NaN where a score is non-finite or the count is wrong)."""
        for attempt in range(self.retries + 1):
            try:
                result = await asyncio.wait_for(
                    self._call(samples, prompts, metadata), self.timeout_s
                )
                break
            except _StillRunning as exc:
                # Another try would only wait on (or pile onto) the call that is stuck.
                if self.on_error == "drop":
                    return torch.full((samples.shape[0],), math.nan)
                if attempt and self.timeout_s is not None:
                    raise RewardError(
                        f"the previous call of reward hook {self.name!r} is still running after "
                        f"its timeout_s of {self.timeout_s:g} s, so it is not retried."
                    ) from exc
                raise RewardError(
                    f"the previous call of reward hook {self.name!r} is still running after it "
                    "timed out or was cancelled, so it is not called for this batch."
                ) from exc
            except Exception as exc:
                if isinstance(exc, TimeoutError):
                    why = f"took longer than its timeout_s of {self.timeout_s:g} s"
                elif isinstance(exc, RewardError):  # already one sentence (a reward server's)
                    why = f"failed: {str(exc).rstrip('.')}"
                else:
                    why = f"raised {describe(exc)}"
                if attempt < self.retries:
                    await asyncio.sleep(RETRY_BACKOFF_S * 2**attempt)
                    continue
                if self.on_error == "drop":
                    return torch.full((samples.shape[0],), math.nan)
                tries = f" (tried {self.retries + 1} times)" if self.retries else ""
                raise RewardError(f"reward hook {self.name!r} {why}{tries}.") from exc
        return _to_scores(self.name, result, samples.shape[0], drop)

    async def _call(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> Any:
        if is_async(self.fn):
            return await self.fn(samples, prompts, metadata)
        result = await self._calls.call(self.fn, samples, prompts, metadata)
        return await result if inspect.isawaitable(result) else result


RETRY_BACKOFF_S = 0.5
"""The wait before a reward's first retry; it doubles for each further one."""


async def _lifecycle(name: str, fn: RewardHook, method: str) -> None:
    """Call ``fn.setup()`` or ``fn.close()`` if the hook has it (plain or async)."""
    step = getattr(fn, method, None)
    if step is None or not callable(step):
        return
    try:
        if inspect.iscoroutinefunction(step):
            await step()
        else:
            done = await asyncio.to_thread(step)
            if inspect.isawaitable(done):
                await done
    except Exception as exc:
        raise RewardError(f"reward hook {name!r} {method}() raised {describe(exc)}.") from exc


@dataclass(frozen=True, slots=True)
class RewardResult:
    """Scores of one batch."""

    total: torch.Tensor
    """``[B]`` float32: the weighted sum of the components."""
    components: dict[str, torch.Tensor]
    """Each component's raw ``[B]`` float32 scores, by reward name, in config order."""
    latency_s: dict[str, float]
    """Seconds each component's call took (retries and back-off included), by name."""


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

    async def setup(self) -> None:
        """Every hook's ``setup()``, once, before the first batch (on the loop that will
        run its calls)."""
        for fn in self.fns:
            await _lifecycle(fn.name, fn.fn, "setup")

    async def close(self) -> None:
        """Every hook's ``close()``, once, after the last batch; all are closed even when
        one fails (the first failure is raised after)."""
        failed: list[RewardError] = []
        for fn in self.fns:
            try:
                await _lifecycle(fn.name, fn.fn, "close")
            except RewardError as exc:
                failed.append(exc)
        if failed:
            raise failed[0]

    async def __call__(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Score ``samples`` ``[B, F, H, W, 3]`` uint8 with every hook at once."""
        check_samples(samples)
        batch = samples.shape[0]
        prompts = list(prompts)
        metadata = [{} for _ in range(batch)] if metadata is None else list(metadata)
        if len(prompts) != batch or len(metadata) != batch:
            raise ValueError(
                f"got {batch} samples but {len(prompts)} prompts and {len(metadata)} metadata dicts."
            )
        latency: dict[str, float] = {}

        async def timed(fn: RewardFn) -> torch.Tensor:
            t0 = time.perf_counter()
            try:
                return await fn.score(samples, prompts, metadata, self.nonfinite == "drop")
            finally:
                latency[fn.name] = time.perf_counter() - t0

        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(timed(fn)) for fn in self.fns]
        except ExceptionGroup as failed:
            # The other hooks were cancelled; surface the first failure's single sentence.
            raise failed.exceptions[0]  # noqa: B904 -- its cause is the hook's own exception
        components = {fn.name: task.result() for fn, task in zip(self.fns, tasks)}
        total = torch.zeros(batch, dtype=torch.float64)
        for fn in self.fns:
            total += fn.weight * components[fn.name].double()
        return RewardResult(
            total=total.float(),
            components=components,
            latency_s={fn.name: latency[fn.name] for fn in self.fns},
        )

    def score_sync(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """Blocking form of ``await self(...)`` for a one-off score without a loop (the
        hooks' ``setup`` / ``close`` are not called: a run uses
        :class:`~digen.rewards.loop.RewardLoop`)."""
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
            check_callable(spec.name, spec.fn)
            fn = spec
        else:
            if isinstance(spec, RewardSpec):
                target, weight = spec.name, spec.weight
            elif isinstance(spec, tuple):
                target, weight = spec
            else:
                target, weight = spec, 1.0
            if isinstance(spec, RewardSpec):
                fn = RewardFn(
                    name=target,
                    fn=_spec_hook(spec),
                    weight=weight,
                    timeout_s=spec.timeout_s,
                    retries=spec.retries,
                    on_error=spec.on_error,
                )
            elif isinstance(target, str):
                fn = RewardFn(name=target, fn=load_hook(target), weight=weight)
            else:
                name = getattr(target, "__name__", type(target).__name__)
                check_callable(name, target)
                fn = RewardFn(name=name, fn=target, weight=weight)
        if isinstance(fn.weight, bool) or not isinstance(fn.weight, numbers.Real):
            raise RewardError(f"reward {fn.name!r} has weight {fn.weight!r}, not a number.")
        if not math.isfinite(fn.weight):
            raise RewardError(f"reward {fn.name!r} has weight {fn.weight}, not a finite number.")
        fns.append(fn)
    return CompositeReward(fns, nonfinite)


def _spec_hook(spec: RewardSpec) -> RewardHook:
    """The hook a config entry names (``http``: a client of a reward server)."""
    builtin = BUILTIN_REWARDS.get(spec.name)
    if builtin is not None and builtin.built_from == "url":
        return resolve(builtin.target).from_spec(spec)
    return load_hook(spec.name, spec.options)
