"""Rewards: JPEG built-ins against PIL, hooks from files and modules, weights, errors."""

from __future__ import annotations

import asyncio
import inspect
import io
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from digen.config import RewardSpec
from digen.errors import RewardError
from digen.registry.rewards import BUILTIN_REWARDS
from digen.rewards.builtin import jpeg_compressibility, jpeg_incompressibility, jpeg_size_kb
from digen.rewards.hooks import load_hook, resolve
from digen.rewards.scoring import CompositeReward, RewardFn, RewardResult, build_reward

H = W = 64


def flat(value: int = 128, frames: int = 1) -> torch.Tensor:
    """One constant gray sample: [1, F, H, W, 3] uint8."""
    return torch.full((1, frames, H, W, 3), value, dtype=torch.uint8)


def noise(seed: int = 0, frames: int = 1) -> torch.Tensor:
    """One sample of uniform random pixels: [1, F, H, W, 3] uint8."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, frames, H, W, 3), generator=g, dtype=torch.uint8)


def pil_kb(frame: torch.Tensor) -> float:
    """Size in kB of PIL's own JPEG (quality 95) of one [H, W, 3] frame."""
    buffer = io.BytesIO()
    Image.fromarray(frame.numpy()).save(buffer, format="JPEG", quality=95)
    return len(buffer.getvalue()) / 1000


def one_sentence(message: str) -> None:
    assert "\n" not in message
    assert message.endswith(".")


# --------------------------------------------------------------------------- built-ins


def test_jpeg_rewards_prefer_detail_and_match_pil() -> None:
    samples = torch.cat([flat(), noise()])  # [2, 1, H, W, 3]
    inc = jpeg_incompressibility(samples, ["a", "b"], [{}, {}])
    comp = jpeg_compressibility(samples, ["a", "b"], [{}, {}])
    assert inc[1] > 3 * inc[0]  # noise is far harder to compress than a flat gray
    assert torch.equal(comp, -inc)
    assert inc[0].item() == pytest.approx(pil_kb(samples[0, 0]), abs=1e-12)
    assert inc[1].item() == pytest.approx(pil_kb(samples[1, 0]), abs=1e-12)


def test_jpeg_video_is_mean_over_frames() -> None:
    video = torch.cat([flat(frames=1), noise(frames=1), noise(seed=1, frames=1)], dim=1)
    assert video.shape == (1, 3, H, W, 3)
    expected = sum(pil_kb(video[0, f]) for f in range(3)) / 3
    assert jpeg_size_kb(video).item() == pytest.approx(expected, abs=1e-12)


def test_samples_must_be_uint8_frames() -> None:
    with pytest.raises(ValueError, match="uint8"):
        jpeg_size_kb(torch.zeros(1, 1, H, W, 3))
    with pytest.raises(ValueError, match=r"\[B, F, H, W, 3\]"):
        jpeg_size_kb(torch.zeros(1, H, W, 3, dtype=torch.uint8))


@pytest.mark.parametrize("name", list(BUILTIN_REWARDS))
def test_each_builtin_name_is_a_config_name_that_builds_its_reward(name: str) -> None:
    builtin = BUILTIN_REWARDS[name]
    spec = RewardSpec(name=name, url="http://127.0.0.1:1/score" if name == "http" else None)
    target = resolve(builtin.target)
    if builtin.built_from == "name":  # a function: loaded by name, and it scores
        assert load_hook(name) is target
        scores = build_reward([spec]).score_sync(torch.cat([flat(), noise()]), ["a", "b"])
        assert torch.isfinite(scores.components[name]).all()
    elif builtin.built_from == "options":  # a class, built with the entry's options
        assert inspect.isclass(target)
        inspect.signature(target.__call__).bind(None, "samples", "prompts", "metadata")
    else:  # a server's client, built from the entry's url
        assert isinstance(build_reward([spec]).fns[0].fn, target)
        with pytest.raises(RewardError, match=f"reward '{name}' needs its server's URL"):
            load_hook(name)


# --------------------------------------------------------------------------- hooks


