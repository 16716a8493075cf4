"""Shapes reward: the reader by hand and against an oracle, ground-truth scenes at 32 and
64 px, scenes with one thing wrong, noise and blur, and the reward loaded by its name."""

from __future__ import annotations

from collections import deque
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from digen.errors import RewardError
from digen.rewards.hooks import load_hook
from digen.rewards.scoring import build_reward
from digen.rewards.shapes import (
    ReadOptions,
    SampleScore,
    ShapesReward,
    accuracy,
    classify_pixels,
    evaluate,
    find_objects,
    label_components,
)
from digen.shapes import (
    BACKGROUND,
    PALETTE,
    SHAPES,
    CaptionSpec,
    Scene,
    SceneObject,
    all_specs,
    caption,
    check,
    parse,
    render,
    scene_for,
    shape_mask,
)

SPECS = list(all_specs())


def batch(*frames: np.ndarray) -> torch.Tensor:
    """One sample per frame: [B, 1, H, W, 3] uint8."""
    return torch.from_numpy(np.stack(frames))[:, None]


def ground_truth(resolution: int, seeds: int) -> tuple[list[np.ndarray], list[str]]:
    """Every caption of the world (training and held-out), drawn ``seeds`` times by
    :func:`scene_for`: [H, W, 3] frames and their captions."""
    rng = np.random.default_rng(resolution)
    pairs = [
        (render(scene_for(s, rng, resolution)), caption(s)) for s in SPECS for _ in range(seeds)
    ]
    return [f for f, _ in pairs], [p for _, p in pairs]


# --------------------------------------------------------------------------- the reader


def test_pixels_are_read_as_mixes_of_the_background_and_one_colour() -> None:
    pixels = [
        BACKGROUND,
        *PALETTE.values(),
        (200, 60, 50),  # a dull red
        (237, 147, 147),  # half red, half white: a soft red edge (nearest to yellow in RGB)
        (246, 200, 200),  # more white than red
        (128, 128, 128),  # grey, 72 from the line to green
        (0, 0, 0),
        (120, 80, 40),  # brown
    ]
    frame = np.array([pixels], dtype=np.uint8)  # [1, 11, 3]
    assert classify_pixels(frame, 60.0).tolist() == [[-1, 0, 1, 2, 3, 0, 0, -1, -1, -1, -1]]
    assert classify_pixels(frame, 80.0)[0, 8] == 1  # a looser reader takes grey for green


def components_by_search(classes: np.ndarray) -> list[frozenset[tuple[int, int]]]:
    """The oracle: 4-connected same-class components found by breadth-first search."""
    h, w = classes.shape
    seen = np.zeros_like(classes, dtype=bool)
    found = []
    for start in zip(*np.nonzero(classes >= 0)):
        if seen[start]:
            continue
        seen[start] = True
        queue, part = deque([start]), set()
        while queue:
            y, x = queue.popleft()
            part.add((int(y), int(x)))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                inside = 0 <= ny < h and 0 <= nx < w
                if inside and not seen[ny, nx] and classes[ny, nx] == classes[y, x]:
                    seen[ny, nx] = True
                    queue.append((ny, nx))
        found.append(frozenset(part))
    return found


def components_by_label(labels: np.ndarray) -> list[frozenset[tuple[int, int]]]:
    return [
        frozenset((int(y), int(x)) for y, x in zip(*np.nonzero(labels == root)))
        for root in np.unique(labels[labels >= 0])
    ]


@pytest.mark.parametrize("seed", range(20))
def test_components_match_a_breadth_first_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    classes = rng.integers(-1, 3, size=(17, 23))  # [H, W]: many small, twisted components
    labels = label_components(classes)
    assert sorted(components_by_label(labels), key=min) == sorted(
        components_by_search(classes), key=min
    )
    for part in components_by_label(labels):  # each labelled by its first pixel
        assert labels[min(part)] == min(part)[0] * 23 + min(part)[1]


def test_a_spiral_is_one_component_and_diagonal_neighbours_are_two() -> None:
    spiral = np.full((9, 9), -1)
    spiral[0, :] = spiral[:, 8] = spiral[8, :] = spiral[2:, 0] = spiral[2, :7] = 0
    spiral[2:7, 6] = spiral[6, 2:7] = spiral[4:7, 2] = spiral[4, 2:5] = 0
    assert len(components_by_label(label_components(spiral))) == 1
    diagonal = np.array([[0, -1], [-1, 0]])
    assert len(components_by_label(label_components(diagonal))) == 2


