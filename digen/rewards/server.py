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
500 says where the detail is (the server's log, logger ``digen.rewards.server``).

A request must arrive within ``read_timeout_s``: its headers from the connection's start (or
the end of the previous answer on a kept-alive connection), then its body; a slower client
is dropped (408 once its headers are in), so slow clients hold no slot or socket for long
(:func:`listen` holds each connection to it). With a ``token``, ``POST /score`` needs
``Authorization: Bearer <token>`` (compared in constant time) and answers 401 without it,
before any of the body is read; ``GET /health`` stays open. It binds 127.0.0.1 unless told
otherwise; a token keeps out who lacks it, but the traffic is plain HTTP: expose the server
only on a trusted network.
"""

from __future__ import annotations

import asyncio
import hmac
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

__all__ = [
    "GATE",
    "MIN_TOKEN_CHARS",
    "TOKEN_ENV",
    "ServerLimits",
    "check_token",
    "listen",
    "make_app",
    "serve",
]

TOKEN_ENV = "DIGEN_REWARD_TOKEN"
"""Where ``digen reward-server`` reads its bearer token from without ``--token-file``; the
name the http reward's ``options.token_env`` usually gives too."""
MIN_TOKEN_CHARS = 16
"""The shortest bearer token the server takes."""

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
    read_timeout_s: int = 60
    """Seconds a request may take to arrive: its headers, from the connection's start or the
    previous answer, then its body; a slower client is dropped (408 once its headers are
    in). A kept-alive connection left idle is closed after as long."""

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
            "unauthorized": 0,
            "too_slow": 0,
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


def _error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message.rstrip(".") + "."}, status=status, headers=headers)


class _Deadline(asyncio.Protocol):
    """One connection's protocol (aiohttp's, ``inner``) held to a deadline: from its start,
    and again from the end of each request's handling, the next request's headers must be in
    within ``seconds``, else the connection is dropped; ``slow()`` counts the drops of a
    request under way (bytes received), not those of a connection left idle."""

    def __init__(self, inner: asyncio.Protocol, seconds: float, slow: Callable[[], None]) -> None:
        self.inner, self.seconds, self._slow = inner, seconds, slow
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._heard = False  # bytes received since the deadline was set

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self.request_done()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._heard = True
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def request_started(self) -> None:
        """The request's headers are in: its body's time is the handler's to bound."""
        self._cancel()

    def request_done(self) -> None:
        """Handled: the next request's headers are due within ``seconds``."""
        self._cancel()
        self._heard = False
        self._timer = asyncio.get_running_loop().call_later(self.seconds, self._expired)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._transport is None:
            return
        if self._heard:  # a request under way, too slow: dropped at once
            self._slow()
            self._transport.abort()
        else:  # idle: closed as a keep-alive timeout would
            self._transport.close()


