"""The shapes world: drawing, the caption grammar both ways, scenes for captions, the split."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from importlib import resources
from types import SimpleNamespace

import numpy as np
import pytest

from digen.prompts import BUILTIN_SETS, PromptSet
from digen.shapes import (
    BACKGROUND,
    CATEGORIES,
    HELD_OUT_BINDINGS,
    HELD_OUT_PAIRS,
    PALETTE,
    SHAPES,
    CaptionSpec,
    ObjectSpec,
    Scene,
    SceneObject,
    all_specs,
    balanced,
    caption,
    check,
    detections,
    geometry,
    is_held_out,
    parse,
    relation_holds,
    render,
    scene_for,
    shape_mask,
    split_prompts,
)

SPECS = list(all_specs())
TRAIN, HELD_OUT = split_prompts()


def one_sentence(message: str) -> None:
    assert "\n" not in message and message.endswith(".")


# --------------------------------------------------------------------------- drawing


def test_geometry_scales_with_the_resolution() -> None:
    g32, g64 = geometry(32), geometry(64)
    assert (g32.min_size, g32.max_size, g32.margin, g32.gap) == (8, 12, 1, 2)
    assert (g64.min_size, g64.max_size, g64.margin, g64.gap) == (16, 24, 2, 4)
    with pytest.raises(ValueError, match="at least 32 px") as info:
        geometry(16)
    one_sentence(str(info.value))


@pytest.mark.parametrize("size", [8, 9, 12, 16, 17, 24])
def test_every_outline_spans_its_box_and_they_differ(size: int) -> None:
    fills = {}
    for shape in SHAPES:
        mask = shape_mask(shape, size, size)
        assert mask.shape == (size, size)
        assert mask.any(axis=0).all() and mask.any(axis=1).all()  # the box is the drawn box
        fills[shape] = mask.mean()
    assert fills["square"] == 1.0
    assert 0.76 <= fills["circle"] <= 0.86
    assert 0.5 <= fills["triangle"] <= 0.65
    triangle = shape_mask("triangle", size, size)
    assert triangle[0].sum() <= 2 and triangle[-1].all()  # apex up, base down


def test_render_draws_exact_colours_with_hard_edges() -> None:
    scene = Scene(
        32,
        (
            SceneObject("circle", "red", 1, 1, 10),
            SceneObject("square", "blue", 20, 3, 9),
            SceneObject("triangle", "yellow", 10, 19, 12),
        ),
    )
    image = render(scene)
    assert image.shape == (32, 32, 3) and image.dtype == np.uint8
    colours = Counter(map(tuple, image.reshape(-1, 3).tolist()))
    assert set(colours) == {BACKGROUND, PALETTE["red"], PALETTE["blue"], PALETTE["yellow"]}
    for o in scene.objects:  # every pixel of a box is its colour or the background
        window = image[o.top : o.top + o.size, o.left : o.left + o.size]
        is_colour = (window == PALETTE[o.colour]).all(-1)
        assert np.array_equal(is_colour, shape_mask(o.shape, o.size, o.size))
        assert colours[PALETTE[o.colour]] == shape_mask(o.shape, o.size, o.size).sum()


def test_a_scene_keeps_its_objects_on_the_canvas() -> None:
    with pytest.raises(ValueError, match="leaves the 32 px canvas") as info:
        Scene(32, (SceneObject("circle", "red", 25, 0, 8),))
    one_sentence(str(info.value))
    with pytest.raises(ValueError, match="shape or colour"):
        Scene(32, (SceneObject("circle", "purple", 0, 0, 8),))


# --------------------------------------------------------------------------- captions


def test_the_world_has_every_caption_of_its_grammar() -> None:
    counts = Counter(s.category for s in SPECS)
    # 3 shapes; 3 x 2 ordered pairs; 3 counts x 3; 4 x 3 bindings; 4 relations x 72 ordered
    # pairs of objects differing in shape and colour (12 x 6); those 72 pairs
    assert counts == {
        "single_object": 3,
        "two_object": 6,
        "counting": 9,
        "colors": 12,
        "position": 288,
        "color_attr": 72,
    }
    assert list(dict.fromkeys(s.category for s in SPECS)) == list(CATEGORIES)
    assert len({caption(s) for s in SPECS}) == len(SPECS)


def test_every_caption_reads_back_as_written() -> None:
    for spec in SPECS:
        assert parse(caption(spec)) == spec
    for text in TRAIN + HELD_OUT:
        assert caption(parse(text)) == text


@pytest.mark.parametrize(
    ("text", "spec"),
    [
        ("a circle", CaptionSpec("single_object", (ObjectSpec("circle"),))),
        (
            "a circle and a square",
            CaptionSpec("two_object", (ObjectSpec("circle"), ObjectSpec("square"))),
        ),
        ("four triangles", CaptionSpec("counting", (ObjectSpec("triangle", None, 4),))),
        ("a blue square", CaptionSpec("colors", (ObjectSpec("square", "blue"),))),
        (
            "a red square to the left of a yellow triangle",
            CaptionSpec(
                "position",
                (ObjectSpec("square", "red"), ObjectSpec("triangle", "yellow")),
                "left of",
            ),
        ),
        (
            "A Green circle  and a red SQUARE",  # case and spacing do not matter
            CaptionSpec("color_attr", (ObjectSpec("circle", "green"), ObjectSpec("square", "red"))),
        ),
    ],
)
def test_captions_by_hand(text: str, spec: CaptionSpec) -> None:
    assert parse(text) == spec


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("a photo of a circle", "is not one the shapes world reads"),
        ("five circles", "is not one the shapes world reads"),
        ("one circle", "is not one the shapes world reads"),
        ("a purple circle", "is not one the shapes world reads"),
        ("a circle next to a square", "is not one the shapes world reads"),
        ("", "is not one the shapes world reads"),
        ("a circle and a circle", "names two different shapes"),
        ("a red circle and a red square", "names two different colours"),
        ("a red circle and a square", "each object of a color_attr caption has a colour"),
        ("a circle above a square", "each object of a position caption has a colour"),
        ("a red circle above a blue circle", "names two different shapes"),
    ],
)
def test_a_caption_outside_the_world_is_one_sentence(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why) as info:
        parse(text)
    assert repr(text) in str(info.value)
    one_sentence(str(info.value))


# --------------------------------------------------------------------------- requirements


def box(x: float, y: float, size: float = 4) -> SimpleNamespace:
    return SimpleNamespace(x=x, y=y, width=size, height=size)


def test_relations_follow_genevals_rule() -> None:
    b = box(10, 10)
    assert relation_holds(box(0, 10), b, "left of") and not relation_holds(box(0, 10), b, "above")
    assert relation_holds(box(20, 10), b, "right of")
    assert relation_holds(box(10, 0), b, "above") and relation_holds(box(10, 20), b, "below")
    # at 45 degrees both axes count (1 / sqrt 2 > 0.5, once 0.8 px of allowance is gone)
    assert relation_holds(box(0, 0), b, "left of") and relation_holds(box(0, 0), b, "above")
    # within the allowance of 0.1 x (4 + 4) px per axis, no direction holds
    assert not any(relation_holds(box(9.5, 10.5), b, r) for r in ("left of", "below"))
    # mostly vertical: 'left of' fails even though A is a little to the left
    assert not relation_holds(box(7, 0), b, "left of") and relation_holds(box(7, 0), b, "above")


def test_requirements_by_hand() -> None:
    red_square = SceneObject("square", "red", 2, 10, 8)
    yellow_triangle = SceneObject("triangle", "yellow", 20, 10, 8)
    spec = parse("a red square to the left of a yellow triangle")
    met = check(spec, [red_square, yellow_triangle])
    assert [r.what for r in met] == [
        "a square",
        "the square is red",
        "a triangle",
        "the triangle is yellow",
        "the red square to the left of the yellow triangle",
    ]
    assert all(r.met for r in met)
    swapped = check(spec, [SceneObject("square", "red", 20, 10, 8), yellow_triangle])
    assert [r.met for r in swapped] == [True, True, True, True, False]
    counted = check(parse("three circles"), [SceneObject("circle", "red", 0, 0, 8)] * 2)
    assert [(r.what, r.met) for r in counted] == [
        ("a circle", True),
        ("exactly three circles", False),
    ]
    assert [r.met for r in check(parse("a blue square"), [red_square])] == [True, False]
    assert [r.met for r in check(parse("a circle"), [red_square, yellow_triangle])] == [False]


@dataclass(frozen=True)
class Read:
    """An object as a reader reports it: a scene object with its outline's fit and area."""

    shape: str
    colour: str
    x: float
    y: float
    iou: float
    area: float
    width: float = 8
    height: float = 8