@pytest.mark.parametrize("size", range(8, 25))
def test_every_drawn_outline_reads_as_itself(size: int) -> None:
    resolution = 32 if size <= 12 else 64  # objects of this size belong to that world
    for shape, colour in zip(SHAPES, PALETTE):
        drawn = SceneObject(shape, colour, 3, 5, size)
        image = render(Scene(resolution, (drawn,)))
        (found,) = find_objects(image)
        assert (found.shape, found.colour) == (shape, colour)
        assert (found.x, found.y, found.width, found.height) == (drawn.x, drawn.y, size, size)
        # with hard-edged outlines the fit is exact: the outline render drew
        (hard,) = find_objects(image, ReadOptions(edge_blur=0))
        assert (hard.shape, hard.iou) == (shape, 1.0)


@pytest.mark.parametrize("corner", ["top-left", "bottom-right"])
def test_outlines_against_the_frame_edge_read_as_themselves(corner: str) -> None:
    """The outline fit looks a few pixels around each object's box; past the frame's edge it
    sees background, so a shape drawn into a corner is read as a shape in open space is."""
    size = 10
    at = 0 if corner == "top-left" else 32 - size
    for shape, colour in zip(SHAPES, PALETTE):
        image = render(Scene(32, (SceneObject(shape, colour, at, at, size),)))
        (found,) = find_objects(image)
        assert (found.shape, found.colour, found.width, found.height) == (shape, colour, size, size)
        (hard,) = find_objects(image, ReadOptions(edge_blur=0))
        assert (hard.shape, hard.iou) == (shape, 1.0)


def test_specks_stretched_blobs_and_ragged_blobs_are_no_shapes() -> None:
    frame = np.full((32, 32, 3), 255, dtype=np.uint8)
    frame[2:5, 2:5] = PALETTE["red"]  # 9 px: below a quarter of an 8 px box
    frame[10:16, 2:30] = PALETTE["blue"]  # a bar: far longer than high
    ys, xs = np.mgrid[0:10, 0:10]
    frame[20:30, 20:30][np.abs(ys - xs) <= 2] = PALETTE["green"]  # a diagonal band
    found = find_objects(frame)
    assert [(f.colour, f.shape) for f in found] == [("blue", None), ("green", None)]
    assert found[1].iou == pytest.approx(0.44)  # the square's; no outline fits better
    assert find_objects(frame, ReadOptions(min_iou=0.4))[1].shape == "square"


def test_frames_below_32_px_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 32 px"):
        find_objects(np.full((16, 16, 3), 255, dtype=np.uint8))


# --------------------------------------------------------------------------- ground truth


@pytest.mark.parametrize("resolution", [32, 64])
def test_ground_truth_scenes_score_full_marks(resolution: int) -> None:
    # Measured: every one of the 1170 scenes (390 captions x 3) scores 1.0 at 32 and 64 px.
    frames, prompts = ground_truth(resolution, seeds=3)
    scores = evaluate(batch(*frames), prompts)
    assert np.mean([s.strict for s in scores]) >= 0.99
    assert np.mean([s.partial for s in scores]) >= 0.99
    summary = accuracy(scores)
    assert min(summary.values()) >= 0.97


MIRRORED = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def wrong(spec: CaptionSpec, kind: str) -> CaptionSpec:
    """``spec`` with one thing wrong, as a spec :func:`scene_for` can draw."""
    a, *rest = spec.objects
    used = {o.shape for o in spec.objects}
    if kind == "shape":  # the first object becomes a shape the caption does not name
        return replace(spec, objects=(replace(a, shape=min(set(SHAPES) - used)), *rest))
    if kind == "colour":  # colors: another colour; two objects: their colours swapped
        if rest:
            b = rest[0]
            return replace(spec, objects=(replace(a, colour=b.colour), replace(b, colour=a.colour)))
        return replace(spec, objects=(replace(a, colour=min(set(PALETTE) - {a.colour})),))
    if kind == "count":  # one more, or one fewer at the top of the range
        return replace(spec, objects=(replace(a, count=a.count + 1 if a.count < 4 else 3),))
    if kind == "sides":  # the relation mirrored: the two objects swap sides
        return replace(spec, relation=MIRRORED[spec.relation])
    raise AssertionError(kind)


