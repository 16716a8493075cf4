"""Reference reward server: any digen reward behind HTTP, for a reward model on its own machine.

    digen reward-server --reward jpeg_incompressibility --port 8000
    digen run reward.http.url=http://that-machine:8000/score

``POST /score`` takes and answers the JSON of :mod:`digen.rewards.http` (its module
docstring; both sides use its encode/decode functions). ``GET /health`` answers
``{"status": "ok", "reward": NAME}``.

Guarantees: the reward is named as in the config (a built-in, ``module:function`` or
``path/to/file.py:function``) and loaded before the port is bound; its ``setup()`` (plain or
async) runs once before the first request and its ``close()`` once at shutdown. Plain hooks run
in worker threads, so several requests may be scored at once; async hooks run on the server's
event loop.

What a request may cost is bounded (:class:`ServerLimits`): its body's bytes, its samples,
frames a sample and pixels (checked on the images' headers, before any is decoded), and the
requests read, decoded and scored at once; a few more wait their turn, and the rest are
refused. Every answer but a score is an HTTP status with ``{"error": "one sentence"}``: 400
for a malformed request, 413 for one over a limit, 429 when the server is busy, 500 when the
reward fails. A reward's own error text reaches the client only with ``debug``; otherwise the
500 says where the detail is (the server's log, logger ``digen.rewards.server``). It binds
127.0.0.1 unless told otherwise: the endpoint has no authentication, so expose it only on a
trusted network.
"""

from __future__ import annotations

import asyncio
import json
import logging
import numbers
import os
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
from aiohttp import web

from digen.errors import ConfigError, DigenError
from digen.rewards.hooks import RewardHook, call_hook, load_hook
from digen.rewards.http import RequestTooLarge, decode_request, encode_response
from digen.rewards.scoring import CompositeReward, RewardFn

__all__ = ["GATE", "ServerLimits", "make_app", "serve"]

log = logging.getLogger("digen.rewards.server")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerLimits:
    """What one request may cost the server, and how many it serves at once.

    Each field is the ``digen reward-server`` option of the same name (``--max-samples`` for
    ``max_samples``); every one is a whole number of at least 1.
    """

    max_body_mib: int = 256
    """Largest request body, in MiB (2**20 bytes); a larger one is answered 413."""
    max_samples: int = 256
    """Most samples (B) in one request; more is answered 413."""
    max_frames: int = 256
    """Most frames (F) in one sample; more is answered 413."""
    max_pixels: int = 1 << 26
    """Most pixels in one request, B x F x H x W (64 Mi: 192 MiB of decoded uint8 RGB), read
    from the shape or the images' headers before any is decoded; more is answered 413."""
    max_concurrent: int = 4
    """Requests read, decoded and scored at once."""
    max_queued: int = 64
    """Requests waiting for one of those slots (their bodies not read yet); a request that
    finds them all taken is answered 429."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(
                    f"the reward server's {f.name} (--{f.name.replace('_', '-')}) has value "
                    f"{value!r}; use a whole number of at least 1."
                )

    @property
    def max_body_bytes(self) -> int:
        """``max_body_mib`` in bytes."""
        return self.max_body_mib << 20


class _Gate:
    """At most ``max_concurrent`` requests inside at once and ``max_queued`` waiting; counts
    of what was served and refused (:meth:`statistics`)."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self._slots = asyncio.Semaphore(limits.max_concurrent)
        self.inside = self.waiting = 0
        self.counts = {
            "scored": 0,
            "malformed": 0,
            "too_large": 0,
            "busy": 0,
            "reward_failed": 0,
        }

    def full(self) -> bool:
        """Every slot taken and the queue full: the next request is refused."""
        return self.inside + self.waiting >= self.limits.max_concurrent + self.limits.max_queued

    async def __aenter__(self) -> None:
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.inside += 1

    async def __aexit__(self, *exc: object) -> None:
        self.inside -= 1
        self._slots.release()

    def statistics(self) -> dict[str, int]:
        """Requests inside and waiting now; requests scored and refused, by cause, so far."""
        return {"inside": self.inside, "waiting": self.waiting, **self.counts}


GATE = web.AppKey("digen_reward_gate", _Gate)
"""The app's admission gate: ``app[GATE].statistics()``."""


def _as_floats(result: Any, batch: int) -> list[float]:
    """A hook's B scores as plain floats (non-finite ones pass through: the client decides)."""
    try:
        values = torch.as_tensor(result, dtype=torch.float64).detach().cpu()  # [B]
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"returned {type(result).__name__}, not one number per sample") from None
    if values.ndim != 1 or values.shape[0] != batch:
        raise ValueError(f"returned shape {list(values.shape)} for {batch} samples")
    return values.tolist()


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message.rstrip(".") + "."}, status=status)