@web.middleware
async def _deadline_of_request(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """Tell the connection's :class:`_Deadline` (where :func:`listen` set one) that a
    request's headers are in, and when its handling is over."""
    transport = request.transport
    deadline = transport.get_protocol() if transport is not None else None
    if not isinstance(deadline, _Deadline):
        return await handler(request)
    deadline.request_started()
    try:
        return await handler(request)
    finally:
        deadline.request_done()


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Any]
) -> web.StreamResponse:
    """A path or method the server does not serve answers ``{"error": ...}`` as every other
    refusal does, naming what it serves."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _error(405, f"{request.path} takes {allowed}, not {request.method}", Allow=allowed)
    except web.HTTPNotFound:
        return _error(
            404, f"no {request.path} here: this server serves POST /score and GET /health"
        )


def _bearer_refusal(header: str | None, token: str) -> str | None:
    """Why an ``Authorization`` header does not carry ``token`` (None when it does)."""
    scheme, _, given = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return (
            "this reward server needs a bearer token: send Authorization: Bearer <token> (the "
            "http reward's options.token_env names the variable that holds it)"
        )
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        return "the bearer token sent is not this reward server's"
    return None


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
    token: str | None = None,
) -> web.Application:
    """The server's aiohttp application around one loaded reward hook.

    ``limits``: what a request may cost (default :class:`ServerLimits`); ``debug``: a
    reward's own error text is sent to the client (else only to the log); ``token``: the
    bearer token ``POST /score`` needs (None: none). Serve it with :func:`listen`, which
    holds every connection to ``limits.read_timeout_s``.
    """
    limits = limits or ServerLimits()
    if token is not None:
        check_token(token, "the reward server's token")
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
        if token is not None:  # before any of the body is read or a slot taken
            refused = _bearer_refusal(request.headers.get("Authorization"), token)
            if refused is not None:
                gate.counts["unauthorized"] += 1
                return _error(401, refused, **{"WWW-Authenticate": "Bearer"})
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
            # at most client_max_size bytes, within the read timeout: a slow body holds a slot
            raw = await asyncio.wait_for(request.read(), limits.read_timeout_s)
        except web.HTTPRequestEntityTooLarge:  # a body sent without its length
            gate.counts["too_large"] += 1
            return _error(413, too_large_body)
        except TimeoutError:
            gate.counts["too_slow"] += 1
            slow = _error(
                408,
                f"the request body did not arrive within {limits.read_timeout_s} s "
                "(--read-timeout-s)",
            )
            slow.force_close()
            return slow
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

    app = web.Application(
        client_max_size=limits.max_body_bytes, middlewares=[_deadline_of_request, _json_errors]
    )
    app[GATE] = gate
    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/score", score)
    app.router.add_get("/health", health)
    return app


def check_token(token: str, where: str) -> None:
    """Raise ConfigError (one sentence naming ``where``) for a token too short to keep."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{where} has {len(token)} characters; use at least {MIN_TOKEN_CHARS}, e.g. from "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'."
        )


async def listen(runner: web.AppRunner, host: str, port: int) -> asyncio.Server:
    """Serve ``runner``'s app (set up, from :func:`make_app`) on ``host:port`` until the
    returned server is closed, each connection held to the app's ``read_timeout_s``
    (:class:`_Deadline`): what a site would do, with the deadline. Port 0 picks a free one
    (``server.sockets[0].getsockname()[1]``)."""
    gate, server = runner.app[GATE], runner.server
    assert server is not None, "set the runner up first"

    def slow() -> None:
        gate.counts["too_slow"] += 1

    def connection() -> _Deadline:
        return _Deadline(server(), gate.limits.read_timeout_s, slow)

    loop = asyncio.get_running_loop()
    return await loop.create_server(connection, host, port, reuse_address=True)


async def serve(
    reward: str | RewardHook,
    host: str = "127.0.0.1",
    port: int = 8000,
    ready: Callable[[str], None] = print,
    options: dict[str, Any] | None = None,
    limits: ServerLimits | None = None,
    debug: bool = False,
    token: str | None = None,
) -> None:
    """Serve ``reward`` until SIGINT or SIGTERM; ``ready`` gets the score URL once listening.
    ``options``: keyword arguments for a reward that is a class (as a config's ``options``);
    ``limits``, ``debug`` and ``token`` as in :func:`make_app`.

    Port 0 picks a free port (the URL names it). Raises :class:`DigenError` with one sentence
    when the reward does not load, its setup fails, or the address cannot be bound.
    """
    if isinstance(reward, str):
        hook, name = load_hook(reward, options), reward
    else:
        hook, name = reward, getattr(reward, "__name__", type(reward).__name__)
    runner = web.AppRunner(make_app(hook, name, limits, debug, token), access_log=None)
    await runner.setup()  # the hook's setup(): a RewardError naming it when it fails
    listening: asyncio.Server | None = None
    try:
        try:
            listening = await listen(runner, host, port)
        except OSError as exc:  # asyncio's message repeats the address: say it once
            why = os.strerror(exc.errno).lower() if exc.errno else str(exc)
            raise DigenError(f"the reward server cannot listen on {host}:{port}: {why}.") from None
        bound = listening.sockets[0].getsockname()[1]
        shown = f"[{host}]" if ":" in host else host
        ready(f"http://{shown}:{bound}/score")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if listening is not None:
            listening.close()  # no new connections; the runner closes those open
        await runner.cleanup()
