"""Rewards: built-in JPEG rewards, user hooks, and their weighted combination.

A reward hook scores decoded samples::

    def hook(samples, prompts, metadata) -> Sequence[float]      # or `async def`
    # samples: [B, F, H, W, 3] uint8 (F = 1 for images); prompts: B strings;
    # metadata: B dicts; returns B finite floats (list, tuple, 1-D tensor or array)

Hooks are named by ``module:function`` or ``path/to/file.py:function`` (a class there is
instantiated once, with the reward's ``options`` as keyword arguments, and its instance
called), or passed as callables. :class:`CompositeReward` runs all of them concurrently:
async hooks on the event loop, plain ones in a worker thread so a slow scorer never blocks
the loop. Every failure is a :class:`~digen.errors.RewardError` whose one sentence names the
hook.

A hook's life is the run's: a hook object may define ``setup()`` and ``close()`` (plain or
``async``), which digen calls once per process that scores (each generator, or each
colocated worker) before the first batch and after the last, on the one event loop that
runs every call of that process (:class:`RewardLoop` where the caller has none). That is
where a hook opens an HTTP session or loads a model. Each reward may have a timeout per
call, retries with back-off, and a policy for a call that still fails (``on_error``): stop
the run, or leave out the groups of that batch and count them. A failure is never turned
into a zero reward.

A plain hook runs one call at a time: a second call waits for the first. Its thread cannot
be stopped, so a call that outlives its timeout keeps running; until it returns, the hook
is neither retried nor called again (those calls fail at once, naming it), so copies of a
stuck hook never pile up.

Loading a hook runs its code: ``module:function`` imports the module and
``path/to/file.py:function`` executes the file, in every process that scores.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import io
import math
import numbers
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from digen.config import RewardSpec
from digen.errors import RewardError

__all__ = [
    "scoring_on",
    "worker_device",
    "BUILTIN_REWARDS",
    "CompositeReward",
    "RewardFn",
    "RewardHook",
    "RewardLoop",
    "RewardResult",
    "build_reward",
    "call_hook",
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


_NAMED_CLASSES = {
    "ocr": "digen.algos.ocr:OcrReward",
    "clip": "digen.algos.clip_score:ClipScore",
}
"""Built-in rewards that are classes in modules of their own (imported when named)."""
REWARD_NAMES = (*BUILTIN_REWARDS, *_NAMED_CLASSES, "http")
"""Every reward a config can name without a module path (``http``: a reward server's)."""

# --------------------------------------------------------------------------- loading hooks


def load_hook(ref: str, options: Mapping[str, Any] | None = None) -> RewardHook:
    """Resolve a built-in name, ``module:function`` or ``path/to/file.py:function`` to a callable.

    ``function`` may be dotted (``Class.method``); a class is instantiated with ``options``
    as keyword arguments (a function takes none). Raises :class:`RewardError` when the hook
    cannot be loaded or does not take ``(samples, prompts, metadata)``.
    """
    options = dict(options or {})
    ref = _NAMED_CLASSES.get(ref, ref)
    if ref in BUILTIN_REWARDS:
        if options:
            raise RewardError(f"reward {ref!r} takes no options (got {', '.join(options)}).")
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
            obj = obj(**options)
        except Exception as exc:
            raise RewardError(
                f"reward hook {ref!r} cannot be loaded: creating {attr_path}() raised "
                f"{_describe(exc)}."
            ) from exc
    elif options:
        raise RewardError(
            f"reward hook {ref!r} is a function, so it takes no options "
            f"(got {', '.join(options)}); make it a class to configure it."
        )
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
                    why = f"raised {_describe(exc)}"
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
        if _is_async(self.fn):
            return await self.fn(samples, prompts, metadata)
        result = await self._calls.call(self.fn, samples, prompts, metadata)
        return await result if inspect.isawaitable(result) else result


async def call_hook(
    fn: RewardHook,
    samples: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
) -> Any:
    """One call of a hook, as it returned: an async hook awaited on this loop, a plain one
    in a worker thread (it may be slow: a reward model, an encoder) so the loop is free."""
    if _is_async(fn):
        return await fn(samples, prompts, metadata)
    result = await asyncio.to_thread(fn, samples, prompts, metadata)
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
        raise RewardError(f"reward hook {name!r} {method}() raised {_describe(exc)}.") from exc


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
        _check_samples(samples)
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
        hooks' ``setup`` / ``close`` are not called: a run uses :class:`RewardLoop`)."""
        return asyncio.run(self(samples, prompts, metadata))


_SCORING = threading.local()
_RUN_DEVICE: list[str] = []
"""The device a colocated worker scores on while its run lasts (:func:`scoring_on`)."""


def worker_device() -> str:
    """The device of the worker the calling thread scores for: what a model reward's
    ``device: worker`` option means. The device of the :class:`RewardLoop` whose thread this
    is (its loop's or its executor's), else of the colocated run under way in this process
    (:func:`scoring_on`), else ``cpu``."""
    return getattr(_SCORING, "device", None) or (_RUN_DEVICE[-1] if _RUN_DEVICE else "cpu")


def _enter_device(device: str) -> None:
    """This thread scores for a worker on ``device``; on a GPU it is the thread's current
    CUDA device too (each thread has its own, ``cuda:0`` until set)."""
    _SCORING.device = device
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.set_device(torch.device(device))


@contextlib.contextmanager
def scoring_on(device: str) -> Iterator[None]:
    """Rewards scored in this process inside the block, on any thread, score for a worker
    on ``device`` (a colocated worker scores in its own process, on its own loop)."""
    _RUN_DEVICE.append(device)
    try:
        yield
    finally:
        _RUN_DEVICE.pop()


class RewardLoop:
    """A :class:`CompositeReward` living on an event loop of its own, in a thread, for a
    whole run: for scoring from threads that have no loop (an actor's).

    The hooks' ``setup()`` runs once when it is made, every :meth:`score` runs on that one
    loop (so a session or model a hook opened stays usable), and :meth:`close` runs their
    ``close()`` and ends the thread. Every thread it runs hooks on (the loop's and its
    executor's, where plain hooks run) is on ``device``, the worker's (:func:`worker_device`).
    """

    def __init__(self, reward: CompositeReward, device: str = "cpu") -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.reward = reward
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(
            ThreadPoolExecutor(
                thread_name_prefix="digen-reward", initializer=_enter_device, initargs=(device,)
            )
        )

        def run() -> None:
            _enter_device(device)
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="digen-rewards", daemon=True)
        self._thread.start()
        self._closed = False
        try:
            self._run(reward.setup())
        except BaseException:
            self._stop()
            raise

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def score(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> RewardResult:
        """``await reward(...)`` on the loop, waited for here."""
        if self._closed:
            raise RewardError("the rewards were closed; no more batches can be scored.")
        return self._run(self.reward(samples, prompts, metadata))

    def close(self) -> None:
        """The hooks' ``close()``, then the loop and its thread end (once; later calls do
        nothing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(self.reward.close())
        finally:
            self._stop()

    def _stop(self) -> None:
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


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
                _check_callable(name, target)
                fn = RewardFn(name=name, fn=target, weight=weight)
        if isinstance(fn.weight, bool) or not isinstance(fn.weight, numbers.Real):
            raise RewardError(f"reward {fn.name!r} has weight {fn.weight!r}, not a number.")
        if not math.isfinite(fn.weight):
            raise RewardError(f"reward {fn.name!r} has weight {fn.weight}, not a finite number.")
        fns.append(fn)
    return CompositeReward(fns, nonfinite)


def _spec_hook(spec: RewardSpec) -> RewardHook:
    """The hook a config entry names (``http``: a client of a reward server)."""
    if spec.name == "http":
        from digen.algos.http_reward import HttpReward

        return HttpReward.from_spec(spec)
    return load_hook(spec.name, spec.options)
