"""OCR reward: edit distance and quote parsing by hand, RapidOCR on text drawn by PIL."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from importlib import resources

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from digen.errors import RewardError
from digen.prompts import PromptSet
from digen.rewards import ocr
from digen.rewards.hooks import load_hook
from digen.rewards.ocr import OcrReward, edit_distance, normalise, target_text, text_reward
from digen.rewards.scoring import build_reward

PROMPTS = [
    'A storefront sign that says "OPEN LATE"',
    'A wooden signpost in a forest pointing to "Bear Lake"',
    'A hotel key card printed with "Room 42"',
]
WRONG = ["CLOSED NOW", "Fish Market", "Exit Only"]


def drawn(text: str, w: int = 320, h: int = 112) -> np.ndarray:
    """``text`` in dark ink on a light card: [H, W, 3] uint8 RGB."""
    image = Image.new("RGB", (w, h), (250, 245, 230))
    font = ImageFont.load_default(size=36)
    ImageDraw.Draw(image).text((w // 2, h // 2), text, fill=(20, 20, 60), font=font, anchor="mm")
    return np.asarray(image)


def batch(*frames: np.ndarray) -> torch.Tensor:
    """One sample per frame: [B, 1, H, W, 3] uint8."""
    return torch.from_numpy(np.stack(frames))[:, None]


@pytest.fixture(scope="module")
def reward() -> Iterator[OcrReward]:
    hook = OcrReward()
    asyncio.run(hook.setup())
    yield hook
    asyncio.run(hook.close())


# --------------------------------------------------------------------------- pure parts


@pytest.mark.parametrize(
    ("a", "b", "distance"),
    [
        ("", "", 0),
        ("abc", "", 3),
        ("", "abc", 3),
        ("openlate", "openlate", 0),
        ("kitten", "sitting", 3),  # k->s, e->i, +g
        ("flaw", "lawn", 2),  # -f, +n
        ("abc", "acb", 2),  # no transpositions: two substitutions
        ("room42", "ro0m42", 1),
        ("sunday", "saturday", 3),  # +a, +t, n->r
    ],
)
def test_edit_distance_by_hand(a: str, b: str, distance: int) -> None:
    assert edit_distance(a, b) == distance
    assert edit_distance(b, a) == distance


def test_target_is_the_first_quoted_span() -> None:
    assert target_text(PROMPTS[0]) == "OPEN LATE"
    assert target_text('A mug with "Hi" on one side and "Bye" on the other') == "Hi"
    assert target_text('"Dream Big" on a wall') == "Dream Big"


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        ("A storefront sign at night", "has no text in double quotes"),
        ('A sign that says "OPEN LATE', "has no text in double quotes"),  # never closed
        ('A blank sign ""', "quotes no text"),
        ('A blank sign "   "', "quotes no text"),
    ],
)
def test_a_prompt_without_quoted_text_is_refused(prompt: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        target_text(prompt)
    message = str(info.value)
    assert repr(prompt) in message and "\n" not in message and message.endswith(".")


def test_text_reward_normalises_like_flow_grpo() -> None:
    assert normalise(" Open  Late\t") == "openlate"
    assert text_reward("open late", "OPEN LATE") == 1.0  # case and spaces do not count
    assert text_reward("OPENLATE", "OPEN LATE") == 1.0
    assert text_reward("24h OPEN LATE daily", "OPEN LATE") == 1.0  # target inside the text
    assert text_reward("OPEN LATF", "OPEN LATE") == pytest.approx(1 - 1 / 8)
    assert text_reward("OPEN", "OPEN LATE") == pytest.approx(1 - 4 / 8)
    assert text_reward("", "OPEN LATE") == 0.0
    assert text_reward("a much longer unrelated line", "OPEN LATE") == 0.0  # capped at 0


def test_the_prompt_set_has_a_target_in_every_prompt() -> None:
    path = resources.files("digen.data").joinpath("ocr_prompts.txt")
    prompts = PromptSet.load(str(path)).prompts
    assert PromptSet.load("ocr").prompts == prompts  # the shipped set by its name
    assert 40 <= len(prompts) <= 100
    assert len(set(prompts)) == len(prompts)
    targets = [target_text(p) for p in prompts]
    assert all(t.isascii() and 1 <= len(t) <= 20 for t in targets)


def test_a_missing_engine_is_one_sentence_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ocr.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RewardError, match=r"pip install digen\[ocr\]") as info:
        load_hook("digen.rewards.ocr:OcrReward")
    assert "\n" not in str(info.value)


# --------------------------------------------------------------------------- RapidOCR


def test_right_text_scores_near_one_and_wrong_text_low(reward: OcrReward) -> None:
    # Measured: right 1.0, 1.0, 1.0 (read exactly); wrong 0.11, 0.30, 0.125.
    samples = batch(*(drawn(target_text(p)) for p in PROMPTS))
    right = reward(samples, PROMPTS, [{}] * 3)
    wrong = reward(samples, [f'A sign that says "{w}"' for w in WRONG], [{}] * 3)
    assert min(right) >= 0.8
    assert max(wrong) <= 0.5


def test_a_blank_image_scores_zero_and_a_video_scores_its_mean_frame(reward: OcrReward) -> None:
    blank = np.full((112, 320, 3), 250, dtype=np.uint8)
    assert reward.read(blank) == ""
    video = torch.from_numpy(np.stack([drawn("OPEN LATE"), blank]))[None]  # [1, 2, H, W, 3]
    assert reward(video, PROMPTS[:1], [{}]) == [pytest.approx(0.5)]


def test_a_config_name_builds_a_reward_that_loads_its_engine_lazily() -> None:
    samples = batch(drawn("Bear Lake"), drawn("Fish Market"))
    for name in ("digen.rewards.ocr:OcrReward", "ocr"):  # the short name is the same class
        composite = build_reward([name])
        assert isinstance(composite.fns[0].fn, OcrReward)
        result = composite.score_sync(samples, PROMPTS[1:2] * 2)
        scores = result.components[name].tolist()
        assert scores[0] >= 0.8 and scores[1] <= 0.5
