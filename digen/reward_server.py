"""Reference reward server: any digen reward behind HTTP, for a reward model on its own machine.

    digen reward-server --reward jpeg_incompressibility --port 8000
    digen run reward.http.url=http://that-machine:8000/score

``POST /score`` takes and answers the JSON of :mod:`digen.algos.http_reward` (its module
docstring; both sides use its encode/decode functions). ``GET /health`` answers
``{"status": "ok", "reward": NAME}``.

Guarantees: the reward is named as in the config (a built-in, ``module:function`` or
``path/to/file.py:function``) and loaded before the port is bound; its ``setup()`` (plain or
async) runs once before the first request and its ``close()`` once at shutdown. Plain hooks run
in worker threads, so several requests may be scored at once; async hooks run on the server's
event loop. A malformed request is answered HTTP 400 and a failing reward HTTP 500, each with
``{"error": "one sentence"}``. It binds 127.0.0.1 unless told otherwise: the endpoint has no
authentication, so expose it only on a trusted network.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from aiohttp import web

from digen.algos.http_reward import decode_request, encode_response
from digen.algos.rewards import CompositeReward, RewardFn, RewardHook, call_hook, load_hook
from digen.errors import DigenError

__all__ = ["make_app", "serve"]

MAX_REQUEST_BYTES = 1 << 30
"""Largest request body (aiohttp's own default, 1 MiB, is a few images)."""


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


def make_app(hook: RewardHook, name: str) -> web.Application:
    """The server's aiohttp application around one loaded reward hook."""

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        lifecycle_of = CompositeReward([RewardFn(name=name, fn=hook)])  # its setup() / close()
        await lifecycle_of.setup()
        yield
        await lifecycle_of.close()

    async def score(request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            # Parsing and decoding images is CPU work: off the loop serving other requests.
            samples, prompts, metadata = await asyncio.to_thread(
                lambda: decode_request(json.loads(raw))
            )
        except json.JSONDecodeError as exc:
            return _error(400, f"the request body is not JSON ({exc.msg} at position {exc.pos})")
        except ValueError as exc:
            return _error(400, f"malformed request: {exc}")
        try:
            result = await call_hook(hook, samples, prompts, metadata)
        except Exception as exc:  # the reward's own failure, told to the client
            text = str(exc).strip().splitlines()[0].rstrip(".") if str(exc).strip() else ""
            return _error(500, f"reward {name!r} raised {type(exc).__name__}: {text}".rstrip(": "))
        try:
            rewards = _as_floats(result, samples.shape[0])
        except ValueError as exc:
            return _error(500, f"reward {name!r} {exc}")
        return web.json_response(encode_response(rewards))

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "reward": name})

    app = web.Application(client_max_size=MAX_REQUEST_BYTES)
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
) -> None:
    """Serve ``reward`` until SIGINT or SIGTERM; ``ready`` gets the score URL once listening.
    ``options``: keyword arguments for a reward that is a class (as a config's ``options``).

    Port 0 picks a free port (the URL names it). Raises :class:`DigenError` with one sentence
    when the reward does not load, its setup fails, or the address cannot be bound.
    """
    if isinstance(reward, str):
        hook, name = load_hook(reward, options), reward
    else:
        hook, name = reward, getattr(reward, "__name__", type(reward).__name__)
    runner = web.AppRunner(make_app(hook, name), access_log=None)
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
