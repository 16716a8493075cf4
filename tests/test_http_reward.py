"""The HTTP reward and the reference reward server, on loopback: same numbers as in-process,
every failure named with its URL, one keep-alive session, and the real `digen reward-server`."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
import torch
from aiohttp import web
from click.testing import CliRunner

from cli.main import main
from digen import DigenRunner
from digen.algos.http_reward import HttpReward, decode_request, encode_request
from digen.algos.rewards import jpeg_incompressibility, load_hook
from digen.config import load_config
from digen.errors import ConfigError, RewardError
from digen.presets import preset
from digen.reward_server import make_app

ROOT = Path(__file__).resolve().parents[1]
JPEG = "jpeg_incompressibility"


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
    """``app`` on 127.0.0.1, a free port: yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            {"format": "raw", "prompts": [], "metadata": [], "shape": [1, 1, 2, 2, 3],
             "dtype": "uint8", "data": "AAAA"},
            "data holds 3 bytes but shape [1, 1, 2, 2, 3] needs 12",
        ),
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
        assert await HttpReward(f"{base}/score")(samples(2), ["a", "bcd"], [{}, {}]) == [1.0, 3.0]
    assert hook.calls == {"setup": 1, "close": 1}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/fails", r"answered HTTP 500: reward 'boom' raised ValueError: no model loaded\."),
        ("/odd", r"answered HTTP 500: reward 'odd' returned str, not one number per sample\."),
        ("/garbage", r"answered with something that is not JSON: '<html>oops</html>'\."),
        ("/short", r"returned 1 rewards for 2 samples\."),
        ("/slow", r"did not answer within 0\.3 s \(options\.request_timeout_s\)\."),
        ("/missing", r"answered HTTP 404: '404: Not Found'\."),
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
    app.add_subapp("/fails", make_app(boom, "boom"))
    app.add_subapp("/odd", make_app(lambda samples, prompts, metadata: "high", "odd"))
    app.router.add_post("/garbage", answer("<html>oops</html>"))
    app.router.add_post("/short", answer('{"rewards": [1.0]}'))
    app.router.add_post("/slow", slow)
    async with serving(app) as base:
        url = f"{base}{path}" + ("/score" if path in ("/fails", "/odd") else "")
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


# --------------------------------------------------------------------------- the real command


@pytest.fixture(scope="module")
def cli_server() -> Iterator[str]:
    """A real `digen reward-server --reward jpeg_incompressibility --port 0` process: yields
    its score URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "cli.main", "reward-server", "--reward", JPEG, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        found = re.search(r"on (http://\S+/score) ", line)
        assert found, line + proc.stderr.read()
        yield found.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err  # a clean stop: the hook's close() ran


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
    for reward, port, says in (
        (JPEG, taken, f"cannot listen on 127.0.0.1:{taken}: address already in use."),
        ("nope", "0", "reward 'nope' is neither a built-in"),
    ):
        res = CliRunner().invoke(main, ["reward-server", "--reward", reward, "--port", port])
        assert res.exit_code == 2 and says in res.stderr, res.output
        assert res.stderr.startswith("error: ") and res.stderr.count("\n") == 1


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
    from digen.reward_server import serve

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
