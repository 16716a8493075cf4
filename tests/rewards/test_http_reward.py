"""The HTTP reward and the reference reward server, on loopback: same numbers as in-process,
every failure named with its URL, one keep-alive session, and the real `digen reward-server`."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import logging
import random
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from aiohttp import web
from click.testing import CliRunner
from helpers import free_port
from PIL import Image

from cli.main import main
from digen import DigenRunner
from digen.config import load_config
from digen.errors import ConfigError, RewardError
from digen.presets import preset
from digen.rewards.builtin import jpeg_incompressibility
from digen.rewards.hooks import load_hook
from digen.rewards.http import HttpReward, RequestTooLarge, decode_request, encode_request
from digen.rewards.server import GATE, ServerLimits, listen, make_app

ROOT = Path(__file__).resolve().parents[2]
JPEG = "jpeg_incompressibility"
TOKEN = "a-reward-token-for-the-tests"
TOKEN_VAR = "DIGEN_TEST_REWARD_TOKEN"
"""The environment variable the tests' http rewards read the token from (``token_env``)."""


def samples(batch: int = 6, frames: int = 1, size: int = 32, seed: int = 0) -> torch.Tensor:
    """Smooth gradients plus noise of growing strength: [B, F, H, W, 3] uint8, distinct scores."""
    g = torch.Generator().manual_seed(seed)
    ramp = torch.linspace(0, 200, size).view(1, 1, 1, size, 1)  # [1, 1, 1, W, 1]
    amount = torch.linspace(0, 60, batch).view(batch, 1, 1, 1, 1)  # [B, 1, 1, 1, 1]
    noise = torch.rand(batch, frames, size, size, 3, generator=g) * amount
    return (ramp + noise).clamp(0, 255).to(torch.uint8)


def texts(batch: int) -> tuple[list[str], list[dict]]:
    return [f"prompt {i}" for i in range(batch)], [{"i": i} for i in range(batch)]


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """``app`` on 127.0.0.1, a free port: yields its base URL. The server's own app (from
    ``make_app``) is served as ``digen reward-server`` serves it (``listen``: each connection
    held to its read timeout); any other app on a plain site."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    listening = None
    try:
        if GATE in app:
            listening = await listen(runner, "127.0.0.1", 0)
            port = listening.sockets[0].getsockname()[1]
        else:
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        if listening is not None:
            listening.close()
        await runner.cleanup()


def png_header(width: int, height: int, data: bytes = b"") -> str:
    """A base64 PNG whose header claims ``width`` x ``height`` over ``data`` (its IDAT)."""

    def chunk(kind: bytes, payload: bytes) -> bytes:
        crc = zlib.crc32(kind + payload)
        return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    return base64.b64encode(png).decode()


def png_request(images: list, batch: int | None = None) -> dict:
    batch = len(images) if batch is None else batch
    return {"format": "png", "prompts": ["a"] * batch, "metadata": [{}] * batch, "images": images}


async def _until(condition, what: str, within_s: float = 60.0) -> None:
    """Wait (generously: the suite runs on loaded machines) until ``condition()`` holds."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {within_s:g} s for {what}"
        await asyncio.sleep(0.01)


def one_sentence(error: str) -> None:
    assert error.endswith(".") and "\n" not in error and error.count(". ") == 0, error


# --------------------------------------------------------------------------- wire format


@pytest.mark.parametrize("fmt", ["png", "raw"])
@pytest.mark.parametrize("frames", [1, 3])
def test_lossless_formats_round_trip_exactly(fmt: str, frames: int) -> None:
    x = samples(3, frames)
    prompts, metadata = texts(3)
    body = json.loads(encode_request(x, prompts, metadata, fmt))
    if fmt == "png":  # an image is one base64 string, a video a list of F of them
        assert isinstance(body["images"][0], str if frames == 1 else list)
    y, p, m = decode_request(body)
    assert torch.equal(x, y) and (p, m) == (prompts, metadata)