def test_named_objects_are_the_most_confident_detections_as_in_geneval() -> None:
    # GenEval judges colour and position on the most confident detections of each class,
    # as many as the prompt names; here confidence is the outline's fit, then the size
    red, blue = SceneObject("square", "red", 2, 2, 8), SceneObject("square", "blue", 20, 2, 10)
    assert detections([red, blue], "square") == [blue, red]  # as good a fit, and larger
    met = [r.met for r in check(parse("a red square"), [red, blue])]
    assert met == [True, False]  # the larger blue square stands for "a square"
    small_blue = SceneObject("square", "blue", 20, 2, 8)
    assert [r.met for r in check(parse("a red square"), [red, small_blue])] == [True, True]
    # the better fit is chosen before the larger one, whatever their order
    ragged = Read("square", "blue", 20, 4, iou=0.7, area=90)
    clean = Read("square", "red", 4, 4, iou=0.9, area=50)
    for objects in ([ragged, clean], [clean, ragged]):
        assert detections(objects, "square") == [clean, ragged]
        assert all(r.met for r in check(parse("a red square"), objects))
    # a relation holds between the chosen objects only: A drawn twice, the larger copy on
    # the wrong side of B, fails however well the smaller copy is placed
    triangle = SceneObject("triangle", "yellow", 12, 12, 8)
    left_small = SceneObject("square", "red", 1, 12, 8)
    right_large = SceneObject("square", "red", 22, 11, 9)
    spec = parse("a red square to the left of a yellow triangle")
    assert all(r.met for r in check(spec, [left_small, triangle]))
    both = check(spec, [left_small, triangle, right_large])
    assert [r.met for r in both] == [True, True, True, True, False]
    # a reference object of the wrong colour still stands for its shape: the relation is
    # judged (partial credit reads the same objects) and the verdict fails on the colour
    blue_triangle = replace(triangle, colour="blue")
    assert [r.met for r in check(spec, [left_small, blue_triangle])] == [True] * 3 + [False, True]
    # counting looks at every detection of the shape, whatever its colour
    circles = [SceneObject("circle", c, 2 + 10 * i, 2, 8) for i, c in enumerate(PALETTE)]
    assert [r.met for r in check(parse("three circles"), circles[:3])] == [True, True]
    assert [r.met for r in check(parse("three circles"), circles)] == [True, False]


