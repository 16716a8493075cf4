"""HTTP reward: score samples on a reward server, so a heavy reward model can live elsewhere.

The client (:class:`HttpReward`, config name ``http``) and the reference server
(:mod:`digen.reward_server`) share the wire format below through the four functions of this
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
(400: a malformed request; 500: the reward failed).

Guarantees: ``setup()`` opens one keep-alive ``aiohttp.ClientSession`` for the run (at most
``concurrency`` connections); a call sends its requests concurrently, at most ``concurrency``
in flight, and returns B floats in sample order. Every failure (server unreachable, an HTTP
error status, a request timeout, a body that is not the JSON above, a wrong count) raises a
:class:`~digen.errors.RewardError` whose one sentence names the URL; a failure is never a
score. Whole calls are not retried here: the reward runner's ``timeout_s`` / ``retries`` do.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import math
import numbers
import os
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
    "decode_request",
    "decode_response",
    "encode_request",
    "encode_response",
]

FORMATS = ("png", "jpeg", "raw")
JPEG_QUALITY = 95
DEFAULT_REQUEST_TIMEOUT_S = 300.0
_OPTIONS = ("format", "concurrency", "batch_size", "request_timeout_s")


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


def _decode_frame(text: Any, where: str) -> np.ndarray:
    try:
        with Image.open(io.BytesIO(_b64(text, where))) as image:
            return np.asarray(image.convert("RGB"))  # [H, W, 3]
    except (UnidentifiedImageError, OSError):
        raise ValueError(f"{where} is not a PNG or JPEG image") from None


def decode_request(body: Any) -> tuple[torch.Tensor, list[str], list[dict[str, Any]]]:
    """``(samples [B, F, H, W, 3] uint8, prompts, metadata)`` from a parsed request body.

    Raises ValueError with one sentence (no closing period) naming what is malformed.
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
    if fmt == "raw":
        shape, dtype = body.get("shape"), body.get("dtype")
        if dtype != "uint8":
            raise ValueError(f"dtype {dtype!r} is not supported; send uint8")
        if (
            not isinstance(shape, list)
            or len(shape) != 5
            or not all(isinstance(n, int) and n >= 0 for n in shape)
            or shape[-1] != 3
        ):
            raise ValueError(f"shape {shape!r} is not [B, F, H, W, 3]")
        data = _b64(body.get("data"), "data")
        if len(data) != math.prod(shape):
            raise ValueError(
                f"data holds {len(data)} bytes but shape {shape} needs {math.prod(shape)}"
            )
        array = np.frombuffer(data, dtype=np.uint8).reshape(shape)  # [B, F, H, W, 3]
    else:
        images = body.get("images")
        if not isinstance(images, list):
            raise ValueError("images must be a list with one entry per sample")
        samples = []
        for i, entry in enumerate(images):
            frames = entry if isinstance(entry, list) else [entry]
            if not frames:
                raise ValueError(f"images[{i}] has no frames")
            decoded = [_decode_frame(f, f"images[{i}]") for f in frames]
            samples.append(decoded)
        for i, frames in enumerate(samples):
            if len(frames) != len(samples[0]) or any(
                f.shape != samples[0][0].shape for f in frames
            ):
                raise ValueError(f"images[{i}] differs from images[0] in size or frame count")
        array = np.stack([np.stack(s) for s in samples]) if samples else np.zeros((0, 1, 0, 0, 3))
        array = array.astype(np.uint8, copy=False)  # [B, F, H, W, 3]
    batch = array.shape[0]
    if len(prompts) != batch or len(metadata) != batch:
        raise ValueError(
            f"the request has {batch} samples but {len(prompts)} prompts and "
            f"{len(metadata)} metadata objects"
        )
    return torch.from_numpy(array.copy()), prompts, metadata


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


def _option(key: str, options: Mapping[str, Any], name: str, default: Any) -> Any:
    """An integer option of at least 1, or a positive number of seconds; None keeps the default
    behaviour (the whole batch in one request, no time limit)."""
    value = options.get(name, default)
    seconds = name.endswith("_s")
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or value <= 0
        or (not seconds and value != int(value))
    ):
        what = "a positive number of seconds" if seconds else "a whole number of at least 1"
        raise ConfigError(f"config key '{key}.options.{name}' has value {value!r}; use {what}.")
    return float(value) if seconds else int(value)


class HttpReward:
    """A reward hook that posts samples to a reward server and returns its B scores."""

    def __init__(
        self,
        url: str,
        *,
        format: str = "png",  # noqa: A002 -- the option's name in the config
        concurrency: int = 4,
        batch_size: int | None = None,
        request_timeout_s: float | None = DEFAULT_REQUEST_TIMEOUT_S,
    ) -> None:
        """``url``: the server's score endpoint (``http://host:port/score``); the rest as the
        options of :meth:`from_spec`."""
        self.url = url
        self.format = format
        self.concurrency = concurrency
        self.batch_size = batch_size
        self.request_timeout_s = request_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of setup()
        self._limit = asyncio.Semaphore(concurrency)  # requests in flight through _session
        self._stats = {"requests": 0, "failed": 0, "sessions": 0}

    @classmethod
    def from_spec(cls, spec: Any, key: str = "rewards.N") -> HttpReward:
        """Build from a config :class:`~digen.config.RewardSpec` (``key``: its config key).

        ``spec.url`` is required; ``spec.options`` may set ``format`` (png, jpeg or raw;
        default png), ``concurrency`` (requests in flight, default 4), ``batch_size`` (samples
        per request, default the whole batch) and ``request_timeout_s`` (default 300).
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
        return cls(
            str(url),
            format=fmt,
            concurrency=_option(key, options, "concurrency", 4) or 4,
            batch_size=_option(key, options, "batch_size", None),
            request_timeout_s=_option(key, options, "request_timeout_s", DEFAULT_REQUEST_TIMEOUT_S),
        )

    def _new_session(self) -> aiohttp.ClientSession:
        self._stats["sessions"] += 1
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.concurrency),
            timeout=aiohttp.ClientTimeout(total=self.request_timeout_s),
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
            raise RewardError(
                f"reward server {self.url} answered HTTP {status}: {_error_text(raw)}."
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
                return response.status, await response.read()
        except TimeoutError:
            limit = self.request_timeout_s
            within = f"within {limit:g} s (options.request_timeout_s)" if limit else "in time"
            raise RewardError(f"reward server {self.url} did not answer {within}.") from None
        except aiohttp.ClientConnectorError as exc:
            err = exc.os_error  # asyncio's text repeats the address; errno says it plainly
            reason = os.strerror(err.errno).lower() if (err.errno or 0) > 0 else err.strerror or err
            raise RewardError(f"reward server {self.url} cannot be reached ({reason}).") from exc
        except aiohttp.ClientError as exc:
            raise RewardError(
                f"reward server {self.url} failed: {type(exc).__name__}: {exc or 'no detail'}."
            ) from exc


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
