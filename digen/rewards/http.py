"""HTTP reward: score samples on a reward server, so a heavy reward model can live elsewhere.

The client (:class:`HttpReward`, config name ``http``) and the reference server
(:mod:`digen.rewards.server`) share the wire format below through the four functions of this
module (``encode_request`` / ``decode_request``, ``encode_response`` / ``decode_response``).

``POST <url>`` with a JSON body, one request per ``batch_size`` samples (B in a request)::

    {"format": "png",                   # png or jpeg (quality 95, lossy)
     "prompts": [B strings],
     "metadata": [B JSON objects],
     "images": [B entries]}             # one base64 image per sample when F = 1 (images);
                                        # a list of F base64 frames per sample when F > 1 (video)

    {"format": "raw", "prompts": [...], "metadata": [...],
     "shape": [B, F, H, W, 3], "dtype": "uint8",
     "data": "<base64 of the B*F*H*W*3 bytes, C order>"}

The answer is HTTP 200 with ``{"rewards": [B numbers]}`` (other keys, e.g. ``components``,
are ignored; NaN / Infinity pass through as Python's ``json`` writes them, so
``train.on_nonfinite`` decides), or an HTTP error status with ``{"error": "one sentence"}``
(400: a malformed request; 413: a request over the server's limits; 429: the server is
busy; 500: the reward failed).

:func:`decode_request` takes the server's limits (samples, frames a sample, pixels a request)
and checks them on the image headers, before any image is decoded.

Guarantees: ``setup()`` opens one keep-alive ``aiohttp.ClientSession`` for the run (at most
``concurrency`` connections); a call sends its requests concurrently, at most ``concurrency``
in flight, and returns B floats in sample order. Every request has a time limit
(``request_timeout_s``, never unlimited) and every answer a size limit
(``max_response_bytes``). Every failure (server unreachable, an HTTP error status, a request
timeout, an answer too large, a body that is not the JSON above, a wrong count) raises a
:class:`~digen.errors.RewardError` whose one sentence names the URL; a failure is never a
score. Whole calls are not retried here: the reward runner's ``timeout_s`` / ``retries`` do.

With ``token_env`` (the name of an environment variable, e.g. ``DIGEN_REWARD_TOKEN``) every
request carries ``Authorization: Bearer <its value>``, read in the scoring process when its
session opens: the token is never in the config, nor in what is pickled to a worker.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import io
import json
import math
import numbers
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
import numpy as np
import torch
import yarl
from PIL import Image, UnidentifiedImageError

from digen.errors import ConfigError, RewardError

__all__ = [
    "FORMATS",
    "HttpReward",
    "RequestTooLarge",
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_response",
]

FORMATS = ("png", "jpeg", "raw")
JPEG_QUALITY = 95
DEFAULT_REQUEST_TIMEOUT_S = 300.0
DEFAULT_MAX_RESPONSE_BYTES = 8 << 20
"""An answer is B numbers: 8 MiB is some 300k of them."""
_OPTIONS = (
    "format",
    "concurrency",
    "batch_size",
    "request_timeout_s",
    "max_response_bytes",
    "token_env",
)
_IMAGE_FORMATS = ("PNG", "JPEG")  # the only decoders PIL may pick for a request's images


class RequestTooLarge(ValueError):
    """A well-formed request over one of the server's limits (its answer is HTTP 413)."""


# --------------------------------------------------------------------------- wire format