# (category, what is wrong) -> the partial credit: the fraction of requirements still met
ONE_THING_WRONG = {
    ("single_object", "shape"): 0 / 1,  # the one named shape is missing
    ("two_object", "shape"): 1 / 2,
    ("counting", "shape"): 0 / 2,  # no object of the counted shape at all
    ("counting", "count"): 1 / 2,
    ("colors", "shape"): 0 / 2,  # the named shape is missing, so its colour is too
    ("colors", "colour"): 1 / 2,
    ("color_attr", "shape"): 2 / 4,
    ("color_attr", "colour"): 2 / 4,
    ("position", "shape"): 2 / 5,  # the first object and so the relation are missing
    ("position", "colour"): 3 / 5,  # both shapes right and placed right, both colours wrong
    ("position", "sides"): 4 / 5,
}


@pytest.mark.parametrize("resolution", [32, 64])
def test_one_thing_wrong_scores_zero_strict_and_its_share_of_partial(resolution: int) -> None:
    rng = np.random.default_rng(1)
    frames, prompts, expected = [], [], []
    for (category, kind), credit in ONE_THING_WRONG.items():
        specs = [s for s in SPECS if s.category == category]
        for spec in specs[:: 9 if category == "position" else 1]:  # 32 of the 288 positions
            frames.append(render(scene_for(wrong(spec, kind), rng, resolution)))
            prompts.append(caption(spec))
            expected.append(credit)
    scores = evaluate(batch(*frames), prompts)
    assert [s.strict for s in scores] == [0.0] * len(scores)
    # strictly between 0 and 1 wherever a requirement other than the broken one remains
    assert [s.partial for s in scores] == pytest.approx(expected)


def test_an_extra_object_fails_the_caption_when_it_is_the_one_read_as_named() -> None:
    # GenEval's rule on drawn images: the larger of two equally clean squares stands for "a
    # square", so an extra one of another colour fails "a red square" when it is larger and
    # not when it is smaller; likewise a second copy of A on the wrong side of B
    frames, prompts, expected = [], [], []
    for shape in SHAPES:
        for colour, other in zip(PALETTE, [*list(PALETTE)[1:], next(iter(PALETTE))]):
            for extra_size, ok in ((22, 0.0), (16, 1.0)):
                named = SceneObject(shape, colour, 4, 20, 18)
                extra = SceneObject(shape, other, 36, 20, extra_size)
                frames.append(render(Scene(64, (named, extra))))
                prompts.append(f"a {colour} {shape}")
                expected.append(ok)
    for a, b in (("square", "triangle"), ("circle", "square"), ("triangle", "circle")):
        prompt = f"a red {a} to the left of a blue {b}"
        b_obj = SceneObject(b, "blue", 24, 24, 16)
        left = SceneObject(a, "red", 2, 24, 16)
        for right_size, ok in ((20, 0.0), (12, 1.0)):  # the right-hand copy chosen when larger
            right = SceneObject(a, "red", 42, 22, right_size)
            frames.append(render(Scene(64, (left, b_obj, right))))
            prompts.append(prompt)
            expected.append(ok)
    scores = evaluate(batch(*frames), prompts)
    assert [s.strict for s in scores] == expected


def noisy(frame: np.ndarray, rng: np.random.Generator, sigma: float) -> np.ndarray:
    return np.clip(frame + rng.normal(0, sigma, frame.shape), 0, 255).astype(np.uint8)


def blurred(frame: np.ndarray, radius: float) -> np.ndarray:
    return np.asarray(Image.fromarray(frame).filter(ImageFilter.GaussianBlur(radius)))


@pytest.mark.parametrize("resolution", [32, 64])
def test_noise_and_soft_edges_score_as_the_clean_image(resolution: int) -> None:
    # Measured: every scene scores as its clean image under each change below, at both
    # sizes. Harder: at 32 px a blur of radius 1 with noise 20 keeps 1.0, noise 30 alone
    # 0.74 (faint noise swells the outlines fitted); at 64 px a blur of radius 2 with noise
    # 20 keeps 0.68.
    frames, prompts = ground_truth(resolution, seeds=1)
    rng = np.random.default_rng(2)
    radius = 0.7 * resolution / 32
    clean = [s.strict for s in evaluate(batch(*frames), prompts)]
    changes = {
        "noise": [noisy(f, rng, 20) for f in frames],
        "blur": [blurred(f, radius) for f in frames],
        "blur and noise": [noisy(blurred(f, radius), rng, 15) for f in frames],
    }
    for name, changed in changes.items():
        scores = [s.strict for s in evaluate(batch(*changed), prompts)]
        same = np.mean([a == b for a, b in zip(scores, clean)])
        assert same >= 0.95, f"{name}: {same:.3f} of the scores are the clean image's"


