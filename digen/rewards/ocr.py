"""OCR reward: how closely the text read off a sample matches the quoted text in its prompt.

Flow-GRPO's text-rendering reward (``flow_grpo/ocr.py``), offline: the engine is RapidOCR
(``rapidocr-onnxruntime``: PP-OCRv4 detection and recognition run by onnxruntime on CPU;
its wheel ships the models, so nothing downloads). Install it with ``pip install digen[ocr]``
and name the reward ``ocr`` (short for ``digen.rewards.ocr:OcrReward``).

For a prompt ``A storefront sign that says "OPEN LATE"``:

* target: the first ``"..."`` span of the prompt (``OPEN LATE``); a prompt with no such span,
  or one holding only spaces, is an error, never a silent zero;
* recognised: every text line RapidOCR reads with confidence >= 0.5, joined in reading order
  (top to bottom, left to right);
* normalisation, as Flow-GRPO's: both lowercased, with whitespace removed;
* distance: 0 when the target occurs inside the recognised text (Flow-GRPO's rule: extra
  text elsewhere in the image costs nothing), else the Levenshtein distance;
* reward = ``1 - min(1, distance / len(target))`` in ``[0, 1]``; a video's reward is the mean
  over its frames.
"""

from __future__ import annotations

import asyncio
import importlib.util
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["OcrReward", "edit_distance", "normalise", "target_text", "text_reward"]

INSTALL_HINT = (
    "the OCR reward needs rapidocr-onnxruntime, which is not installed; "
    "run `pip install digen[ocr]`."
)
MIN_CONFIDENCE = 0.5
"""RapidOCR's default (and PaddleOCR's ``drop_score``): lines read less surely are dropped."""

_QUOTED = re.compile(r'"([^"]*)"')


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance: the fewest single-character insertions, deletions and
    substitutions that turn ``a`` into ``b``."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))  # distances from a[:0] to each prefix of b
    for i, ca in enumerate(a, start=1):
        current = [i]
        for j, cb in enumerate(b, start=1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def normalise(text: str) -> str:
    """Lowercased, with all whitespace removed (Flow-GRPO lowercases and drops spaces)."""
    return "".join(text.split()).lower()


def target_text(prompt: str) -> str:
    """The text the image should show: the first ``"..."`` span of ``prompt``."""
    match = _QUOTED.search(prompt)
    if match is None:
        raise ValueError(
            f'prompt {prompt!r} has no text in double quotes ("...") for the OCR reward to read.'
        )
    if not normalise(match.group(1)):
        raise ValueError(f"prompt {prompt!r} quotes no text for the OCR reward to read.")
    return match.group(1)


def text_reward(recognised: str, target: str) -> float:
    """``1 - min(1, distance / len(target))`` on normalised text; 1.0 when the target occurs
    within the recognised text."""
    read, want = normalise(recognised), normalise(target)
    if not want:
        raise ValueError(f"target text {target!r} is empty once whitespace is removed.")
    distance = 0 if want in read else edit_distance(read, want)
    return 1.0 - min(1.0, distance / len(want))


class OcrReward:
    """Reward hook ``(samples [B, F, H, W, 3] uint8, prompts, metadata) -> B floats in [0, 1]``.

    The engine loads once, in :meth:`setup` or else on the first call; one instance may be
    called from several threads.
    """

    def __init__(self) -> None:
        # Only look for the package here, so a missing extra fails when the reward is built.
        if importlib.util.find_spec("rapidocr_onnxruntime") is None:
            raise ImportError(INSTALL_HINT)
        self._engine: Any = None
        self._lock = threading.Lock()

    async def setup(self) -> None:
        """Load the OCR engine (its models ship in the wheel; under a second on CPU)."""
        await asyncio.to_thread(self._load)

    async def close(self) -> None:
        """Drop the engine; a later call loads it again."""
        self._engine = None

    def _load(self) -> Any:
        with self._lock:
            if self._engine is None:
                try:
                    from rapidocr_onnxruntime import RapidOCR
                except ImportError as exc:
                    raise ImportError(INSTALL_HINT) from exc
                # As Flow-GRPO's PaddleOCR: no angle classifier (use_angle_cls=False), and the
                # detector shrinks only images over 960 px (RapidOCR's default enlarges every
                # image to 736 px on its short side: 5-10x slower, and it misreads gaps).
                self._engine = RapidOCR(
                    use_cls=False,
                    text_score=MIN_CONFIDENCE,
                    det_limit_type="max",
                    det_limit_side_len=960,
                )
            return self._engine

    def read(self, image: np.ndarray) -> str:
        """Every line of text RapidOCR reads in ``image`` ``[H, W, 3]`` uint8 RGB, joined
        with spaces in reading order ("" when it finds none)."""
        engine = self._load()
        bgr = np.ascontiguousarray(image[..., ::-1])  # RapidOCR takes arrays as OpenCV BGR
        lines, _ = engine(bgr)
        return " ".join(line[1] for line in lines or [])

    def __call__(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> list[float]:
        if len(prompts) != samples.shape[0]:
            raise ValueError(f"got {samples.shape[0]} samples but {len(prompts)} prompts.")
        targets = [target_text(p) for p in prompts]  # a bad prompt fails before any OCR
        frames = samples.detach().cpu().numpy()  # [B, F, H, W, 3]
        return [
            float(np.mean([text_reward(self.read(frame), target) for frame in clip]))
            for clip, target in zip(frames, targets)
        ]