def _encode_frame(frame: np.ndarray, fmt: str) -> str:
    buffer = io.BytesIO()
    if fmt == "png":  # lossless whatever the level; 1 is the fastest
        Image.fromarray(frame).save(buffer, format="PNG", compress_level=1)
    else:
        Image.fromarray(frame).save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_request(
    samples: torch.Tensor,
    prompts: Sequence[str],
    metadata: Sequence[Mapping[str, Any]],
    fmt: str = "png",
) -> bytes:
    """The JSON body scoring ``samples`` ``[B, F, H, W, 3]`` uint8 (see the module docstring)."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    array = np.ascontiguousarray(samples.detach().cpu().numpy())  # [B, F, H, W, 3]
    body: dict[str, Any] = {"format": fmt, "prompts": list(prompts), "metadata": list(metadata)}
    if fmt == "raw":
        body.update(
            shape=list(array.shape),
            dtype="uint8",
            data=base64.b64encode(array.tobytes()).decode("ascii"),
        )
    else:
        body["images"] = [
            _encode_frame(sample[0], fmt)
            if sample.shape[0] == 1
            else [_encode_frame(frame, fmt) for frame in sample]
            for sample in array
        ]
    try:
        return json.dumps(body).encode()
    except TypeError as exc:  # metadata the user filled with non-JSON values
        raise ValueError(f"the metadata cannot be sent as JSON ({exc})") from None


def _b64(text: Any, where: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{where} must be a base64 string, not {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{where} is not valid base64") from None


def _open_frame(text: Any, where: str) -> Image.Image:
    """The image of one base64 frame, opened lazily: its header read, no pixel decoded."""
    data = _b64(text, where)
    try:
        return Image.open(io.BytesIO(data), formats=_IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        # PIL's own guard (a warning it may be told to raise): past it, as past ours.
        raise RequestTooLarge(
            f"{where} is larger than the server decodes (over {Image.MAX_IMAGE_PIXELS} pixels)"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError, struct.error):
        raise ValueError(f"{where} is not a PNG or JPEG image") from None


def _decode_frame(image: Image.Image, where: str) -> np.ndarray:
    try:
        return np.asarray(image.convert("RGB"))  # [H, W, 3]
    except (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error):
        # A header that read well over data that does not (truncated, corrupt, bad checksum).
        raise ValueError(
            f"{where} is not a valid PNG or JPEG image (it cannot be decoded)"
        ) from None


def _check_limits(
    batch: int,
    frames: int,
    pixels: int,
    max_samples: int | None,
    max_frames: int | None,
    max_pixels: int | None,
) -> None:
    """RequestTooLarge when a request of ``batch`` samples, ``frames`` in its longest, and
    ``pixels`` in all is over a limit (None: no limit)."""
    hint = "; send fewer samples a request (the http reward's options.batch_size)"
    if max_samples is not None and batch > max_samples:
        raise RequestTooLarge(
            f"the request has {batch} samples, over the server's limit of {max_samples}{hint}"
        )
    if max_frames is not None and frames > max_frames:
        raise RequestTooLarge(
            f"a sample has {frames} frames, over the server's limit of {max_frames}"
        )
    if max_pixels is not None and pixels > max_pixels:
        raise RequestTooLarge(
            f"the request has {pixels} pixels (samples x frames x height x width), over the "
            f"server's limit of {max_pixels}{hint}"
        )


def decode_request(
    body: Any,
    *,
    max_samples: int | None = None,
    max_frames: int | None = None,
    max_pixels: int | None = None,
) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """``(samples [B, F, H, W, 3] uint8, prompts, metadata)`` from a parsed request body.

    ``max_samples`` (B), ``max_frames`` (F) and ``max_pixels`` (B x F x H x W) bound what is
    decoded: they are checked on the shape, or on the images' headers, before any pixel is.
    Raises :class:`RequestTooLarge` for a request over a limit and ValueError for a malformed
    one, each with one sentence (no closing period) naming what is wrong.
    """
    if not isinstance(body, dict):
        raise ValueError(f"the request must be a JSON object, not {type(body).__name__}")
    fmt = body.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS)}")
    prompts, metadata = body.get("prompts"), body.get("metadata")
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a list of strings")
    if not isinstance(metadata, list) or not all(isinstance(m, dict) for m in metadata):
        raise ValueError("metadata must be a list of JSON objects")
    limits = (max_samples, max_frames, max_pixels)
    if fmt == "raw":
        shape, dtype = body.get("shape"), body.get("dtype")
        if dtype != "uint8":
            raise ValueError(f"dtype {dtype!r} is not supported; send uint8")
        if (
            not isinstance(shape, list)
            or len(shape) != 5
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
            or shape[-1] != 3
        ):
            raise ValueError(f"shape {shape!r} is not [B, F, H, W, 3]")
        _check_counts(shape[0], prompts, metadata)
        _check_limits(shape[0], shape[1], math.prod(shape[:4]), *limits)
        data = _b64(body.get("data"), "data")
        if len(data) != math.prod(shape):
            raise ValueError(
                f"data holds {len(data)} bytes but shape {shape} needs {math.prod(shape)}"
            )
        array = np.frombuffer(data, dtype=np.uint8).reshape(shape).copy()  # [B, F, H, W, 3]
    else:
        images = body.get("images")
        if not isinstance(images, list):
            raise ValueError("images must be a list with one entry per sample")
        entries = [entry if isinstance(entry, list) else [entry] for entry in images]
        _check_counts(len(entries), prompts, metadata)
        for i, frames in enumerate(entries):
            if not frames:
                raise ValueError(f"images[{i}] has no frames")
        # Counts first (free), then every header (cheap), then the pixels.
        longest = max((len(frames) for frames in entries), default=0)
        _check_limits(len(entries), longest, 0, *limits)
        with contextlib.ExitStack() as opened:
            samples = []
            for i, frames in enumerate(entries):
                samples.append(
                    [opened.enter_context(_open_frame(f, f"images[{i}]")) for f in frames]
                )
            sizes = [[image.size for image in frames] for frames in samples]  # (W, H) each
            pixels = sum(w * h for frames in sizes for w, h in frames)
            _check_limits(len(entries), longest, pixels, *limits)
            for i, frames in enumerate(sizes):
                if len(frames) != len(sizes[0]) or any(size != sizes[0][0] for size in frames):
                    raise ValueError(f"images[{i}] differs from images[0] in size or frame count")
            width, height = sizes[0][0] if sizes else (0, 0)
            array = np.empty(
                (len(samples), len(sizes[0]) if sizes else 1, height, width, 3), np.uint8
            )
            for i, frames in enumerate(samples):  # array: [B, F, H, W, 3]
                for j, image in enumerate(frames):
                    array[i, j] = _decode_frame(image, f"images[{i}]")  # [H, W, 3]
    return torch.from_numpy(array), prompts, metadata


def _check_counts(batch: int, prompts: list[str], metadata: list[dict[str, Any]]) -> None:
    if len(prompts) != batch or len(metadata) != batch:
        raise ValueError(
            f"the request has {batch} samples but {len(prompts)} prompts and "
            f"{len(metadata)} metadata objects"
        )


def encode_response(rewards: Sequence[float]) -> dict[str, Any]:
    """The answer's JSON object for B scores."""
    return {"rewards": [float(r) for r in rewards]}