def _parse(raw: bytes, limits: ServerLimits) -> Any:
    """The request's samples, prompts and metadata (CPU work: run off the loop).

    Raises json.JSONDecodeError, or ValueError / RequestTooLarge with one sentence."""
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        raise
    except UnicodeDecodeError:
        raise ValueError("its body is not UTF-8 text") from None
    except ValueError:  # Python's cap on the digits of an integer
        raise ValueError("its JSON holds a number too long to read") from None
    except RecursionError:
        raise ValueError("its JSON is nested too deeply") from None
    return decode_request(
        body,
        max_samples=limits.max_samples,
        max_frames=limits.max_frames,
        max_pixels=limits.max_pixels,
    )


def make_app(
    hook: RewardHook,
    name: str,
    limits: ServerLimits | None = None,
    debug: bool = False,
) -> web.Application:
    """The server's aiohttp application around one loaded reward hook.

    ``limits``: what a request may cost (default :class:`ServerLimits`); ``debug``: a
    reward's own error text is sent to the client (else only to the log).
    """
    limits = limits or ServerLimits()
    gate = _Gate(limits)
    too_large_body = (
        f"the request body is over the server's limit of {limits.max_body_mib} MiB; send "
        "fewer samples a request (the http reward's options.batch_size)"
    )

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        lifecycle_of = CompositeReward([RewardFn(name=name, fn=hook)])  # its setup() / close()
        await lifecycle_of.setup()
        yield
        await lifecycle_of.close()

    async def score(request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > limits.max_body_bytes:
            gate.counts["too_large"] += 1
            return _error(413, too_large_body)  # refused before a byte of it is read
        if gate.full():
            gate.counts["busy"] += 1
            return _error(
                429,
                f"the server is busy with {gate.inside} requests and {gate.waiting} waiting "
                f"(--max-concurrent {limits.max_concurrent}, --max-queued "
                f"{limits.max_queued}); try again later",
            )
        async with gate:
            return await scored(request)

    async def scored(request: web.Request) -> web.Response:
        try:
            raw = await request.read()  # at most client_max_size bytes
        except web.HTTPRequestEntityTooLarge:  # a body sent without its length
            gate.counts["too_large"] += 1
            return _error(413, too_large_body)
        try:
            # Parsing and decoding images is CPU work: off the loop serving other requests.
            samples, prompts, metadata = await asyncio.to_thread(_parse, raw, limits)
        except RequestTooLarge as exc:
            gate.counts["too_large"] += 1
            return _error(413, str(exc))
        except json.JSONDecodeError as exc:
            gate.counts["malformed"] += 1
            return _error(400, f"the request body is not JSON (at position {exc.pos}: {exc.msg})")
        except ValueError as exc:
            gate.counts["malformed"] += 1
            return _error(400, f"malformed request: {exc}")
        except Exception:  # anything else a hostile body could provoke is still its fault
            gate.counts["malformed"] += 1
            log.exception("a request to reward %r could not be decoded", name)
            return _error(400, "malformed request: it could not be decoded")
        try:
            result = await call_hook(hook, samples, prompts, metadata)
        except Exception as exc:  # the reward's own failure
            gate.counts["reward_failed"] += 1
            log.exception("reward %r failed on a request of %d samples", name, samples.shape[0])
            if not debug:
                return _error(
                    500, f"reward {name!r} failed; the reward server's log has the details"
                )
            text = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
            return _error(500, f"reward {name!r} raised {type(exc).__name__}: {text}".rstrip(": "))
        try:
            rewards = _as_floats(result, samples.shape[0])
        except ValueError as exc:
            gate.counts["reward_failed"] += 1
            return _error(500, f"reward {name!r} {exc}")
        gate.counts["scored"] += 1
        return web.json_response(encode_response(rewards))

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "reward": name})

    app = web.Application(client_max_size=limits.max_body_bytes)
    app[GATE] = gate
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    return app


async def serve(
    reward: str | RewardHook,
    host: str = "127.0.0.1",
    port: int = 8000,
    ready: Callable[[str], None] = print,
    options: dict[str, Any] | None = None,
    limits: ServerLimits | None = None,
    debug: bool = False,
) -> None:
    """Serve ``reward`` until SIGINT or SIGTERM; ``ready`` gets the score URL once listening.
    ``options``: keyword arguments for a reward that is a class (as a config's ``options``);
    ``limits`` and ``debug`` as in :func:`make_app`.

    Port 0 picks a free port (the URL names it). Raises :class:`DigenError` with one sentence
    when the reward does not load, its setup fails, or the address cannot be bound.
    """
    if isinstance(reward, str):
        hook, name = load_hook(reward, options), reward
    else:
        hook, name = reward, getattr(reward, "__name__", type(reward).__name__)
    runner = web.AppRunner(make_app(hook, name, limits, debug), access_log=None)
    await runner.setup()  # the hook's setup(): a RewardError naming it when it fails
    try:
        try:
            await web.TCPSite(runner, host, port).start()
        except OSError as exc:  # asyncio's message repeats the address: say it once
            why = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise DigenError(f"the reward server cannot listen on {host}:{port}: {why}.") from None
        bound = runner.addresses[0][1]
        shown = f"[{host}]" if ":" in host else host
        ready(f"http://{shown}:{bound}/score")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
