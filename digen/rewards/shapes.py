"""Shapes reward: a GenEval-style judge of images of the shapes world (:mod:`digen.shapes`).

It reads only the image and its caption, in four steps:

* pixels: each is read as a mix of the background and one palette colour (the one whose
  line from the background passes nearest it in RGB); it is that colour when it is at least
  half colour and within ``max_colour_distance`` of the line, else background, so a soft
  edge is cut half-way and an unclear colour (grey, black, brown) is no object;
* objects: the connected components (4-neighbour) of each colour; a component smaller than
  ``min_area`` times the smallest object's box (a speck) is dropped;
* shape: a component whose box is at most ``max_aspect`` times longer one way than the other
  is the shape whose outline, drawn into that box as :func:`digen.shapes.render` draws it,
  overlaps it best (intersection over union), if that overlap is at least ``min_iou``; any
  other component keeps its colour but has no shape, and meets no requirement;
* its box and centre, which position captions compare.

The caption's requirements are then checked on those objects by GenEval's rule
(:func:`digen.shapes.check`): each named object is the most confident detection of its shape,
confidence being the outline's overlap (``iou``), then the area; strict (1.0 when every
requirement holds, else 0.0: GenEval's score) or partial (the fraction that hold). A video's score is the mean over its frames.
Sizes follow the image's side, so any resolution from 32 px reads the same.

Name the reward ``shapes`` (short for ``digen.rewards.shapes:ShapesReward``); its options are
``mode`` and the reader's thresholds. :func:`evaluate` and :func:`accuracy` are the
evaluation's side: per-sample strict scores and GenEval's per-category and overall accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch

from digen.rewards.hooks import check_samples
from digen.shapes import (
    BACKGROUND,
    CATEGORIES,
    PALETTE,
    SHAPES,
    CaptionSpec,
    Requirement,
    check,
    geometry,
    parse,
    shape_mask,
)

__all__ = [
    "MODES",
    "FoundObject",
    "ReadOptions",
    "SampleScore",
    "ShapesReward",
    "accuracy",
    "classify_pixels",
    "evaluate",
    "find_objects",
    "label_components",
]

MODES = ("partial", "strict")
"""``partial`` (the default: a graded signal, so a group of samples that all miss the strict
mark still gets advantages that point somewhere) or ``strict`` (GenEval's 0/1 score)."""

_COLOURS = tuple(PALETTE)
_BACKGROUND = np.array(BACKGROUND, dtype=np.float32)  # [3]
_LINES = np.array(list(PALETTE.values()), dtype=np.float32) - _BACKGROUND  # [K, 3]: to each colour
_LINE_LENGTHS2 = (_LINES**2).sum(-1)  # [K]


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadOptions:
    """How the reader turns pixels into objects."""

    max_colour_distance: float = 60.0
    """RGB distance from the line between the background and a palette colour beyond which
    a pixel is no mix of the two (:func:`classify_pixels`): a grey is 72 from green's line,
    black 185, a dull red (180, 70, 70) 45 from red's."""
    min_area: float = 0.25
    """Components smaller than this fraction of the smallest object's box are specks."""
    max_aspect: float = 1.4
    """Longer side / shorter side of a component's box beyond which it has no shape."""
    min_iou: float = 0.6
    """Overlap with the best-fitting outline below which a component has no shape."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"option {f.name} must be a number > 0, got {value!r}.")
        if self.max_aspect < 1:
            raise ValueError(f"option max_aspect must be at least 1, got {self.max_aspect!r}.")
        if self.min_iou > 1:
            raise ValueError(f"option min_iou must be at most 1, got {self.min_iou!r}.")


@dataclass(frozen=True, slots=True)
class FoundObject:
    """One component read off an image: its shape (None: no outline fits), colour and box."""

    shape: str | None
    colour: str
    left: int
    top: int
    width: int
    height: int
    area: int
    """Pixels in the component."""
    iou: float
    """Its overlap with its shape's outline (with the best outline when it has no shape)."""

    @property
    def x(self) -> float:
        return self.left + self.width / 2

    @property
    def y(self) -> float:
        return self.top + self.height / 2


def classify_pixels(frame: np.ndarray, max_colour_distance: float) -> np.ndarray:
    """``frame`` ``[H, W, 3]`` uint8 -> ``[H, W]`` int: the index of each pixel's palette
    colour in :data:`~digen.shapes.PALETTE`, or -1 for background and unclear colours.

    A pixel is read as a mix of the background and the palette colour whose line from the
    background (through every mix of the two, ending at the colour) passes nearest it. It
    is that colour when it lies at least half-way along that line and within
    ``max_colour_distance`` of it; otherwise it is background. So a soft edge is cut where
    it is half colour, and a half-red edge reads as red (its plain nearest colour is yellow).
    """
    towards = frame.astype(np.float32) - _BACKGROUND  # [H, W, 3]
    dots = towards @ _LINES.T  # [H, W, K]
    along = np.clip(dots / _LINE_LENGTHS2, 0.0, 1.0)  # [H, W, K]: 0 background, 1 the colour
    # squared distance to the nearest point of each line: |p - a v|^2, expanded
    d2 = (towards**2).sum(-1, keepdims=True) - 2 * along * dots + along**2 * _LINE_LENGTHS2
    nearest = d2.argmin(-1)[..., None]  # [H, W, 1]
    near = np.take_along_axis(d2, nearest, -1)[..., 0] <= max_colour_distance**2  # [H, W]
    colourful = np.take_along_axis(along, nearest, -1)[..., 0] >= 0.5
    return np.where(near & colourful, nearest[..., 0], -1)


def label_components(classes: np.ndarray) -> np.ndarray:
    """``[H, W]`` pixel classes (-1 background) -> ``[H, W]`` component labels: each pixel of
    a colour's 4-connected component gets the row-major index of the component's first
    pixel; background pixels get -1.

    Labels spread as minima across links between same-colour neighbours, and each round
    also jumps every label to its label's label, so rounds grow with the log of an object's
    width rather than with the width.
    """
    h, w = classes.shape
    fg = classes >= 0
    across = fg[:, :-1] & (classes[:, :-1] == classes[:, 1:])  # [H, W-1]: linked to the right
    down = fg[:-1] & (classes[:-1] == classes[1:])  # [H-1, W]: linked below
    labels = np.arange(h * w).reshape(h, w)  # every label names a pixel of its component
    while True:
        new = labels.copy()
        pair = np.minimum(labels[:, :-1], labels[:, 1:])  # [H, W-1]
        new[:, :-1] = np.where(across, np.minimum(new[:, :-1], pair), new[:, :-1])
        new[:, 1:] = np.where(across, np.minimum(new[:, 1:], pair), new[:, 1:])
        pair = np.minimum(labels[:-1], labels[1:])  # [H-1, W]
        new[:-1] = np.where(down, np.minimum(new[:-1], pair), new[:-1])
        new[1:] = np.where(down, np.minimum(new[1:], pair), new[1:])
        flat = new.ravel()
        new = flat[flat[flat]].reshape(h, w)  # jump twice: a label's label is no larger
        if np.array_equal(new, labels):
            return np.where(fg, labels, -1)
        labels = new


def find_objects(frame: np.ndarray, options: ReadOptions | None = None) -> tuple[FoundObject, ...]:
    """The objects in ``frame`` ``[H, W, 3]`` uint8 RGB, in row-major order of their first
    pixel (the module docstring has the rules)."""
    options = options or ReadOptions()
    classes = classify_pixels(frame, options.max_colour_distance)  # [H, W]
    labels = label_components(classes)  # [H, W]
    side = geometry(min(frame.shape[:2])).min_size  # a ValueError below 32 px
    areas = np.bincount(labels[labels >= 0], minlength=labels.size)  # [H * W] by label
    found = []
    for root in np.flatnonzero(areas >= options.min_area * side * side):
        ys, xs = np.nonzero(labels == root)
        top, left = int(ys.min()), int(xs.min())
        height, width = int(ys.max()) + 1 - top, int(xs.max()) + 1 - left
        crop = np.zeros((height, width), dtype=bool)
        crop[ys - top, xs - left] = True
        shape, iou = _outline(crop, options)
        colour = _COLOURS[classes.flat[root]]
        found.append(FoundObject(shape, colour, left, top, width, height, len(ys), iou))
    return tuple(found)


def _outline(crop: np.ndarray, options: ReadOptions) -> tuple[str | None, float]:
    """The shape whose outline fits the component ``crop`` ``[h, w]`` best, and the overlap
    (no shape when the box is too long one way or the best overlap is too small)."""
    height, width = crop.shape
    ious = {}
    for shape in SHAPES:
        template = shape_mask(shape, width, height)  # [h, w]
        ious[shape] = (crop & template).sum() / (crop | template).sum()
    best = max(ious, key=ious.__getitem__)
    stretched = max(width, height) > options.max_aspect * min(width, height)
    fits = not stretched and ious[best] >= options.min_iou
    return (best if fits else None), float(ious[best])


# --------------------------------------------------------------------------- scoring


@dataclass(frozen=True, slots=True)
class SampleScore:
    """One sample judged against its caption; scores are means over its frames."""

    prompt: str
    category: str
    strict: float
    """1.0 when every requirement holds (in every frame), else the fraction of frames where
    they all do."""
    partial: float
    """The fraction of requirements that hold, averaged over frames."""
    requirements: tuple[Requirement, ...]
    """Each requirement and whether it holds, in the first frame."""


def evaluate(
    samples: torch.Tensor, prompts: Sequence[str], options: ReadOptions | None = None
) -> list[SampleScore]:
    """Each sample of ``samples`` ``[B, F, H, W, 3]`` uint8 judged against its prompt.

    A prompt the shapes world cannot read is a ValueError before anything is judged.
    """
    check_samples(samples)
    if len(prompts) != samples.shape[0]:
        raise ValueError(f"got {samples.shape[0]} samples but {len(prompts)} prompts.")
    specs = [parse(p) for p in prompts]
    frames = samples.detach().cpu().numpy()  # [B, F, H, W, 3]
    return [
        _judge(clip, prompt, spec, options) for clip, prompt, spec in zip(frames, prompts, specs)
    ]


def _judge(
    clip: np.ndarray, prompt: str, spec: CaptionSpec, options: ReadOptions | None
) -> SampleScore:
    per_frame = [check(spec, find_objects(frame, options)) for frame in clip]  # clip: [F, H, W, 3]
    met = np.array([[r.met for r in frame] for frame in per_frame], dtype=np.float64)  # [F, R]
    return SampleScore(
        prompt=prompt,
        category=spec.category,
        strict=float(met.all(axis=1).mean()),
        partial=float(met.mean()),
        requirements=per_frame[0],
    )


def accuracy(scores: Sequence[SampleScore]) -> dict[str, float]:
    """GenEval's summary: the mean strict score of each category present (in
    :data:`~digen.shapes.CATEGORIES` order), and ``overall``, the mean of those means."""
    by_category = {
        c: float(np.mean([s.strict for s in scores if s.category == c]))
        for c in CATEGORIES
        if any(s.category == c for s in scores)
    }
    if not by_category:
        raise ValueError("no scores to summarise.")
    return {**by_category, "overall": float(np.mean(list(by_category.values())))}


class ShapesReward:
    """Reward hook ``(samples [B, F, H, W, 3] uint8, prompts, metadata) -> B floats in [0, 1]``.

    Options: ``mode`` (:data:`MODES`) and the fields of :class:`ReadOptions`.
    """

    def __init__(self, mode: str = "partial", **read_options: float) -> None:
        if mode not in MODES:
            raise ValueError(f"option mode must be one of {', '.join(MODES)}, got {mode!r}.")
        known = {f.name for f in fields(ReadOptions)}
        unknown = sorted(set(read_options) - known)
        if unknown:
            raise ValueError(
                f"option {unknown[0]!r} is not one the shapes reward takes "
                f"(mode, {', '.join(sorted(known))})."
            )
        self.mode = mode
        self.options = ReadOptions(**read_options)

    def __call__(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> list[float]:
        scores = evaluate(samples, prompts, self.options)
        return [s.strict if self.mode == "strict" else s.partial for s in scores]