def test_jpeg_is_lossy_in_transit_but_keeps_the_shape() -> None:
    x = samples(3, 2)
    y, _, _ = decode_request(json.loads(encode_request(x, *texts(3), "jpeg")))
    assert y.shape == x.shape and y.dtype == torch.uint8
    assert not torch.equal(x, y)
    error = (x.float() - y.float()).abs().mean(dim=(1, 2, 3, 4))  # [B]
    assert error[0] < 1 < error[-1]  # quality 95: close on a smooth sample, not on pixel noise


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ([1, 2], "must be a JSON object"),
        ({"format": "gif"}, "format 'gif' is not one of png, jpeg, raw"),
        ({"format": "png", "prompts": ["a"], "metadata": [{}], "images": ["%%"]}, "base64"),
        ({"format": "png", "prompts": ["a"], "metadata": [{}], "images": ["aGk="]}, "not a PNG"),
        (
            {"format": "raw", "prompts": ["a"], "metadata": [{}], "shape": [1, 1, 2, 2, 3],
             "dtype": "uint8", "data": "AAAA"},
            "data holds 3 bytes but shape [1, 1, 2, 2, 3] needs 12",
        ),
        (  # a header that reads well over pixel data that does not
            png_request([png_header(4, 4, b"not zlib")]),
            "images[0] is not a valid PNG or JPEG image (it cannot be decoded)",
        ),
        (  # a chunk checksum that does not match: PIL raises SyntaxError
            png_request([png_header(4, 4)[:-8] + "AAAAAAAA"]),
            "images[0] is not",
        ),
        (  # an image format other than PNG and JPEG is never handed to its decoder
            png_request([base64.b64encode(b"GIF89a" + bytes(20)).decode()]),
            "images[0] is not a PNG or JPEG image",
        ),
        ({"format": "raw", "prompts": [], "metadata": [], "shape": [True, 1, 1, 1, 3],
          "dtype": "uint8", "data": ""}, "is not [B, F, H, W, 3]"),
        (
            {"format": "raw", "prompts": [], "metadata": [], "shape": [1, 1, 1, 1, 3],
             "dtype": "uint8", "data": "AAAA"},
            "1 samples but 0 prompts",
        ),
    ],
)  # fmt: skip
def test_malformed_requests_are_named(body, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        decode_request(body)


def gif() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="GIF")
    return base64.b64encode(buffer.getvalue()).decode()


def test_a_real_gif_is_refused_too() -> None:
    with pytest.raises(ValueError, match=r"^images\[0\] is not a PNG or JPEG image$"):
        decode_request(png_request([gif()]))


def test_limits_are_checked_on_the_headers_before_any_pixel_is_decoded() -> None:
    x = samples(3, frames=2)  # 3 x 2 x 32 x 32 = 6144 pixels
    body = json.loads(encode_request(x, *texts(3), "png"))
    y, _, _ = decode_request(body, max_samples=3, max_frames=2, max_pixels=6144)
    assert torch.equal(x, y)
    with pytest.raises(
        RequestTooLarge, match=r"has 6144 pixels .* over the server's limit of 6143;"
    ):
        decode_request(body, max_pixels=6143)
    with pytest.raises(RequestTooLarge, match=r"^the request has 3 samples, over .* limit of 2;"):
        decode_request(body, max_samples=2)
    with pytest.raises(RequestTooLarge, match=r"^a sample has 2 frames, over .* limit of 1$"):
        decode_request(body, max_frames=1)
    # A header claiming 9000 x 9000 over no pixel data: refused on its header alone (decoding
    # it would fail differently), and PIL's own bomb guard, past ours, is a 413 too.
    claims = png_request([png_header(9000, 9000)])
    with pytest.raises(RequestTooLarge, match=r"has 81000000 pixels"):
        decode_request(claims, max_pixels=1 << 26)
    with pytest.raises(ValueError, match="cannot be decoded") as err:
        decode_request(claims)
    assert not isinstance(err.value, RequestTooLarge)
    with pytest.raises(RequestTooLarge, match=r"^images\[0\] is larger than the server decodes"):
        decode_request(png_request([png_header(100_000, 100_000)]))
    raw = {"format": "raw", "prompts": ["a"], "metadata": [{}], "shape": [1, 2, 40_000, 40_000, 3],
           "dtype": "uint8", "data": "not even base64"}  # fmt: skip
    with pytest.raises(RequestTooLarge, match=r"has 3200000000 pixels"):
        decode_request(raw, max_pixels=1 << 26)


# --------------------------------------------------------------------------- config


def test_from_spec_needs_a_url_and_checks_its_options() -> None:
    def spec(url="http://127.0.0.1:1/score", **options):
        return SimpleNamespace(url=url, options=options)

    with pytest.raises(ConfigError, match=r"'rewards\.0\.url' is not set"):
        HttpReward.from_spec(spec(url=None), "rewards.0")
    with pytest.raises(ConfigError, match=r"'rewards\.N\.url' has value 'ftp://x'"):
        HttpReward.from_spec(spec(url="ftp://x"))
    with pytest.raises(ConfigError, match=r"'rewards\.N\.options\.format' has value 'gif'"):
        HttpReward.from_spec(spec(format="gif"))
    with pytest.raises(ConfigError, match=r"options\.concurrency' has value 0; use a whole"):
        HttpReward.from_spec(spec(concurrency=0))
    with pytest.raises(ConfigError, match=r"unknown config key 'rewards\.N\.options\.retry'"):
        HttpReward.from_spec(spec(retry=3))
    r = HttpReward.from_spec(spec(format="raw", concurrency=2, batch_size=3, request_timeout_s=5))
    assert (r.format, r.concurrency, r.batch_size, r.request_timeout_s) == ("raw", 2, 3, 5.0)
    assert r.max_response_bytes == 8 << 20
    r = HttpReward.from_spec(spec(max_response_bytes=4096, concurrency=None, batch_size=None))
    assert (r.max_response_bytes, r.concurrency, r.batch_size) == (4096, 4, None)