# --------------------------------------------------------------------------- scenes


@pytest.mark.parametrize("layout", ["free", "ordered"])
@pytest.mark.parametrize("resolution", [32, 64])
def test_scenes_for_captions_meet_them_and_keep_apart(resolution: int, layout: str) -> None:
    g = geometry(resolution)
    rng = np.random.default_rng(resolution)
    for spec in SPECS:
        for _ in range(3):
            scene = scene_for(spec, rng, resolution, layout)
            assert all(r.met for r in check(spec, scene.objects)), caption(spec)
            assert len(scene.objects) == sum(o.count for o in spec.objects)
            for i, a in enumerate(scene.objects):
                assert g.min_size <= a.size <= g.max_size
                assert min(a.left, a.top) >= g.margin
                assert max(a.left, a.top) + a.size <= resolution - g.margin
                for b in scene.objects[i + 1 :]:
                    apart_x = b.left >= a.left + a.size + g.gap or a.left >= b.left + b.size + g.gap
                    apart_y = b.top >= a.top + a.size + g.gap or a.top >= b.top + b.size + g.gap
                    assert apart_x or apart_y


@pytest.mark.parametrize("resolution", [32, 64])
def test_ordered_scenes_put_each_object_in_the_half_its_words_name(resolution: int) -> None:
    half = resolution / 2
    rng = np.random.default_rng(11)
    expected = {  # (axis, the first named object's side) by relation; None: no relation
        None: ("x", "low"),
        "left of": ("x", "low"),
        "right of": ("x", "high"),
        "above": ("y", "low"),
        "below": ("y", "high"),
    }
    seen = set()
    for spec in all_specs():
        if len(spec.objects) != 2:
            continue
        axis, side = expected[spec.relation]
        scene = scene_for(spec, rng, resolution, "ordered")
        a, b = scene.objects
        assert (a.shape, b.shape) == tuple(o.shape for o in spec.objects)
        start = {"x": lambda o: o.left, "y": lambda o: o.top}[axis]
        low, high = (a, b) if side == "low" else (b, a)
        assert start(low) + low.size <= half - 1 and start(high) >= half + 1, caption(spec)
        # the other axis is left free: over the world's captions both halves are used
        across = {"x": lambda o: o.top, "y": lambda o: o.left}[axis]
        seen.add((spec.relation, across(a) + a.size / 2 < half))
    assert len(seen) == 2 * len(expected)
    with pytest.raises(ValueError, match="choose one of free, ordered"):
        scene_for(parse("a circle"), rng, resolution, "tidy")