HOOK_SOURCE = textwrap.dedent(
    """
    import torch

    def mean_pixel(samples, prompts, metadata):
        return samples.float().mean(dim=(1, 2, 3, 4)) / 255

    def prompt_length(samples, prompts, metadata):
        return [float(len(p)) for p in prompts]

    async def bonus(samples, prompts, metadata):
        return tuple(m.get("bonus", 0.0) for m in metadata)

    class Scorer:
        def __init__(self):
            self.offset = 10.0

        def __call__(self, samples, prompts, metadata):
            return [self.offset] * samples.shape[0]

    not_a_function = 3

    def too_few(samples):
        return [0.0]
    """
)


@pytest.fixture
def hook_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(HOOK_SOURCE)
    return path


@pytest.fixture
def hook_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    package = tmp_path / "site" / "rewardpkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "hooks.py").write_text(HOOK_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    return "rewardpkg.hooks"


def batch() -> tuple[torch.Tensor, list[str], list[dict]]:
    samples = torch.cat([flat(0), flat(255)])  # mean pixel 0.0 and 1.0
    return samples, ["ab", "abcd"], [{"bonus": 0.5}, {}]


@pytest.mark.asyncio
async def test_hook_from_file_path(hook_file: Path) -> None:
    reward = build_reward([(f"{hook_file}:mean_pixel", 1.0), (f"{hook_file}:Scorer", 1.0)])
    result = await reward(*batch())
    assert isinstance(result, RewardResult)
    assert result.components[f"{hook_file}:mean_pixel"].tolist() == [0.0, 1.0]
    assert result.components[f"{hook_file}:Scorer"].tolist() == [10.0, 10.0]


@pytest.mark.asyncio
async def test_hook_from_module_path(hook_module: str) -> None:
    reward = build_reward(
        [
            RewardSpec(name=f"{hook_module}:prompt_length", weight=1.0),
            RewardSpec(name=f"{hook_module}:bonus", weight=1.0),
        ]
    )
    result = await reward(*batch())
    assert result.components[f"{hook_module}:prompt_length"].tolist() == [2.0, 4.0]
    assert result.components[f"{hook_module}:bonus"].tolist() == [0.5, 0.0]


@pytest.mark.asyncio
async def test_weighted_combination() -> None:
    async def length(samples, prompts, metadata):
        return np.array([len(p) for p in prompts], dtype=np.int64)

    reward = build_reward([("jpeg_incompressibility", 0.5), (length, -2.0)])
    samples, prompts, metadata = batch()
    result = await reward(samples, prompts, metadata)
    kb = jpeg_size_kb(samples).float()
    assert list(result.components) == ["jpeg_incompressibility", "length"]
    assert result.total.dtype == torch.float32 and result.total.shape == (2,)
    assert torch.equal(result.components["jpeg_incompressibility"], kb)
    assert result.components["length"].tolist() == [2.0, 4.0]
    assert torch.allclose(result.total, 0.5 * kb - 2.0 * torch.tensor([2.0, 4.0]))


def test_score_sync_without_a_loop() -> None:
    reward = build_reward([(lambda s, p, m: [1.0] * len(p), 3.0)])
    result = reward.score_sync(*batch())
    assert result.total.tolist() == [3.0, 3.0]
    assert reward.names == ["<lambda>"]
    assert build_reward(["jpeg_compressibility"]).fns[0].weight == 1.0


def test_bare_callable_and_reward_fn() -> None:
    def ones(samples, prompts, metadata):
        return [1.0] * len(prompts)

    reward = build_reward([ones, RewardFn("twice", ones, 2.0)])
    assert reward.names == ["ones", "twice"]
    assert reward.score_sync(*batch()).total.tolist() == [3.0, 3.0]


@pytest.mark.asyncio
async def test_hooks_run_concurrently() -> None:
    started = {"a": asyncio.Event(), "b": asyncio.Event()}

    def handshake(me: str, other: str):
        async def hook(samples, prompts, metadata):
            started[me].set()
            await started[other].wait()  # returns only if the other hook runs at the same time
            return [1.0] * len(prompts)

        hook.__name__ = me
        return hook

    reward = build_reward([(handshake("a", "b"), 1.0), (handshake("b", "a"), 1.0)])
    result = await asyncio.wait_for(reward(*batch()), timeout=5.0)
    assert result.total.tolist() == [2.0, 2.0]