# --------------------------------------------------------------------------- the hook


def test_modes_and_videos() -> None:
    rng = np.random.default_rng(3)
    prompt = "a red square to the left of a yellow triangle"
    right = render(scene_for(parse(prompt), rng))
    mirrored = render(scene_for(parse(prompt.replace("left", "right")), rng))
    blank = np.full_like(right, 255)
    samples = batch(right, mirrored, blank)
    assert ShapesReward()(samples, [prompt] * 3, [{}] * 3) == pytest.approx([1.0, 0.8, 0.0])
    assert ShapesReward(mode="strict")(samples, [prompt] * 3, [{}] * 3) == [1.0, 0.0, 0.0]
    video = torch.from_numpy(np.stack([right, mirrored]))[None]  # [1, 2, H, W, 3]
    assert ShapesReward()(video, [prompt], [{}]) == pytest.approx([0.9])
    (score,) = evaluate(video, [prompt])
    assert (score.strict, score.partial, score.category) == (0.5, pytest.approx(0.9), "position")


def test_a_prompt_outside_the_world_fails_before_any_scoring() -> None:
    samples = batch(np.full((32, 32, 3), 255, dtype=np.uint8))
    with pytest.raises(ValueError, match="'a cat' is not one the shapes world reads"):
        ShapesReward()(samples, ["a cat"], [{}])
    with pytest.raises(ValueError, match="got 1 samples but 2 prompts"):
        ShapesReward()(samples, ["a circle"] * 2, [{}] * 2)


def test_accuracy_is_the_mean_of_the_category_means() -> None:
    def score(category: str, strict: float) -> SampleScore:
        return SampleScore("", category, strict, strict, ())

    scores = [score("counting", 1.0), score("counting", 0.0), score("counting", 0.0)]
    scores += [score("colors", 1.0), score("position", 0.5)]
    summary = accuracy(scores)
    assert list(summary) == ["counting", "colors", "position", "overall"]
    assert summary["counting"] == pytest.approx(1 / 3)
    assert summary["overall"] == pytest.approx((1 / 3 + 1.0 + 0.5) / 3)
    with pytest.raises(ValueError, match="no scores"):
        accuracy([])


def test_the_reward_loads_by_its_name_with_options() -> None:
    assert isinstance(load_hook("shapes"), ShapesReward)
    hook = load_hook("shapes", {"mode": "strict", "min_iou": 0.7})
    assert hook.mode == "strict" and hook.options.min_iou == 0.7
    frames, prompts = ground_truth(32, seeds=1)
    result = build_reward(["shapes"]).score_sync(batch(*frames[:8]), prompts[:8])
    assert result.components["shapes"].tolist() == [1.0] * 8


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({"mode": "lenient"}, "option mode must be one of partial, strict, got 'lenient'"),
        ({"min_iuo": 0.5}, "option 'min_iuo' is not one the shapes reward takes"),
        ({"max_colour_distance": -1}, "option max_colour_distance must be a number > 0, got -1"),
        ({"max_aspect": 0.5}, "option max_aspect must be at least 1, got 0.5"),
        ({"min_iou": 1.5}, "option min_iou must be at most 1, got 1.5"),
    ],
)
def test_bad_options_are_one_sentence(options: dict, why: str) -> None:
    with pytest.raises(RewardError, match=why) as info:
        load_hook("shapes", options)
    assert "\n" not in str(info.value)


def test_requirements_come_from_the_world() -> None:
    frame = render(Scene(32, (SceneObject("circle", "red", 2, 2, 10),)))
    (score,) = evaluate(batch(frame), ["three circles"])
    assert score.requirements == check(parse("three circles"), find_objects(frame))
    assert [(r.what, r.met) for r in score.requirements] == [
        ("a circle", True),
        ("exactly three circles", False),
    ]
    assert shape_mask("circle", 10, 10).sum() == find_objects(frame)[0].area