def test_token_env_names_a_variable_that_holds_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    def spec(**options):
        return SimpleNamespace(url="http://127.0.0.1:1/score", options=options)

    monkeypatch.delenv(TOKEN_VAR, raising=False)
    with pytest.raises(ConfigError) as err:
        HttpReward.from_spec(spec(token_env=TOKEN_VAR), "rewards.0")
    assert str(err.value) == (
        f"config key 'rewards.0.options.token_env' names {TOKEN_VAR}, which is not set in this "
        "process's environment; set it to the reward server's token."
    )
    with pytest.raises(ConfigError, match=r"token_env' has value 'a token'; name the environment"):
        HttpReward.from_spec(spec(token_env="a token"), "rewards.0")
    monkeypatch.setenv(TOKEN_VAR, f"  {TOKEN}\n")
    assert HttpReward.from_spec(spec(token_env=TOKEN_VAR)).token_env == TOKEN_VAR
    assert HttpReward.from_spec(spec(token_env=None)).token_env is None


@pytest.mark.parametrize("value", [None, 0, -1.5, float("inf"), "5"])
def test_a_request_timeout_cannot_be_turned_off(value) -> None:
    spec = SimpleNamespace(url="http://127.0.0.1:1/score", options={"request_timeout_s": value})
    says = (
        f"config key 'rewards.0.options.request_timeout_s' has value {value!r}; use a positive "
        "number of seconds (default 300); a request cannot wait without a limit."
    )
    with pytest.raises(ConfigError) as err:
        HttpReward.from_spec(spec, "rewards.0")
    assert str(err.value) == says
    with pytest.raises(ConfigError, match=r"^the http reward's request_timeout_s has value"):
        HttpReward("http://127.0.0.1:1/score", request_timeout_s=value)
    with pytest.raises(ConfigError, match=r"'rewards\.0\.options\.max_response_bytes' has value 0"):
        HttpReward.from_spec(
            SimpleNamespace(url=spec.url, options={"max_response_bytes": 0}), "rewards.0"
        )


def test_reward_http_url_shorthand_replaces_the_rewards() -> None:
    over = ["rewards.1={name: jpeg_compressibility}", "reward.http.url=http://h:8000/score"]
    cfg = load_config(overrides=over)
    assert [(r.name, r.url, r.weight) for r in cfg.rewards] == [("http", "http://h:8000/score", 1)]


# --------------------------------------------------------------------------- client <-> server


@pytest.mark.asyncio
@pytest.mark.parametrize("fmt", ["png", "raw", "jpeg"])
async def test_http_reward_equals_the_in_process_reward(fmt: str) -> None:
    x = samples(7, frames=2)
    prompts, metadata = texts(7)
    want = jpeg_incompressibility(x, prompts, metadata).tolist()
    async with serving(make_app(load_hook(JPEG), JPEG)) as base:
        # 7 samples, 3 a request, 2 in flight: three requests put back in sample order
        reward = HttpReward(f"{base}/score", format=fmt, concurrency=2, batch_size=3)
        await reward.setup()
        try:
            got = await reward(x, prompts, metadata)
        finally:
            await reward.close()
    assert reward.statistics() == {"requests": 3, "failed": 0, "sessions": 1}
    if fmt == "jpeg":  # the server scores the decoded JPEG, not the original pixels
        assert got != want and got == pytest.approx(want, rel=0.1)
    else:
        assert got == want  # bit for bit: lossless pixels, float64 through JSON


@pytest.mark.asyncio
async def test_setup_opens_one_keep_alive_session_for_every_call() -> None:
    peers: list[int] = []

    @web.middleware
    async def record(request, handler):
        peers.append(request.transport.get_extra_info("peername")[1])  # client port
        return await handler(request)

    app = make_app(load_hook(JPEG), JPEG)
    app.middlewares.append(record)
    async with serving(app) as base:
        reward = HttpReward(f"{base}/score", concurrency=1, batch_size=2)
        await reward.setup()
        try:
            for seed in range(3):
                await reward(samples(4, seed=seed), *texts(4))
        finally:
            await reward.close()
    assert len(peers) == 6 and len(set(peers)) == 1  # six requests, one TCP connection
    assert reward.statistics()["sessions"] == 1