def decode_response(body: Any, batch: int) -> list[float]:
    """B floats from a parsed answer; ValueError (one clause, no period) says what is wrong."""
    rewards = body.get("rewards") if isinstance(body, dict) else None
    if not isinstance(rewards, list):
        raise ValueError('answered JSON without a "rewards" list')
    if len(rewards) != batch:
        raise ValueError(f"returned {len(rewards)} rewards for {batch} samples")
    for i, r in enumerate(rewards):
        if isinstance(r, bool) or not isinstance(r, numbers.Real):
            raise ValueError(f"returned a non-number ({r!r}) for sample {i}")
    return [float(r) for r in rewards]


# --------------------------------------------------------------------------- client


def _checked(name: str, value: Any, where: str) -> Any:
    """Option ``name``'s value if allowed: a whole number of at least 1 (``batch_size`` may be
    None: the whole batch in one request), or for ``request_timeout_s`` a positive, finite
    number of seconds (never None: no request waits without a limit). Else a ConfigError
    naming ``where`` (the config key, or the argument)."""
    seconds = name == "request_timeout_s"
    if value is None and name == "batch_size":
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
        or (not seconds and value != int(value))
    ):
        if seconds:
            what = (
                f"a positive number of seconds (default {DEFAULT_REQUEST_TIMEOUT_S:g}); "
                "a request cannot wait without a limit"
            )
        else:
            what = "a whole number of at least 1"
        raise ConfigError(f"{where} has value {value!r}; use {what}.")
    return float(value) if seconds else int(value)


def _bearer(variable: object, where: str) -> str:
    """The ``Authorization`` value from environment variable ``variable``; ConfigError (one
    sentence naming ``where``) when that is not a variable's name or it holds no token."""
    if not isinstance(variable, str) or not variable.replace("_", "a").isalnum():
        raise ConfigError(
            f"{where} has value {variable!r}; name the environment variable that holds the "
            "reward server's token, as in DIGEN_REWARD_TOKEN."
        )
    token = os.environ.get(variable, "").strip()
    if not token:
        raise ConfigError(
            f"{where} names {variable}, which is not set in this process's environment; set it "
            "to the reward server's token."
        )
    return f"Bearer {token}"


