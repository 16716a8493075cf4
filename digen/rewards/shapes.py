"""Shapes reward: a GenEval-style judge of images of the shapes world (:mod:`digen.shapes`).

It reads only the image and its caption, in four steps:

* pixels: each is read as a mix of the background and one palette colour (the one whose
  line from the background passes nearest it in RGB); it is that colour when it is at least
  half colour and within ``max_colour_distance`` of the line, else background, so a soft
  edge is cut half-way and an unclear colour (grey, black, brown) is no object;
* objects: the connected components (4-neighbour) of each colour; a component smaller than
  ``min_area`` times the smallest object's box (a speck) is dropped;
* shape: the outline that fits the component best. Each shape is drawn as
  :func:`digen.shapes.render` draws it into boxes up to 2 px larger or smaller than the
  component's box each way (at most ``max_aspect`` times longer one way than the other),
  placed up to 1 px off its centre, its edges softened as a small model's decoder softens
  them (``edge_blur``), and compared with how much of the component's colour each pixel
  around it holds (a soft intersection over union: a half-coloured edge pixel counts half).
  The component is the shape of the best fit if that overlap is at least ``min_iou``;
  otherwise it keeps its colour but has no shape, and meets no requirement;
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
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

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


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadOptions:
    """How the reader turns pixels into objects."""

    max_colour_distance: float = 60.0
    """RGB distance from the line between the background and a palette colour beyond which
    a pixel is no mix of the two (:func:`classify_pixels`): a grey is 72 from green's line,
    black 185, a dull red (180, 70, 70) 45 from red's."""
    min_area: float = 0.25
    """Components smaller than this fraction of the smallest object's box are specks."""
    max_aspect: float = 1.6
    """Longer side / shorter side beyond which an outline is not tried (a component that
    only a longer outline would fit has no shape)."""
    min_iou: float = 0.6
    """Overlap with the best-fitting outline below which a component has no shape."""
    edge_blur: float = field(default=0.5, metadata={"zero_ok": True})
    """How soft the outlines' edges are drawn before they are compared: a 3-tap
    ``[b, 1, b]`` blur down the rows, then the same across them (each pixel mixed with its
    edge neighbours by ``b`` and its corner neighbours by ``b * b`` against its own 1);
    0: hard edges. 0.5 fits the samples of the shipped shapes models (REWARDS.md)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            zero_ok = f.metadata.get("zero_ok", False)  # the rest must be positive
            floor_ok = value >= 0 if zero_ok else value > 0
            if isinstance(value, bool) or not isinstance(value, int | float) or not floor_ok:
                bound = ">= 0" if zero_ok else "> 0"
                raise ValueError(f"option {f.name} must be a number {bound}, got {value!r}.")
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
    """Its soft overlap with its shape's best-fitting outline (with the best outline of any
    shape when it has no shape)."""

    @property
    def x(self) -> float:
        return self.left + self.width / 2

    @property
    def y(self) -> float:
        return self.top + self.height / 2


def _along_lines(frame: np.ndarray, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """``frame`` ``[H, W, 3]`` -> ``[H, W, K]`` twice, computed in ``dtype``: how far along
    the line from the background to each palette colour the nearest point to each pixel lies
    (clipped to 0 .. 1), and the squared RGB distance from the pixel to that point."""
    towards = frame.astype(dtype) - _BACKGROUND.astype(dtype)  # [H, W, 3]
    lines = _LINES.astype(dtype)  # whole numbers: exact in either dtype
    lengths2 = (lines**2).sum(-1)  # [K]
    dots = towards @ lines.T  # [H, W, K]
    along = np.clip(dots / lengths2, 0.0, 1.0)  # 0 background, 1 the colour
    # squared distance to the nearest point of each line: |p - a v|^2, expanded
    d2 = (towards**2).sum(-1, keepdims=True) - 2 * along * dots + along**2 * lengths2
    return along, d2


def classify_pixels(frame: np.ndarray, max_colour_distance: float) -> np.ndarray:
    """``frame`` ``[H, W, 3]`` uint8 -> ``[H, W]`` int: the index of each pixel's palette
    colour in :data:`~digen.shapes.PALETTE`, or -1 for background and unclear colours.

    A pixel is read as a mix of the background and the palette colour whose line from the
    background (through every mix of the two, ending at the colour) passes nearest it. It
    is that colour when it lies at least half-way along that line and within
    ``max_colour_distance`` of it; otherwise it is background. So a soft edge is cut where
    it is half colour, and a half-red edge reads as red (its plain nearest colour is yellow).
    """
    along, d2 = _along_lines(frame, np.float32)  # [H, W, K] each
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
    roots = np.flatnonzero(areas >= options.min_area * side * side)
    alphas = _colour_amounts(frame, options.max_colour_distance) if len(roots) else None
    found = []
    for root in roots:
        mine = labels == root  # [H, W]
        ys, xs = np.nonzero(mine)
        top, left = int(ys.min()), int(xs.min())
        height, width = int(ys.max()) + 1 - top, int(xs.max()) + 1 - left
        k = classes.flat[root]
        # how much of its colour each pixel holds, the other objects' pixels left out
        amount = np.where((classes >= 0) & ~mine, 0.0, alphas[..., k])  # [H, W]
        shape, iou = _outline(amount, top, left, height, width, options)
        found.append(FoundObject(shape, _COLOURS[k], left, top, width, height, len(ys), iou))
    return tuple(found)


_SIZE_STEPS = 2
"""Outlines are tried in boxes up to this many pixels smaller or larger than the component's
box, each way."""
_SHIFT = 1
"""... and placed up to this many pixels off the component's box centre."""
_FAINT = 0.15
"""A pixel less than this much of a colour counts as background when outlines are fitted:
pixel noise (no sample of the shapes models has any) would otherwise swell every object."""