@pytest.mark.asyncio
async def test_server_answers_health_and_400_and_runs_the_hooks_lifecycle() -> None:
    class Counted:
        def __init__(self) -> None:
            self.calls = {"setup": 0, "close": 0}

        async def setup(self) -> None:
            self.calls["setup"] += 1

        def close(self) -> None:
            self.calls["close"] += 1

        def __call__(self, samples, prompts, metadata):
            return [float(len(p)) for p in prompts]

    hook = Counted()
    async with serving(make_app(hook, "counted")) as base, aiohttp.ClientSession() as http:
        assert hook.calls == {"setup": 1, "close": 0}
        async with http.get(f"{base}/health") as r:
            assert r.status == 200 and await r.json() == {"status": "ok", "reward": "counted"}
        async with http.post(f"{base}/score", data=b"{not json") as r:
            assert r.status == 400 and "not JSON" in (await r.json())["error"]
        async with http.post(f"{base}/score", json={"format": "gif"}) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error.endswith("format 'gif' is not one of png, jpeg, raw.")
        # a path or method it does not serve: JSON too, naming what it serves
        async with http.get(f"{base}/") as r:
            assert (r.status, await r.json()) == (
                404,
                {"error": "no / here: this server serves POST /score and GET /health."},
            )
        async with http.get(f"{base}/score") as r:
            assert (r.status, r.headers["Allow"]) == (405, "POST")
            assert await r.json() == {"error": "/score takes POST, not GET."}
        assert await HttpReward(f"{base}/score")(samples(2), ["a", "bcd"], [{}, {}]) == [1.0, 3.0]
    assert hook.calls == {"setup": 1, "close": 1}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/fails", r"answered HTTP 500: reward 'boom' raised ValueError: no model loaded\."),
        (
            "/quiet",
            r"answered HTTP 500: reward 'boom' failed; the reward server's log has the "
            r"details\.$",
        ),
        ("/odd", r"answered HTTP 500: reward 'odd' returned str, not one number per sample\."),
        ("/garbage", r"answered with something that is not JSON: '<html>oops</html>'\."),
        ("/short", r"returned 1 rewards for 2 samples\."),
        ("/slow", r"did not answer within 0\.3 s \(options\.request_timeout_s\)\."),
        ("/missing", r"answered HTTP 404: '404: Not Found'\."),
        (  # the server's root (a URL without a path): where the endpoint is, said
            "",
            r"answered HTTP 404: '404: Not Found'; the endpoint of digen reward-server is "
            r"/score, as in http://127\.0\.0\.1:\d+/score\.$",
        ),
    ],
)
async def test_every_failure_raises_one_sentence_naming_the_url(path: str, says: str) -> None:
    def boom(samples, prompts, metadata):
        raise ValueError("no model loaded")

    async def slow(request):
        await asyncio.sleep(1)  # the server waits for it when it stops
        return web.json_response({"rewards": [0.0, 0.0]})

    def answer(text: str):
        async def handler(request):
            return web.Response(text=text)

        return handler

    app = web.Application()
    app.add_subapp("/fails", make_app(boom, "boom", debug=True))
    app.add_subapp("/quiet", make_app(boom, "boom"))
    app.add_subapp("/odd", make_app(lambda samples, prompts, metadata: "high", "odd"))
    app.router.add_post("/garbage", answer("<html>oops</html>"))
    app.router.add_post("/short", answer('{"rewards": [1.0]}'))
    app.router.add_post("/slow", slow)
    async with serving(app) as base:
        url = f"{base}{path}" + ("/score" if path in ("/fails", "/quiet", "/odd") else "")
        # only /slow may time out: every other answer must be read, however loaded the machine
        reward = HttpReward(url, request_timeout_s=0.3 if path == "/slow" else 60.0)
        with pytest.raises(RewardError, match=re.escape(f"reward server {url} ") + says) as err:
            await reward(samples(2), *texts(2))
    assert "\n" not in str(err.value)
    assert reward.statistics()["failed"] == 1


@pytest.mark.asyncio
async def test_a_server_that_is_down_is_named() -> None:
    url = f"http://127.0.0.1:{free_port()}/score"
    reward = HttpReward(url)
    await reward.setup()
    try:
        with pytest.raises(
            RewardError,
            match=rf"^reward server {re.escape(url)} cannot be reached \(connection refused\)\.$",
        ):
            await reward(samples(2), *texts(2))
    finally:
        await reward.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("streamed", [False, True])
async def test_an_answer_over_max_response_bytes_is_refused(streamed: bool) -> None:
    async def huge(request):
        body = json.dumps({"rewards": [1.0, 2.0], "padding": "x" * 5000}).encode()
        if not streamed:
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse()  # chunked: no length to check up front
        await response.prepare(request)
        for i in range(0, len(body), 100):
            await response.write(body[i : i + 100])
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/score", huge)
    async with serving(app) as base:
        url = f"{base}/score"
        small = HttpReward(url, max_response_bytes=1000, request_timeout_s=60)
        with pytest.raises(RewardError) as err:
            await small(samples(2), *texts(2))
        assert str(err.value) == (
            f"reward server {url} answered with more than 1000 bytes (options.max_response_bytes)."
        )
        assert small.statistics()["failed"] == 1
        roomy = HttpReward(url, max_response_bytes=6000, request_timeout_s=60)
        assert await roomy(samples(2), *texts(2)) == [1.0, 2.0]