class HttpReward:
    """A reward hook that posts samples to a reward server and returns its B scores."""

    def __init__(
        self,
        url: str,
        *,
        format: str = "png",  # noqa: A002 -- the option's name in the config
        concurrency: int = 4,
        batch_size: int | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES,
        token_env: str | None = None,
    ) -> None:
        """``url``: the server's score endpoint (``http://host:port/score``); the rest as the
        options of :meth:`from_spec` (a bad value raises ConfigError naming the argument)."""
        self.url = url
        self.format = format
        self.token_env = token_env
        """The environment variable holding the server's bearer token (None: none sent)."""
        if token_env is not None:
            _bearer(token_env, "the http reward's token_env")  # set, and well formed, here
        checked = {
            name: _checked(name, value, f"the http reward's {name}")
            for name, value in (
                ("concurrency", concurrency),
                ("batch_size", batch_size),
                ("request_timeout_s", request_timeout_s),
                ("max_response_bytes", max_response_bytes),
            )
        }
        self.concurrency: int = checked["concurrency"]
        self.batch_size: int | None = checked["batch_size"]
        self.request_timeout_s: float = checked["request_timeout_s"]
        self.max_response_bytes: int = checked["max_response_bytes"]
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of setup()
        self._limit = asyncio.Semaphore(concurrency)  # requests in flight through _session
        self._stats = {"requests": 0, "failed": 0, "sessions": 0}

    @classmethod
    def from_spec(cls, spec: Any, key: str = "rewards.N") -> HttpReward:
        """Build from a config :class:`~digen.config.RewardSpec` (``key``: its config key).

        ``spec.url`` is required; ``spec.options`` may set ``format`` (png, jpeg or raw;
        default png), ``concurrency`` (requests in flight, default 4), ``batch_size`` (samples
        per request, default the whole batch), ``request_timeout_s`` (seconds a request may
        take, default 300; it cannot be turned off), ``max_response_bytes`` (the largest
        answer read, default 8 MiB) and ``token_env`` (the environment variable holding the
        server's bearer token, default none). A key set to null takes its default, except
        ``request_timeout_s``, which is refused.
        """
        url = spec.url
        if not url:
            raise ConfigError(
                f"config key '{key}.url' is not set; the http reward needs the reward server's "
                "URL, as in http://host:8000/score."
            )
        parsed = yarl.URL(str(url))
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ConfigError(
                f"config key '{key}.url' has value {url!r}; use an http:// or https:// URL, "
                "as in http://host:8000/score."
            )
        options = dict(spec.options or {})
        for name in options:
            if name not in _OPTIONS:
                raise ConfigError(
                    f"unknown config key '{key}.options.{name}'; the http reward has: "
                    f"{', '.join(_OPTIONS)}."
                )
        fmt = options.get("format", "png")
        if fmt not in FORMATS:
            raise ConfigError(
                f"config key '{key}.options.format' has value {fmt!r}; use one of "
                f"{', '.join(FORMATS)}."
            )
        defaults = {
            "concurrency": 4,
            "batch_size": None,
            "request_timeout_s": DEFAULT_REQUEST_TIMEOUT_S,
            "max_response_bytes": DEFAULT_MAX_RESPONSE_BYTES,
        }
        values = {}
        for name, default in defaults.items():
            value = options.get(name, default)
            if value is None and name != "request_timeout_s":
                value = default
            values[name] = _checked(name, value, f"config key '{key}.options.{name}'")
        token_env = options.get("token_env")
        if token_env is not None:
            _bearer(token_env, f"config key '{key}.options.token_env'")
        return cls(str(url), format=fmt, token_env=token_env, **values)

    def _new_session(self) -> aiohttp.ClientSession:
        headers = {}
        if self.token_env is not None:  # read here, in the process that sends
            headers["Authorization"] = _bearer(self.token_env, "the http reward's token_env")
        self._stats["sessions"] += 1
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.concurrency),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
            headers=headers,
        )

    async def setup(self) -> None:
        """Open the run's keep-alive session on the running event loop."""
        if self._session is None:
            self._session = self._new_session()
            self._loop = asyncio.get_running_loop()
            self._limit = asyncio.Semaphore(self.concurrency)

    async def close(self) -> None:
        """Close the session (and its connections)."""
        if self._session is not None:
            await self._session.close()
            self._session = self._loop = None

    def statistics(self) -> dict[str, int]:
        """Requests sent, requests that failed, sessions opened."""
        return dict(self._stats)

    async def __call__(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> list[float]:
        """Score ``samples`` ``[B, F, H, W, 3]`` uint8: B floats, in sample order."""
        batch = samples.shape[0]
        step = self.batch_size or max(batch, 1)
        spans = [(a, min(a + step, batch)) for a in range(0, batch, step)]
        if self._session is None:  # no setup(): a session for this call only
            async with self._new_session() as session:
                limit = asyncio.Semaphore(self.concurrency)
                return await self._post_all(session, limit, samples, prompts, metadata, spans)
        if asyncio.get_running_loop() is not self._loop:
            raise RewardError(
                f"the http reward for {self.url} was set up on another event loop than the "
                "one calling it; call setup() on the loop that scores."
            )
        return await self._post_all(self._session, self._limit, samples, prompts, metadata, spans)

    async def _post_all(
        self,
        session: aiohttp.ClientSession,
        limit: asyncio.Semaphore,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
        spans: list[tuple[int, int]],
    ) -> list[float]:
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(
                        self._post(session, limit, samples[a:b], prompts[a:b], metadata[a:b])
                    )
                    for a, b in spans
                ]
        except ExceptionGroup as failed:
            # The other requests were cancelled; surface the first failure's single sentence.
            raise failed.exceptions[0]  # noqa: B904 -- it carries its own cause
        return [score for task in tasks for score in task.result()]

    async def _post(
        self,
        session: aiohttp.ClientSession,
        limit: asyncio.Semaphore,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> list[float]:
        try:
            # Encoding is CPU work: off the event loop, which may be driving other things.
            body = await asyncio.to_thread(encode_request, samples, prompts, metadata, self.format)
        except ValueError as exc:
            raise RewardError(f"the http reward cannot send to {self.url}: {exc}.") from None
        # Wait for a slot before the request's clock starts (the pool would count the wait).
        async with limit:
            self._stats["requests"] += 1
            try:
                status, raw = await self._send(session, body)
                return self._read_answer(status, raw, samples.shape[0])
            except RewardError:
                self._stats["failed"] += 1
                raise

    def _read_answer(self, status: int, raw: bytes, batch: int) -> list[float]:
        if status != 200:
            hint = ""
            url = yarl.URL(self.url)
            if status == 404 and url.path in ("", "/"):  # the server's root, not its endpoint
                hint = f"; the endpoint of digen reward-server is /score, as in {url.with_path('/score')}"
            raise RewardError(
                f"reward server {self.url} answered HTTP {status}: {_error_text(raw)}{hint}."
            )
        try:
            answer = json.loads(raw)
        except ValueError:
            raise RewardError(
                f"reward server {self.url} answered with something that is not JSON: "
                f"{_snippet(raw)}."
            ) from None
        try:
            return decode_response(answer, batch)
        except ValueError as exc:
            raise RewardError(f"reward server {self.url} {exc}.") from None

    async def _send(self, session: aiohttp.ClientSession, body: bytes) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        try:
            async with session.post(self.url, data=body, headers=headers) as response:
                return response.status, await self._read(response)
        except TimeoutError:
            raise RewardError(
                f"reward server {self.url} did not answer within {self.request_timeout_s:g} s "
                "(options.request_timeout_s)."
            ) from None
        except aiohttp.ClientConnectorError as exc:
            err = exc.os_error  # asyncio's text repeats the address; errno says it plainly
            reason = os.strerror(err.errno).lower() if (err.errno or 0) > 0 else err.strerror or err
            raise RewardError(f"reward server {self.url} cannot be reached ({reason}).") from exc
        except aiohttp.ClientError as exc:
            raise RewardError(
                f"reward server {self.url} failed: {type(exc).__name__}: {exc or 'no detail'}."
            ) from exc

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        """The answer's body, refused past ``max_response_bytes`` (counted decompressed)."""
        limit = self.max_response_bytes
        too_large = RewardError(
            f"reward server {self.url} answered with more than {limit} bytes "
            "(options.max_response_bytes)."
        )
        if response.content_length is not None and response.content_length > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in response.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)


def _snippet(raw: bytes, limit: int = 120) -> str:
    text = raw.decode("utf-8", "replace").strip()
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _error_text(raw: bytes) -> str:
    """The server's ``{"error": ...}`` sentence, or the start of its body."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        error = None
    return str(error).rstrip(".") if error else _snippet(raw)