def _colour_amounts(frame: np.ndarray, max_colour_distance: float) -> np.ndarray:
    """``[H, W, K]``: how far along the line from the background to each palette colour each
    pixel lies (0 background .. 1 the colour), 0 where the pixel is farther than
    ``max_colour_distance`` from that line or less than :data:`_FAINT` of the way."""
    along, d2 = _along_lines(frame, np.float64)  # [H, W, K] each
    return np.where((d2 <= max_colour_distance**2) & (along >= _FAINT), along, 0.0)


@lru_cache(maxsize=4096)
def _soft_outlines(width: int, height: int, blur: float) -> tuple[np.ndarray, np.ndarray]:
    """Every shape of :data:`~digen.shapes.SHAPES` drawn into a ``width`` x ``height`` box
    with a 1 px border, its edges softened by a ``[blur, 1, blur]`` blur each way:
    ``[S, height + 2, width + 2]`` float64, and each outline's sum ``[S]`` (read-only;
    cached)."""
    out = np.stack([np.pad(shape_mask(s, width, height), 1) for s in SHAPES]).astype(np.float64)
    if blur:
        k = np.array([blur, 1.0, blur]) / (1 + 2 * blur)
        p = np.pad(out, ((0, 0), (1, 1), (0, 0)))
        p = k[0] * p[:, :-2] + k[1] * p[:, 1:-1] + k[2] * p[:, 2:]
        p = np.pad(p, ((0, 0), (0, 0), (1, 1)))
        out = k[0] * p[..., :-2] + k[1] * p[..., 1:-1] + k[2] * p[..., 2:]
    sums = out.sum((1, 2))
    out.flags.writeable = sums.flags.writeable = False
    return out, sums


def _crop(a: np.ndarray, top: int, left: int, height: int, width: int) -> np.ndarray:
    """``a[top : top + height, left : left + width]`` ``[height, width]``, zero where it
    reaches past ``a``'s edges."""
    out = np.zeros((height, width), a.dtype)
    y0, x0 = max(top, 0), max(left, 0)
    y1, x1 = min(top + height, a.shape[0]), min(left + width, a.shape[1])
    if y0 < y1 and x0 < x1:
        out[y0 - top : y1 - top, x0 - left : x1 - left] = a[y0:y1, x0:x1]
    return out


def _outline(
    amount: np.ndarray, top: int, left: int, height: int, width: int, options: ReadOptions
) -> tuple[str | None, float]:
    """The shape whose softened outline fits ``amount`` ``[H, W]`` (the component's colour
    per pixel) best around the component's box, and the soft overlap of that fit (no shape
    when it is below ``min_iou``)."""
    m = _SIZE_STEPS + 1 + _SHIFT  # room around the box for the largest outline, shifted
    window = _crop(amount, top - m, left - m, height + 2 * m, width + 2 * m)
    total = float(window.sum())
    best = np.full(len(SHAPES), -1.0)  # [S]: each shape's best overlap
    for h in range(max(3, height - _SIZE_STEPS), height + _SIZE_STEPS + 1):
        for w in range(max(3, width - _SIZE_STEPS), width + _SIZE_STEPS + 1):
            if max(h, w) > options.max_aspect * min(h, w):
                continue
            outlines, sums = _soft_outlines(w, h, options.edge_blur)  # [S, h + 2, w + 2], [S]
            # the outlines' box centred on the component's, moved up to _SHIFT px each way
            y0 = m - 1 - (h - height) // 2 - _SHIFT
            x0 = m - 1 - (w - width) // 2 - _SHIFT
            region = window[y0 : y0 + h + 2 + 2 * _SHIFT, x0 : x0 + w + 2 + 2 * _SHIFT]
            places = sliding_window_view(region, (h + 2, w + 2))  # [P, P, h + 2, w + 2]
            inter = np.minimum(places[:, :, None], outlines).sum((-1, -2))  # [P, P, S]
            iou = inter / (total + sums - inter)
            best = np.maximum(best, iou.max((0, 1)))
    k = int(best.argmax())
    return (SHAPES[k] if best[k] >= options.min_iou else None), max(float(best[k]), 0.0)


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