def test_scenes_are_seeded_and_vary() -> None:
    spec = parse("four circles")
    first = [scene_for(spec, np.random.default_rng(7)) for _ in range(2)]
    assert first[0] == first[1]
    rng = np.random.default_rng(7)
    scenes = [scene_for(spec, rng) for _ in range(50)]
    assert len({s.objects for s in scenes}) == 50
    sizes = {o.size for s in scenes for o in s.objects}
    colours = {o.colour for s in scenes for o in s.objects}
    assert sizes == set(range(8, 13)) and colours == set(PALETTE)


# --------------------------------------------------------------------------- the split


def composition(spec: CaptionSpec) -> object:
    """What a caption composes: what must be new in a held-out caption of its category."""
    if spec.category == "single_object":
        return spec.objects[0].shape
    if spec.category == "two_object":
        return frozenset(o.shape for o in spec.objects)
    if spec.category == "counting":
        return (spec.objects[0].count, spec.objects[0].shape)
    if spec.category == "colors":
        return (spec.objects[0].colour, spec.objects[0].shape)
    return frozenset((o.colour, o.shape) for o in spec.objects)  # the pair, in either order


def bag_of_words(pair: frozenset[tuple[str, str]]) -> tuple[frozenset[str], frozenset[str]]:
    """A pair of coloured objects' words, unbound: its colours and its shapes."""
    return frozenset(c for c, _ in pair), frozenset(s for _, s in pair)