@pytest.mark.asyncio
async def test_a_token_guards_scoring_and_is_checked_before_the_body_is_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    app = make_app(load_hook(JPEG), JPEG, token=TOKEN)
    gate = app[GATE]
    x = samples(2)
    body = encode_request(x, *texts(2), "raw")
    needs = (
        "this reward server needs a bearer token: send Authorization: Bearer <token> (the "
        "http reward's options.token_env names the variable that holds it)."
    )
    refused = [
        ({}, needs),
        ({"Authorization": f"Basic {TOKEN}"}, needs),
        ({"Authorization": "Bearer "}, needs),
        (
            {"Authorization": f"Bearer {TOKEN}x"},
            "the bearer token sent is not this reward server's.",
        ),
    ]
    async with serving(app) as base, aiohttp.ClientSession() as http:
        for headers, says in refused:
            async with http.post(f"{base}/score", data=body, headers=headers) as r:
                assert (r.status, r.headers["WWW-Authenticate"]) == (401, "Bearer")
                assert (await r.json())["error"] == says
        async with http.get(f"{base}/health") as r:  # health stays open
            assert r.status == 200
        # refused on its headers: the body it announces is never sent, nor waited for
        reader, writer = await asyncio.open_connection("127.0.0.1", int(base.rsplit(":", 1)[1]))
        writer.write(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n")
        assert (await asyncio.wait_for(reader.readline(), 60)).startswith(b"HTTP/1.1 401 ")
        writer.close()
        # the http reward sends the token its token_env names; without one it is refused
        monkeypatch.setenv(TOKEN_VAR, TOKEN)
        guarded = HttpReward(f"{base}/score", format="raw", token_env=TOKEN_VAR)
        assert await guarded(x, *texts(2)) == jpeg_incompressibility(x, *texts(2)).tolist()
        with pytest.raises(RewardError) as err:
            await HttpReward(f"{base}/score", format="raw")(x, *texts(2))
        assert str(err.value) == f"reward server {base}/score answered HTTP 401: {needs}"
    stats = gate.statistics()
    assert (stats["unauthorized"], stats["scored"]) == (len(refused) + 2, 1)


async def _end_of(reader: asyncio.StreamReader) -> bytes:
    """What the server sent on a connection until it ended it (a reset ends it too)."""
    try:
        return await asyncio.wait_for(reader.read(), 60)  # a backstop: the server ends it
    except ConnectionResetError:
        return b""


@pytest.mark.asyncio
async def test_a_client_too_slow_to_send_its_request_is_dropped_and_frees_its_slot() -> None:
    """Headers that never end, then a body that never ends while it holds the only slot,
    then a connection that sends nothing: the first two are dropped (the body with a 408)
    and counted, the request waiting behind the slow body is scored, the idle one is closed
    as a kept-alive one would be."""
    app = make_app(load_hook(JPEG), JPEG, ServerLimits(max_concurrent=1, read_timeout_s=3))
    gate = app[GATE]
    x = samples(2)
    async with serving(app) as base:
        port = int(base.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /score HTTP/1.1\r\nHost: x\r\n")
        assert await _end_of(reader) == b""
        assert gate.statistics()["too_slow"] == 1

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
        writer.write(head + b'{"format": ')
        await _until(lambda: gate.statistics()["inside"] == 1, "the slow body to hold the slot")
        behind = asyncio.create_task(HttpReward(f"{base}/score", format="raw")(x, *texts(2)))
        await _until(lambda: gate.statistics()["waiting"] == 1, "a request to wait behind it")
        answer = await _end_of(reader)
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {
            "error": "the request body did not arrive within 3 s (--read-timeout-s)."
        }
        assert await behind == jpeg_incompressibility(x, *texts(2)).tolist()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await _end_of(reader) == b""
    stats = gate.statistics()
    assert (stats["too_slow"], stats["scored"], stats["inside"]) == (2, 1, 0)


def test_server_limits_are_checked_in_one_sentence() -> None:
    assert ServerLimits().max_body_bytes == 256 << 20
    with pytest.raises(ConfigError) as err:
        ServerLimits(max_pixels=0)
    assert str(err.value) == (
        "the reward server's max_pixels (--max-pixels) has value 0; use a whole number of at "
        "least 1."
    )
    with pytest.raises(ConfigError, match=r"max_queued \(--max-queued\) has value 2\.5"):
        ServerLimits(max_queued=2.5)


class Held:
    """A plain reward that blocks its thread until released, counting calls at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = self.most = 0

    def __call__(self, samples, prompts, metadata):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            assert self.release.wait(120), "the test never released the reward"
            return [0.5] * len(prompts)
        finally:
            with self.lock:
                self.running -= 1


@pytest.mark.asyncio
async def test_the_server_scores_max_concurrent_at_once_queues_max_queued_and_refuses_more() -> (
    None
):
    hook = Held()
    app = make_app(hook, "held", ServerLimits(max_concurrent=2, max_queued=1))
    gate = app[GATE]
    body = encode_request(samples(2), *texts(2), "raw")
    async with serving(app) as base, aiohttp.ClientSession() as http:

        async def post() -> tuple[int, dict]:
            async with http.post(f"{base}/score", data=body) as r:
                return r.status, await r.json()

        held = [asyncio.create_task(post()) for _ in range(3)]
        try:
            await _until(
                lambda: hook.running == 2 and gate.statistics()["waiting"] == 1,
                "two requests in the reward and one waiting",
            )
            status, answer = await post()
            assert status == 429
            assert answer["error"] == (
                "the server is busy with 2 requests and 1 waiting (--max-concurrent 2, "
                "--max-queued 1); try again later."
            )
        finally:
            hook.release.set()
        assert await asyncio.gather(*held) == [(200, {"rewards": [0.5, 0.5]})] * 3
    assert hook.most == 2
    stats = gate.statistics()
    assert (stats["scored"], stats["busy"], stats["inside"], stats["waiting"]) == (3, 1, 0, 0)


@pytest.mark.asyncio
async def test_hostile_requests_get_400_or_413_in_one_sentence_and_the_server_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def boom(samples, prompts, metadata):
        raise ValueError("secret path /srv/models/judge.pt not found")

    limits = ServerLimits(max_body_mib=1, max_samples=4, max_frames=3, max_pixels=20_000)
    app = make_app(load_hook(JPEG), JPEG, limits)
    app.add_subapp("/boom", make_app(boom, "boom"))
    over = b"x" * ((1 << 20) + 1)

    async def chunked():  # no Content-Length: the limit is met while reading
        for i in range(0, len(over), 1 << 16):
            yield over[i : i + (1 << 16)]

    deep = ("[" * 100_000 + "]" * 100_000).encode()
    cases = [
        (over, 413, "the request body is over the server's limit of 1 MiB;"),
        (chunked, 413, "the request body is over the server's limit of 1 MiB;"),
        (png_request([png_header(100_000, 100_000)]), 413, "larger than the server decodes"),
        (png_request([png_header(200, 101)]), 413, "has 20200 pixels (samples x frames x"),
        (png_request([png_header(20, 20)] * 5), 413, "has 5 samples, over the server's limit"),
        (png_request([[png_header(2, 2)] * 4]), 413, "a sample has 4 frames, over"),
        (png_request([png_header(4, 4, b"not zlib")]), 400, "it cannot be decoded"),
        (png_request([gif()]), 400, "images[0] is not a PNG or JPEG image"),
        (deep, 400, "malformed request: its JSON is nested too deeply"),
        (b'{"format": "\xff\xfe"}', 400, "malformed request: its body is not UTF-8 text."),
        (b'{"shape": [' + b"9" * 5000 + b"]}", 400, "its JSON holds a number too long to read."),
        (b"{not json", 400, "the request body is not JSON"),
    ]
    async with serving(app) as base, aiohttp.ClientSession() as http:
        for body, status, says in cases:
            data = body() if callable(body) else body
            data = json.dumps(data).encode() if isinstance(data, dict) else data
            data = io.BytesIO(data) if isinstance(data, bytes) else data  # a length, no copy
            async with http.post(f"{base}/score", data=data) as r:
                error = (await r.json())["error"]
                assert (r.status, says in error) == (status, True), (says, error)
                one_sentence(error)
        with caplog.at_level(logging.ERROR, logger="digen.rewards.server"):
            async with http.post(
                f"{base}/boom/score", data=encode_request(samples(2), *texts(2))
            ) as r:
                error = (await r.json())["error"]
        assert r.status == 500
        assert error == "reward 'boom' failed; the reward server's log has the details."
        assert "secret path" in caplog.text  # the detail is in the log, not in the answer
        assert await HttpReward(f"{base}/score")(samples(1, size=16), *texts(1)) == (
            jpeg_incompressibility(samples(1, size=16), *texts(1)).tolist()
        )
    stats = app[GATE].statistics()
    assert (stats["too_large"], stats["malformed"], stats["scored"]) == (6, 6, 1)


def _mutated(rng: random.Random, good: list[dict]) -> bytes:
    """A request a careless or hostile client might send: a valid one, damaged at random."""
    body = json.loads(json.dumps(rng.choice(good)))
    kind = rng.randrange(6)
    if kind in (0, 5):  # damage the bytes of one frame
        frames, f = body["images"][rng.randrange(2)], rng.randrange(2)
        png = bytearray(base64.b64decode(frames[f]))
        for _ in range(rng.randint(1, 6)):
            png[rng.randrange(len(png))] = rng.randrange(256)
        if rng.random() < 0.3:
            png = png[: rng.randrange(len(png))]
        frames[f] = base64.b64encode(bytes(png)).decode()
    elif kind == 1:  # a field of the wrong kind
        odd = [None, -1, 2**70, "x", [], [[]], {}, 1.5, True, ["AAAA"], [[png_header(9, 9)]]]
        body[rng.choice(list(body))] = rng.choice(odd)
    elif kind == 2:  # a raw request with a random shape
        shape = [rng.choice([0, 1, 2, 9])] + [rng.choice([0, 1, 3, 10**6]) for _ in range(3)]
        shape.append(rng.choice([3, 4]))
        body = {"format": "raw", "prompts": ["a"] * shape[0], "metadata": [{}] * shape[0],
                "shape": shape, "dtype": "uint8", "data": "AAAA"}  # fmt: skip
    text = bytearray(json.dumps(body).encode())
    if kind == 3:  # damage the JSON itself
        for _ in range(rng.randint(1, 4)):
            text[rng.randrange(len(text))] = rng.randrange(256)
    elif kind == 4:
        text = text[: rng.randrange(len(text))]
    return bytes(text)


@pytest.mark.asyncio
async def test_fuzzed_requests_never_get_a_500_and_every_refusal_is_one_sentence() -> None:
    """200 damaged PNG, JPEG and raw requests, seeded: each is scored, or refused 400 / 413
    in one sentence, and none reaches the catch-all for errors nobody named."""
    rng = random.Random(7)
    limits = ServerLimits(max_samples=8, max_pixels=1 << 16)
    app = make_app(load_hook(JPEG), JPEG, limits)
    x = samples(2, frames=2, size=16)
    good = [json.loads(encode_request(x, *texts(2), fmt)) for fmt in ("png", "jpeg")]
    statuses: dict[int, int] = {}
    async with serving(app) as base, aiohttp.ClientSession() as http:
        for _ in range(200):
            async with http.post(f"{base}/score", data=_mutated(rng, good)) as r:
                answer = await r.json()
            statuses[r.status] = statuses.get(r.status, 0) + 1
            if r.status == 200:
                assert len(answer["rewards"]) in (0, 1, 2, 3)
            else:
                assert r.status in (400, 413), answer
                assert "it could not be decoded" not in answer["error"]  # the catch-all's
                one_sentence(answer["error"])
        async with http.get(f"{base}/health") as r:
            assert r.status == 200
    assert set(statuses) == {200, 400, 413}, statuses  # every path was taken
    stats = app[GATE].statistics()
    assert stats["scored"] + stats["malformed"] + stats["too_large"] == 200
    assert (stats["scored"], stats["too_large"]) == (statuses.get(200, 0), statuses.get(413, 0))


# --------------------------------------------------------------------------- the real command


@contextlib.contextmanager
def cli_process(*args: str, stderr: list[str] | None = None) -> Iterator[str]:
    """A real `digen reward-server ARGS --port 0` process on 127.0.0.1: yields its score URL;
    ``stderr`` gets what it wrote there once it stopped."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "reward-server", *args, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+/score) ", line)
        assert found, line + proc.stderr.read()
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    if stderr is not None:
        stderr.append(err)
    assert proc.returncode == 0, err  # a clean stop: the hook's close() ran


@pytest.fixture(scope="module")
def cli_server() -> Iterator[str]:
    """A real `digen reward-server --reward jpeg_incompressibility --port 0` process: yields
    its score URL."""
    with cli_process("--reward", JPEG) as url:
        yield url


@pytest.mark.asyncio
async def test_the_cli_server_scores_like_the_in_process_reward(cli_server: str) -> None:
    x = samples(5)
    reward = HttpReward(cli_server, format="raw")
    await reward.setup()
    try:
        got = await reward(x, *texts(5))
    finally:
        await reward.close()
    assert got == jpeg_incompressibility(x, *texts(5)).tolist()
    health = cli_server.replace("/score", "/health")
    async with aiohttp.ClientSession() as http, http.get(health) as r:
        assert await r.json() == {"status": "ok", "reward": JPEG}


def test_cli_bad_input_is_one_sentence_and_exit_2(cli_server: str) -> None:
    taken = cli_server.rsplit(":", 1)[1].split("/")[0]
    for reward, port, says, *more in (
        (JPEG, taken, f"cannot listen on 127.0.0.1:{taken}: address already in use."),
        ("nope", "0", "reward 'nope' is neither a built-in"),
        (JPEG, "0", "max_samples (--max-samples) has value 0; use a whole", "--max-samples", "0"),
        (JPEG, "0", "max_body_mib (--max-body-mib) has value -1;", "--max-body-mib", "-1"),
        (JPEG, "0", "read_timeout_s (--read-timeout-s) has value 0;", "--read-timeout-s", "0"),
    ):
        args = ["reward-server", "--reward", reward, "--port", port, *more]
        res = CliRunner().invoke(main, args)
        assert res.exit_code == 2 and says in res.stderr, res.output
        assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1


def test_cli_bad_token_is_one_sentence_and_exit_2(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_text("abc\n")
    for more, env, says in (
        (["--token-file", str(tmp_path / "absent")], {}, "cannot be read: no such file"),
        (["--token-file", str(short)], {}, f"--token-file '{short}' has 3 characters; use at"),
        ([], {"DIGEN_REWARD_TOKEN": "short"}, "the environment variable DIGEN_REWARD_TOKEN has 5"),
    ):
        args = ["reward-server", "--reward", JPEG, "--port", "0", *more]
        res = CliRunner().invoke(main, args, env=env)
        assert res.exit_code == 2 and says in res.stderr, res.output
        assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1


@pytest.mark.asyncio
async def test_the_cli_server_takes_a_token_file_and_drops_slow_clients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    x = samples(3)
    want = jpeg_incompressibility(x, *texts(3)).tolist()
    args = ["--reward", JPEG, "--token-file", str(token_file), "--read-timeout-s", "3"]
    with cli_process(*args) as url:
        monkeypatch.setenv(TOKEN_VAR, TOKEN)
        assert await HttpReward(url, format="raw", token_env=TOKEN_VAR)(x, *texts(3)) == want
        with pytest.raises(RewardError, match=r"HTTP 401: this reward server needs a bearer token"):
            await HttpReward(url, format="raw")(x, *texts(3))
        monkeypatch.setenv(TOKEN_VAR, TOKEN[::-1])
        with pytest.raises(RewardError, match=r"HTTP 401: the bearer token sent is not this"):
            await HttpReward(url, format="raw", token_env=TOKEN_VAR)(x, *texts(3))
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /score HTTP/1.1\r\nHost: x\r\n")  # and nothing more
        assert await _end_of(reader) == b""


_FAILING_HOOK = """
def judge(samples, prompts, metadata):
    if prompts[0] == "fail":
        raise ValueError("no model loaded")
    return [0.25] * len(prompts)
"""


@pytest.mark.asyncio
async def test_the_cli_passes_its_limits_and_debug_to_the_server(tmp_path: Path) -> None:
    hook = tmp_path / "judge.py"
    hook.write_text(_FAILING_HOOK)
    stderr: list[str] = []
    limits = ["--max-samples", "2", "--max-pixels", "5000", "--max-body-mib", "1"]
    cases = [
        (samples(3, size=8), ["a"] * 3, 413, "has 3 samples, over the server's limit of 2;"),
        (samples(2, size=64), ["a"] * 2, 413, "the request has 8192 pixels"),
        (samples(1, size=16), ["fail"], 500, f"{hook}:judge' raised ValueError: no model loaded."),
    ]
    with cli_process("--reward", f"{hook}:judge", *limits, "--debug", stderr=stderr) as url:
        async with aiohttp.ClientSession() as http:
            for x, prompts, status, says in cases:
                body = encode_request(x, prompts, [{}] * len(prompts))
                async with http.post(url, data=body) as r:
                    error = (await r.json())["error"]
                assert (r.status, says in error) == (status, True), error
            async with http.post(url, data=io.BytesIO(b" " * ((1 << 20) + 1))) as r:
                assert r.status == 413
        assert await HttpReward(url)(samples(2, size=16), ["a", "b"], [{}, {}]) == [0.25, 0.25]
    # the detail goes to the server's log too, with its traceback
    assert "ValueError: no model loaded" in stderr[0] and "Traceback" in stderr[0]


def test_a_run_scored_through_the_server_equals_one_scored_in_process(
    cli_server: str, tmp_path: Path
) -> None:
    over = ["rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=4", "steps=1"]
    results = []
    for name, extra in (("local", []), ("remote", [f"reward.http.url={cli_server}"])):
        cfg = load_config(base=preset("flux", "flowgrpo"), overrides=[*over, *extra])
        runner = DigenRunner(cfg, out_dir=tmp_path / name, progress=False, save_weights=False)
        results.append(asyncio.run(runner.run()))
    local, remote = results
    assert remote.metrics[0]["reward_mean"] == local.metrics[0]["reward_mean"]
    assert remote.metrics[0]["reward/http"] == local.metrics[0][f"reward/{JPEG}"]
    assert local.final_state.keys() == remote.final_state.keys()
    for key, value in local.final_state.items():
        assert torch.equal(remote.final_state[key], value), key
    assert any(float(v.abs().max()) > 0 for k, v in local.final_state.items() if "lora_B" in k)


@pytest.mark.asyncio
async def test_the_server_builds_a_class_reward_with_its_options(tmp_path: Path) -> None:
    from digen.rewards.server import serve

    hook = tmp_path / "scaled.py"
    hook.write_text(
        "class Scaled:\n"
        "    def __init__(self, factor=1.0):\n"
        "        self.factor = factor\n"
        "    def __call__(self, samples, prompts, metadata):\n"
        "        return [self.factor] * len(prompts)\n"
    )
    urls: list[str] = []
    server = asyncio.create_task(
        serve(f"{hook}:Scaled", "127.0.0.1", 0, urls.append, {"factor": 3.5})
    )
    try:
        while not urls:
            assert not server.done(), server.exception()
            await asyncio.sleep(0.01)
        reward = HttpReward(urls[0], format="raw")
        await reward.setup()
        try:
            assert await reward(samples(2), *texts(2)) == [3.5, 3.5]
        finally:
            await reward.close()
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server
    res = CliRunner().invoke(main, ["reward-server", "--reward", JPEG, "--options", "[1, 2]"])
    assert res.exit_code == 2 and res.stderr.startswith("error: --options must be a mapping")