@pytest.mark.asyncio
async def test_sync_hooks_run_off_the_event_loop() -> None:
    loop_thread = []

    def where(samples, prompts, metadata):
        import threading

        loop_thread.append(threading.current_thread() is threading.main_thread())
        return [0.0] * len(prompts)

    await build_reward([(where, 1.0)])(*batch())
    assert loop_thread == [False]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        (
            "no_such_module_xyz:fn",
            "reward hook 'no_such_module_xyz:fn' cannot be loaded: no module",
        ),
        ("/no/such/file.py:fn", "reward hook '/no/such/file.py:fn' cannot be loaded: file"),
        ("FILE:missing", "cannot be loaded: 'FILE' has no attribute 'missing'."),
        ("FILE:not_a_function", "reward hook 'FILE:not_a_function' is not callable (it is int)."),
        ("FILE:too_few", "reward hook 'FILE:too_few' must take (samples, prompts, metadata)"),
        ("unknown_builtin", "reward 'unknown_builtin' is neither a built-in"),
    ],
)
def test_load_errors(hook_file: Path, ref: str, expected: str) -> None:
    ref = ref.replace("FILE", str(hook_file))
    expected = expected.replace("FILE", str(hook_file))
    with pytest.raises(RewardError) as info:
        build_reward([(ref, 1.0)])
    assert expected in str(info.value)
    one_sentence(str(info.value))


def test_broken_module_file(tmp_path: Path) -> None:
    path = tmp_path / "broken.py"
    path.write_text("raise RuntimeError('no weights here')\n")
    with pytest.raises(RewardError, match="raised RuntimeError: no weights here.$"):
        load_hook(f"{path}:fn")


def _fails(samples, prompts, metadata):
    raise ValueError("boom")


@pytest.mark.parametrize(
    ("returned", "expected"),
    [
        ([1.0, 2.0, 3.0], "reward hook 'hook' returned 3 values for 2 samples."),
        ([1.0, float("nan")], "reward hook 'hook' returned a non-finite value (nan) for sample 1"),
        (torch.tensor([float("inf"), 0.0]), "returned a non-finite value (inf) for sample 0"),
        (["good", 1.0], "reward hook 'hook' returned a non-number ('good') for sample 0."),
        ([None, 1.0], "returned a non-number (None) for sample 0."),
        (1.0, "reward hook 'hook' returned float, not one number per sample"),
        ("ab", "reward hook 'hook' returned str, not one number per sample"),
        (torch.zeros(2, 1), "returned an array of shape [2, 1], not one number per sample (2)."),
        (np.array(["a", "b"]), "returned <U1 values, not real numbers."),
        ([1e39, 0.0], "returned a value too large for float32 (1e+39) for sample 0."),
    ],
)
@pytest.mark.asyncio
async def test_bad_return_values(returned: object, expected: str) -> None:
    reward = CompositeReward([RewardFn(name="hook", fn=lambda s, p, m: returned)])
    with pytest.raises(RewardError) as info:
        await reward(*batch())
    assert expected in str(info.value)
    one_sentence(str(info.value))


@pytest.mark.asyncio
async def test_hook_exception_is_wrapped(hook_module: str) -> None:
    reward = CompositeReward(
        [
            RewardFn(name="mymod:fn", fn=_fails),
            RewardFn(name=f"{hook_module}:bonus", fn=load_hook(f"{hook_module}:bonus")),
        ]
    )
    with pytest.raises(RewardError) as info:
        await reward(*batch())
    assert str(info.value) == "reward hook 'mymod:fn' raised ValueError: boom."
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.asyncio
async def test_async_hook_exception_is_wrapped() -> None:
    async def broken(samples, prompts, metadata):
        raise KeyError("score")

    with pytest.raises(RewardError, match=r"^reward hook 'broken' raised KeyError: 'score'\.$"):
        await build_reward([(broken, 1.0)])(*batch())


def test_build_errors() -> None:
    with pytest.raises(RewardError, match="no reward was given"):
        build_reward([])
    with pytest.raises(RewardError, match="'jpeg_compressibility' is given twice"):
        build_reward([("jpeg_compressibility", 1.0), ("jpeg_compressibility", 2.0)])
    with pytest.raises(RewardError, match="has weight nan, not a finite number"):
        build_reward([("jpeg_compressibility", math.nan)])


@pytest.mark.asyncio
async def test_prompt_count_must_match() -> None:
    samples, prompts, _ = batch()
    with pytest.raises(ValueError, match="got 2 samples but 1 prompts"):
        await build_reward([("jpeg_compressibility", 1.0)])(samples, prompts[:1])