def test_the_split_holds_out_new_compositions_of_every_category() -> None:
    assert not set(TRAIN) & set(HELD_OUT)
    assert sorted(TRAIN + HELD_OUT) == sorted(caption(s) for s in SPECS)
    assert [caption(s) for s in SPECS if is_held_out(s)] == HELD_OUT
    train, held_out = [parse(p) for p in TRAIN], [parse(p) for p in HELD_OUT]
    sizes = {
        c: (sum(s.category == c for s in train), sum(s.category == c for s in held_out))
        for c in CATEGORIES
    }
    assert sizes == {
        "single_object": (2, 1),
        "two_object": (4, 2),
        "counting": (6, 3),
        "colors": (10, 2),
        "position": (192, 96),
        "color_attr": (48, 24),
    }
    assert 0.2 <= len(HELD_OUT) / len(SPECS) <= 0.34
    for spec in held_out:  # nothing a held-out caption composes is in its category's training
        seen = {composition(t) for t in train if t.category == spec.category}
        assert composition(spec) not in seen
    # every coloured object of a held-out pair is drawn in training beside four partners,
    # bound as named (a split that hid bindings from two-object captions taught the model
    # to paint them on the other object)
    pairs = [composition(t) for t in train if t.category in ("position", "color_attr")]
    for pair in HELD_OUT_PAIRS:
        assert len(pair) == 2
        for obj in pair:
            partners = {o for p in pairs if obj in p for o in p if o != obj}
            assert len(partners) == 4, (obj, partners)
    assert {composition(s) for s in held_out if s.category == "colors"} == HELD_OUT_BINDINGS
    held_pairs = [composition(s) for s in held_out if s.category in ("position", "color_attr")]
    assert set(held_pairs) == HELD_OUT_PAIRS
    counts = Counter(o for p in HELD_OUT_PAIRS for o in p)
    assert len(counts) == 12 and set(counts.values()) == {2}  # every coloured object twice
    assert set(Counter(frozenset(c for c, _ in p) for p in HELD_OUT_PAIRS).values()) == {2}
    assert set(Counter(frozenset(s for _, s in p) for p in HELD_OUT_PAIRS).values()) == {4}
    # a bag of words (two colours, two shapes) is held out in both of its bindings or in
    # neither, so no training caption's binding follows from its words alone: the model has
    # to read which colour goes with which shape from their order
    held_bags = Counter(bag_of_words(p) for p in HELD_OUT_PAIRS)
    assert len(held_bags) == 6 and set(held_bags.values()) == {2}
    trained_bags = Counter(bag_of_words(p) for p in set(pairs))
    assert len(trained_bags) == 12 and set(trained_bags.values()) == {2}
    assert not set(trained_bags) & set(held_bags)
    trained = [(o.colour, o.shape) for t in train for o in t.objects]
    assert {c for c, _ in trained} == set(PALETTE) | {None}
    assert {s for _, s in trained} == set(SHAPES)
    counted = {o.count for t in train for o in t.objects}
    assert counted == {1, 2, 3, 4}


def test_the_shipped_prompt_sets_are_the_split() -> None:
    # After changing the split, write the files again with `python -m digen.shapes`.
    for name, prompts in (("shapes", TRAIN), ("shapes-heldout", HELD_OUT)):
        text = resources.files("digen.data").joinpath(BUILTIN_SETS[name]).read_text("utf-8")
        assert text == "".join(f"{p}\n" for p in prompts)
        assert PromptSet.builtin(name).prompts == prompts
        assert PromptSet.load(name).prompts == prompts


def test_a_balanced_evaluation_takes_each_category_alike() -> None:
    chosen = balanced(HELD_OUT, 8)
    categories = [parse(p).category for p in chosen]
    assert categories == [c for c in CATEGORIES for _ in range(8)]  # in CATEGORIES order
    by = {c: [p for p in HELD_OUT if parse(p).category == c] for c in CATEGORIES}
    assert chosen[:8] == ["a triangle"] * 8  # one prompt: repeated
    colors = chosen[3 * 8 : 4 * 8]
    assert colors == by["colors"] * 4  # two prompts: cycled in order
    position = chosen[4 * 8 : 5 * 8]  # 96 prompts: every 12th, from the first
    assert position == by["position"][::12]
    assert len(set(balanced(HELD_OUT, 96)[4 * 96 : 5 * 96])) == 96  # as many: each once
    assert balanced(["a circle", "two squares"], 2) == ["a circle"] * 2 + ["two squares"] * 2
    with pytest.raises(ValueError, match="'a snowman' is not one the shapes world reads"):
        balanced(["a circle", "a snowman"], 2)
