"""The shapes world: coloured shapes on a plain background, captions about them in GenEval's
six categories, and the fixed split of those captions into training and held-out prompts.

A small text-to-image model learns to draw this world, and :mod:`digen.rewards.shapes` reads
its images back and scores them against their captions, so RL training improves something a
person can judge at a glance.

**Vocabulary.** Shapes :data:`SHAPES` (circle, square, triangle; triangles point up, so one
outline per shape); colours :data:`PALETTE` (red, green, blue, yellow), at least 170 apart
from each other in RGB; background :data:`BACKGROUND`, white: neutral, so it holds no hue a
reader could mistake, and at least 220 away from every palette colour (yellow is nearest).

**Scenes.** 1-4 objects, each a :class:`SceneObject` (shape, colour, the top-left corner and
the side of its square bounding box, in pixels at the scene's resolution; its centre is
``left + size / 2``). Drawn by :func:`render`: hard edges, exact colours, no anti-aliasing
(a pixel belongs to a shape when its centre does, with triangles widened by half a pixel so
the apex row is drawn). Sizes scale with the resolution (:func:`geometry`): a side of 1/4 to
3/8 of the image (8-12 px at 32 px, 16-24 px at 64 px). 8 px is about the smallest at which
the outlines stay apart: an 8 px circle fills 52 of its box's 64 pixels (a square all 64, a
triangle 40), so a circle and a square differ by three pixels at each corner; 12 px still
lets four objects fit in a 2 x 2 layout at 32 px. Objects stay 1/32 of the side from the
border and 1/16 apart box to box (2 px at 32 px, 4 px at 64 px), so two of one colour are
always separate components. The smallest resolution is 32 px.

**Captions** (:func:`caption` writes them, :func:`parse` reads them back exactly)::

    single_object   a {shape}                                   a circle
    two_object      a {shape} and a {shape}                     a circle and a square
    counting        {two|three|four} {shape}s                   three triangles
    colors          a {colour} {shape}                          a blue square
    position        a {colour} {shape} {relation} a {colour} {shape}
                                                                a red square to the left of a yellow triangle
    color_attr      a {colour} {shape} and a {colour} {shape}   a green circle and a red square

with ``{relation}`` one of ``to the left of``, ``to the right of``, ``above``, ``below``. The
two objects of a two-object caption are different shapes; those of a position or colour
attribution caption differ in shape and in colour. Counts run to four (GenEval's counting
asks for 2-4), which 32 px still holds.

**Requirements** (:func:`check`), by GenEval's rule: each object a caption names stands for
the most confident objects of its shape (:func:`detections`; confidence is how well an
outline fits), as many as it names, and everything else is judged on those alone:

- each named shape: at least one object of that shape;
- each named colour: the shape's chosen object has that colour (an extra square of another
  colour that fits its outline better, or as well and larger, makes "a red square" fail);
- a count n: exactly n objects of that shape (other shapes do not matter);
- a relation ``A rel B``: the chosen A and the chosen B are in that relation, by GenEval's
  rule on their boxes (:func:`relation_holds`), so a second A on the wrong side fails it
  when it is the one chosen.

So "a red square to the left of a yellow triangle" has five requirements (a square, the
square is red, a triangle, the triangle is yellow, the relation); "three circles" two (a
circle, exactly three); "a circle" one. An image meets its caption when every requirement
holds, which is GenEval's verdict exactly (its script judges colour and position on the most
confident detections, and a missing or miscoloured reference object fails the relation);
the fraction that hold is the partial credit the RL reward gives, read off the same chosen
objects. Objects a caption does not name are otherwise allowed, as in GenEval.

**Pretraining scenes** (:func:`scene_for`): exactly the caption's objects, no others, so a
caption describes its whole image; objects whose colour the caption leaves open get a random
one, and every object a uniformly random size and free place. Relations hold with a margin (a larger box allowance than the reader's), so a reader
that misplaces a centre by a pixel still sees them. With the ``ordered`` layout
(:data:`LAYOUTS`) a caption naming two objects puts them in opposite halves of the image,
the first named in the half its relation names (left for "to the left of", top for "above")
or, with no relation, on the left: a layout that word order alone decides, the same for
every pair.

**The split** (:func:`is_held_out`, :func:`split_prompts`): every caption of the world, in
:data:`CATEGORIES` order, goes to training or to the held-out set by what it composes, so no
held-out composition appears in a training caption of its category:

- single_object: the triangle (:data:`HELD_OUT_SHAPE`);
- two_object: the circle with the triangle, in either order (:data:`HELD_OUT_PAIR`);
- counting: a Latin square of counts and shapes (:data:`HELD_OUT_COUNTS`), so each count
  and each shape is still counted in training;
- colors: the captions of the bindings in :data:`HELD_OUT_BINDINGS` (a blue triangle, a
  yellow circle);
- position, color_attr: every caption of a pair of coloured objects in
  :data:`HELD_OUT_PAIRS` (12 of the 36 pairs, in either order and every relation: a third
  of each category), chosen so that each coloured object keeps four of its six partners in
  training and every pair of colours and of shapes is held out alike. A held-out caption
  is a new pairing of objects that training draws bound as named, each with other partners.
  The pairs come as six bags of words (two colours, two shapes) held out in both of their
  bindings: "a red circle and a green square" with "a red square and a green circle". Every
  bag training shows, it shows in both bindings too, so the words of a caption never tell
  which colour goes with which shape; their order does. (A split that held out one binding
  of a bag and trained the other let a model pass training by the bag alone, and it then
  drew the trained binding for the held-out caption: colours swapped.)

Holding out bindings across the two-object categories too (as an earlier split did: no
training caption showed a blue triangle or a yellow circle at all) teaches the opposite of
binding: whenever "yellow" and "circle" were in one training caption they named different
objects, so a model learns to paint the circle another colour and the other object
yellow, and held-out position and colour attribution stay at 0 however long it trains
(measured: 0 of 64 at 5000 steps of pretraining, where training captions of the same
categories reached 16 % and 25 %).

Position has most of the captions (288 of 390, as four relations of 72 ordered pairs), so a
prompt set read in uniform order spends most steps on it; a script that wants the categories
balanced picks a category first.

The two sets ship as ``digen/data/shapes_prompts.txt`` and ``shapes_heldout_prompts.txt``
(built-in prompt sets ``shapes`` and ``shapes-heldout``); ``python -m digen.shapes`` writes
them again from :func:`split_prompts`, and a test checks that they agree.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import permutations
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = [
    "BACKGROUND",
    "CATEGORIES",
    "COUNT_WORDS",
    "HELD_OUT_BINDINGS",
    "HELD_OUT_PAIRS",
    "HELD_OUT_COUNTS",
    "HELD_OUT_PAIR",
    "HELD_OUT_SHAPE",
    "MIN_RESOLUTION",
    "PALETTE",
    "POSITION_THRESHOLD",
    "RELATIONS",
    "SHAPES",
    "CaptionSpec",
    "Geometry",
    "ObjectSpec",
    "Placed",
    "Relation",
    "Requirement",
    "Scene",
    "SceneObject",
    "all_specs",
    "caption",
    "check",
    "detections",
    "geometry",
    "is_held_out",
    "parse",
    "relation_holds",
    "render",
    "scene_for",
    "shape_mask",
    "split_prompts",
    "vocabulary",
]

# --------------------------------------------------------------------------- vocabulary

SHAPES = ("circle", "square", "triangle")

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
}
"""The colours objects are drawn in, as RGB."""

BACKGROUND = (255, 255, 255)

CATEGORIES = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
"""GenEval's task categories, in GenEval's order."""

COUNT_WORDS = {2: "two", 3: "three", 4: "four"}
"""The counts a counting caption asks for, and their words."""


@dataclass(frozen=True, slots=True)
class Relation:
    """Where object A of ``A <relation> B`` is, seen from B."""

    phrase: str
    """The words of a caption: ``to the left of``."""
    direction: tuple[int, int]
    """The unit step ``(dx, dy)`` from B towards A in image coordinates (y grows down)."""


RELATIONS: dict[str, Relation] = {
    "left of": Relation("to the left of", (-1, 0)),
    "right of": Relation("to the right of", (1, 0)),
    "above": Relation("above", (0, -1)),
    "below": Relation("below", (0, 1)),
}
"""GenEval's relations, by the name a :class:`CaptionSpec` gives them."""

POSITION_THRESHOLD = 0.1
"""GenEval's allowance: each axis's centre offset shrinks by this much of the two boxes'
summed extent along it before the direction is judged."""

SCENE_POSITION_THRESHOLD = 0.3
"""The larger allowance :func:`scene_for` places related objects with, for a margin."""

MIN_RESOLUTION = 32

# --------------------------------------------------------------------------- scenes


@dataclass(frozen=True, slots=True)
class Geometry:
    """Object sizes and spacing at one resolution, in pixels."""

    resolution: int
    min_size: int
    """The smallest side of an object's box."""
    max_size: int
    margin: int
    """Free pixels between an object and the border, at least."""
    gap: int
    """Free pixels between two objects' boxes, at least."""


def geometry(resolution: int) -> Geometry:
    """Sizes 1/4 to 3/8 of the side, margin 1/32, gap 1/16 (8-12, 1 and 2 px at 32 px)."""
    if resolution < MIN_RESOLUTION:
        raise ValueError(
            f"resolution {resolution} is too small for the shapes world; "
            f"it needs at least {MIN_RESOLUTION} px."
        )
    return Geometry(
        resolution=resolution,
        min_size=round(resolution / 4),
        max_size=round(resolution * 3 / 8),
        margin=max(1, resolution // 32),
        gap=max(2, resolution // 16),
    )


@dataclass(frozen=True, slots=True)
class SceneObject:
    """One shape in a scene: its colour and its square box, in pixels."""

    shape: str
    colour: str
    left: int
    top: int
    size: int
    """The side of its box: the shape spans it fully across and down."""

    @property
    def x(self) -> float:
        """The centre's column."""
        return self.left + self.size / 2

    @property
    def y(self) -> float:
        """The centre's row."""
        return self.top + self.size / 2

    @property
    def width(self) -> int:
        return self.size

    @property
    def height(self) -> int:
        return self.size


@dataclass(frozen=True, slots=True)
class Scene:
    """Objects on a ``resolution`` x ``resolution`` canvas, each wholly inside it."""

    resolution: int
    objects: tuple[SceneObject, ...]

    def __post_init__(self) -> None:
        for o in self.objects:
            if o.shape not in SHAPES or o.colour not in PALETTE:
                raise ValueError(f"scene object {o} has a shape or colour the world lacks.")
            if min(o.left, o.top) < 0 or max(o.left, o.top) + o.size > self.resolution:
                raise ValueError(f"scene object {o} leaves the {self.resolution} px canvas.")


@lru_cache(maxsize=4096)
def shape_mask(shape: str, width: int, height: int) -> np.ndarray:
    """The pixels ``shape`` covers in a ``width`` x ``height`` box: ``[height, width]`` bool
    (read-only; cached). A pixel is covered when its centre is inside the shape; triangles
    are widened by half a pixel so that their apex row is drawn at every size."""
    ys = (np.arange(height, dtype=np.float32)[:, None] + 0.5) / height  # [h, 1] in (0, 1)
    xs = (np.arange(width, dtype=np.float32)[None, :] + 0.5) / width  # [1, w] in (0, 1)
    if shape == "square":
        mask = np.ones((height, width), dtype=bool)
    elif shape == "circle":
        mask = (2 * xs - 1) ** 2 + (2 * ys - 1) ** 2 <= 1.0
    elif shape == "triangle":  # apex at the top centre, base along the bottom
        mask = np.abs(xs - 0.5) * width <= ys * width / 2 + 0.5
    else:
        raise ValueError(f"shape {shape!r} is not one of {', '.join(SHAPES)}.")
    mask.flags.writeable = False
    return mask


def render(scene: Scene) -> np.ndarray:
    """``scene`` drawn at its resolution: ``[H, W, 3]`` uint8 RGB, hard-edged, exact colours."""
    r = scene.resolution
    image = np.empty((r, r, 3), dtype=np.uint8)
    image[:] = BACKGROUND
    for o in scene.objects:
        window = image[o.top : o.top + o.size, o.left : o.left + o.size]  # [s, s, 3]
        window[shape_mask(o.shape, o.size, o.size)] = PALETTE[o.colour]
    return image


# --------------------------------------------------------------------------- captions


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    """An object a caption names: its shape, its colour if named, how many."""

    shape: str
    colour: str | None = None
    count: int = 1


@dataclass(frozen=True, slots=True)
class CaptionSpec:
    """What a caption asks for; :func:`caption` writes it, :func:`parse` reads it."""

    category: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None
    """Position captions: where ``objects[0]`` is relative to ``objects[1]`` (a key of
    :data:`RELATIONS`)."""

    def __post_init__(self) -> None:
        problem = _form_problem(self)
        if problem:
            raise ValueError(f"{problem}.")


def _form_problem(spec: CaptionSpec) -> str:
    """What keeps ``spec`` from being a caption of the world ("" when nothing does)."""
    if spec.category not in CATEGORIES:
        return f"category {spec.category!r} is not one of {', '.join(CATEGORIES)}"
    for o in spec.objects:
        if o.shape not in SHAPES:
            return f"shape {o.shape!r} is not one of {', '.join(SHAPES)}"
        if o.colour is not None and o.colour not in PALETTE:
            return f"colour {o.colour!r} is not one of {', '.join(PALETTE)}"
    n_objects = {"single_object": 1, "colors": 1, "counting": 1}.get(spec.category, 2)
    coloured = spec.category in ("colors", "position", "color_attr")
    if len(spec.objects) != n_objects:
        return f"a {spec.category} caption names {n_objects} object(s), not {len(spec.objects)}"
    if any((o.colour is not None) != coloured for o in spec.objects):
        has = "has a colour" if coloured else "has no colour"
        return f"each object of a {spec.category} caption {has}"
    counts = [o.count for o in spec.objects]
    if spec.category == "counting" and counts[0] not in COUNT_WORDS:
        return f"a counting caption asks for {', '.join(map(str, COUNT_WORDS))} objects, not {counts[0]}"
    if spec.category != "counting" and counts != [1] * n_objects:
        return f"a {spec.category} caption asks for one of each object"
    if n_objects == 2 and spec.objects[0].shape == spec.objects[1].shape:
        return f"a {spec.category} caption names two different shapes"
    if n_objects == 2 and coloured and spec.objects[0].colour == spec.objects[1].colour:
        return f"a {spec.category} caption names two different colours"
    if (spec.relation is not None) != (spec.category == "position"):
        return "a relation belongs to position captions, and every position caption has one"
    if spec.relation is not None and spec.relation not in RELATIONS:
        return f"relation {spec.relation!r} is not one of {', '.join(RELATIONS)}"
    return ""


def _phrase(o: ObjectSpec) -> str:
    return f"a {o.colour} {o.shape}" if o.colour else f"a {o.shape}"


def caption(spec: CaptionSpec) -> str:
    """The caption that asks for ``spec`` (the grammar is in the module docstring)."""
    if spec.category == "counting":
        o = spec.objects[0]
        return f"{COUNT_WORDS[o.count]} {o.shape}s"
    if spec.category == "position":
        return f"{_phrase(spec.objects[0])} {RELATIONS[spec.relation].phrase} {_phrase(spec.objects[1])}"
    return " and ".join(_phrase(o) for o in spec.objects)


def _alternatives(words: Sequence[str]) -> str:
    return "|".join(re.escape(w) for w in words)


_OBJECT = rf"a (?:({_alternatives(PALETTE)}) )?({_alternatives(SHAPES)})"
_COUNTED = re.compile(rf"({_alternatives(COUNT_WORDS.values())}) ({_alternatives(SHAPES)})s")
_ONE = re.compile(_OBJECT)
_AND = re.compile(rf"{_OBJECT} and {_OBJECT}")
_RELATED = re.compile(
    rf"{_OBJECT} ({_alternatives([r.phrase for r in RELATIONS.values()])}) {_OBJECT}"
)
_COUNT_OF_WORD = {word: n for n, word in COUNT_WORDS.items()}
_RELATION_OF_PHRASE = {r.phrase: name for name, r in RELATIONS.items()}


def parse(text: str) -> CaptionSpec:
    """The :class:`CaptionSpec` a caption asks for; case and runs of spaces do not matter.

    A caption outside the grammar, or one that breaks a category's rules (two of one shape,
    say), is a ValueError of one sentence naming it.
    """
    words = " ".join(text.lower().split())
    if m := _COUNTED.fullmatch(words):
        category = "counting"
        objects = [ObjectSpec(m[2], None, _COUNT_OF_WORD[m[1]])]
        relation = None
    elif m := _ONE.fullmatch(words):
        category = "colors" if m[1] else "single_object"
        objects = [ObjectSpec(m[2], m[1])]
        relation = None
    elif m := _AND.fullmatch(words):
        category = "color_attr" if m[1] or m[3] else "two_object"
        objects = [ObjectSpec(m[2], m[1]), ObjectSpec(m[4], m[3])]
        relation = None
    elif m := _RELATED.fullmatch(words):
        category = "position"
        objects = [ObjectSpec(m[2], m[1]), ObjectSpec(m[5], m[4])]
        relation = _RELATION_OF_PHRASE[m[3]]
    else:
        raise ValueError(
            f"caption {text!r} is not one the shapes world reads (e.g. 'a circle', "
            "'a circle and a square', 'two circles', 'a blue square', "
            "'a red square to the left of a yellow triangle', 'a green circle and a red square')."
        )
    try:
        return CaptionSpec(category, tuple(objects), relation)
    except ValueError as exc:
        problem = str(exc).rstrip(".")
        raise ValueError(
            f"caption {text!r} is not a caption of the shapes world: {problem}."
        ) from None


@lru_cache(maxsize=1)
def vocabulary() -> tuple[str, ...]:
    """Every word the world's captions use, sorted: what a word-level tokenizer of the
    ``shapes`` flavour knows."""
    return tuple(sorted({w for spec in all_specs() for w in caption(spec).split()}))


def all_specs() -> Iterator[CaptionSpec]:
    """Every caption of the world, category by category in :data:`CATEGORIES` order."""
    objects = [ObjectSpec(s, c) for c in PALETTE for s in SHAPES]  # every coloured object
    pairs = [
        (a, b) for a, b in permutations(objects, 2) if a.shape != b.shape and a.colour != b.colour
    ]
    for s in SHAPES:
        yield CaptionSpec("single_object", (ObjectSpec(s),))
    for a, b in permutations(SHAPES, 2):
        yield CaptionSpec("two_object", (ObjectSpec(a), ObjectSpec(b)))
    for n in COUNT_WORDS:
        for s in SHAPES:
            yield CaptionSpec("counting", (ObjectSpec(s, None, n),))
    for o in objects:
        yield CaptionSpec("colors", (o,))
    for relation in RELATIONS:
        for a, b in pairs:
            yield CaptionSpec("position", (a, b), relation)
    for a, b in pairs:
        yield CaptionSpec("color_attr", (a, b))


# --------------------------------------------------------------------------- requirements


class Placed(Protocol):
    """What :func:`check` reads of an object: a scene's or one read off an image (which also
    has ``iou``, its outline's fit, and ``area``: :func:`detections`)."""

    @property
    def shape(self) -> str | None: ...
    @property
    def colour(self) -> str: ...
    @property
    def x(self) -> float: ...
    @property
    def y(self) -> float: ...
    @property
    def width(self) -> float: ...
    @property
    def height(self) -> float: ...


@dataclass(frozen=True, slots=True)
class Requirement:
    what: str
    """In words: ``a red square``, ``exactly three circles``."""
    met: bool


def relation_holds(
    a: Placed, b: Placed, relation: str, threshold: float = POSITION_THRESHOLD
) -> bool | np.ndarray:
    """Whether ``a`` is ``relation`` of ``b``, by GenEval's rule on their boxes.

    The centre offset ``a - b`` shrinks along each axis by ``threshold`` times the boxes'
    summed extent on that axis (not past zero); the relation holds when that shrunk offset,
    divided by the length of the whole offset, has a component above 0.5 along the
    relation's direction (within about 60 degrees of it). Numpy arrays broadcast, so one
    call can judge many candidate places.
    """
    dx, dy = RELATIONS[relation].direction
    off_x, off_y = np.subtract(a.x, b.x), np.subtract(a.y, b.y)
    shrunk_x = np.maximum(np.abs(off_x) - threshold * np.add(a.width, b.width), 0) * np.sign(off_x)
    shrunk_y = np.maximum(np.abs(off_y) - threshold * np.add(a.height, b.height), 0)
    shrunk_y = shrunk_y * np.sign(off_y)
    length = np.maximum(np.hypot(off_x, off_y), 1e-9)
    return (shrunk_x * dx + shrunk_y * dy) / length > 0.5


def detections(objects: Sequence[Placed], shape: str) -> list[Placed]:
    """The objects read as ``shape``, most confident first, as a detector lists a class.

    An object's confidence here is how well its outline fits the shape: its ``iou`` with the
    shape's outline where a reader measured one (:class:`digen.rewards.shapes.FoundObject`),
    and 1 for a scene's objects, which are the outline itself. Equal fits go to the larger
    object (its ``area`` where read, else its box), then to the one that comes first.
    """
    found = [o for o in objects if o.shape == shape]
    return sorted(found, key=lambda o: (-_fit(o), -_area(o)))  # stable: then the given order


def _fit(o: Placed) -> float:
    return float(getattr(o, "iou", 1.0))


def _area(o: Placed) -> float:
    return float(getattr(o, "area", o.width * o.height))


def check(spec: CaptionSpec, objects: Sequence[Placed]) -> tuple[Requirement, ...]:
    """Each requirement of ``spec`` and whether ``objects`` meet it, by GenEval's rule
    (the module docstring): each named object stands for the most confident
    :func:`detections` of its shape, as many as the caption names, and colour and relation
    are judged on those alone."""
    out = []
    chosen = []  # per named object: the detections that stand for it
    for want in spec.objects:
        found = detections(objects, want.shape)
        named = found[: want.count]
        out.append(Requirement(f"a {want.shape}", bool(found)))
        if want.colour is not None:
            coloured = bool(named) and all(o.colour == want.colour for o in named)
            out.append(Requirement(f"the {want.shape} is {want.colour}", coloured))
        if want.count > 1:
            out.append(
                Requirement(
                    f"exactly {COUNT_WORDS[want.count]} {want.shape}s", len(found) == want.count
                )
            )
        chosen.append(named)
    if spec.relation is not None:
        a, b = spec.objects
        held = all(relation_holds(p, q, spec.relation) for p in chosen[0] for q in chosen[1])
        what = (
            f"the {a.colour} {a.shape} {RELATIONS[spec.relation].phrase} the {b.colour} {b.shape}"
        )
        out.append(Requirement(what, bool(chosen[0]) and bool(chosen[1]) and bool(held)))
    return tuple(out)


# --------------------------------------------------------------------------- pretraining scenes

_CANDIDATES = 32
"""Places drawn at once for each object; the first free one is taken."""
_TRIES = 200


@dataclass(frozen=True, slots=True)
class _Candidates:
    """Boxes where an object might go: ``[C]`` arrays, duck-typed for :func:`relation_holds`."""

    left: np.ndarray
    top: np.ndarray
    size: np.ndarray

    @property
    def x(self) -> np.ndarray:
        return self.left + self.size / 2

    @property
    def y(self) -> np.ndarray:
        return self.top + self.size / 2

    @property
    def width(self) -> np.ndarray:
        return self.size

    @property
    def height(self) -> np.ndarray:
        return self.size


LAYOUTS = ("free", "ordered")
"""How :func:`scene_for` places the objects of a two-object caption: ``free`` anywhere the
caption allows; ``ordered`` in the halves the caption's word order names (see there)."""


def scene_for(
    spec: CaptionSpec, rng: np.random.Generator, resolution: int = 32, layout: str = "free"
) -> Scene:
    """A random scene that meets ``spec``: exactly its objects, each of a random size and
    place, with a random colour where the caption names none. The same ``rng`` state gives
    the same scene.

    With ``layout="ordered"`` a caption that names two objects (two objects, position,
    colour attribution) puts each in a half of the image: the first named in the half its
    relation names (the left half for "to the left of", the top for "above", ...) and the
    other in the opposite half; without a relation, the first named on the left. So where an
    object goes follows from the words around it, the same rule for every pair, which a
    small model learns from a few pairs and carries to pairs it never saw; with ``free``
    it has to infer the relation between two randomly placed objects. Other captions are
    placed as with ``free``; a place is still uniform within its half.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: choose one of {', '.join(LAYOUTS)}.")
    g = geometry(resolution)
    wanted = [(o.shape, o.colour) for o in spec.objects for _ in range(o.count)]
    colours = list(PALETTE)
    halves = _halves(spec) if layout == "ordered" and len(wanted) == 2 else None
    mid = resolution // 2
    for _ in range(_TRIES):
        placed: list[SceneObject] = []
        for k, (shape, colour) in enumerate(wanted):
            size = int(rng.integers(g.min_size, g.max_size + 1))
            low, high = g.margin, resolution - g.margin - size + 1  # [low, high) per axis
            if halves is None:
                corners = rng.integers(low, high, (2, _CANDIDATES))
            else:
                axis, first_low = halves
                in_low = first_low == (k == 0)
                span = (low, mid - g.gap // 2 - size + 1) if in_low else (mid + g.gap // 2, high)
                along = rng.integers(*span, _CANDIDATES)
                across = rng.integers(low, high, _CANDIDATES)
                corners = np.stack((along, across) if axis == 0 else (across, along))
            boxes = _Candidates(corners[0], corners[1], np.full(_CANDIDATES, size))
            free = np.ones(_CANDIDATES, dtype=bool)  # [C]
            for o in placed:
                across = _apart(boxes.left, size, o.left, o.size, g.gap)
                down = _apart(boxes.top, size, o.top, o.size, g.gap)
                free &= across | down  # apart along either axis: no overlap, and a gap
            if spec.relation is not None and placed:  # objects[1], seen from objects[0]
                free &= relation_holds(placed[0], boxes, spec.relation, SCENE_POSITION_THRESHOLD)
            if not free.any():
                break
            i = int(np.argmax(free))
            colour = colour if colour is not None else colours[int(rng.integers(len(colours)))]
            placed.append(SceneObject(shape, colour, int(boxes.left[i]), int(boxes.top[i]), size))
        else:
            return Scene(resolution, tuple(placed))
    raise RuntimeError(f"no scene for {caption(spec)!r} at {resolution} px after {_TRIES} tries.")


def _halves(spec: CaptionSpec) -> tuple[int, bool]:
    """``(axis, first_low)`` for an ordered two-object scene: the axis the halves split (0:
    x, 1: y) and whether the first named object takes the low half (left or top)."""
    if spec.relation is None:
        return 0, True
    dx, dy = RELATIONS[spec.relation].direction
    return (0, dx < 0) if dx else (1, dy < 0)


def _apart(start: np.ndarray, size: int, other: int, other_size: int, gap: int) -> np.ndarray:
    """``[C]`` whether each span ``[start, start + size)`` keeps ``gap`` free pixels from
    ``[other, other + other_size)`` along one axis."""
    return (start >= other + other_size + gap) | (start + size + gap <= other)


# --------------------------------------------------------------------------- the split

HELD_OUT_SHAPE = "triangle"
"""single_object: the shape whose plain caption is held out."""
HELD_OUT_PAIR = frozenset({"circle", "triangle"})
"""two_object: the pair of shapes held out, in either order."""
HELD_OUT_COUNTS = frozenset({(2, "square"), (3, "triangle"), (4, "circle")})
"""counting: (count, shape) held out, one per count and one per shape."""
HELD_OUT_BINDINGS = frozenset({("blue", "triangle"), ("yellow", "circle")})
"""colors: the (colour, shape) bindings whose single-object captions are held out."""


def _bag(
    colours: tuple[str, str], shapes: tuple[str, str]
) -> tuple[frozenset[tuple[str, str]], ...]:
    """The two pairs of coloured objects made of two colours and two shapes."""
    (c, d), (s, t) = colours, shapes
    return frozenset({(c, s), (d, t)}), frozenset({(c, t), (d, s)})


HELD_OUT_PAIRS = frozenset(
    {
        # each held-out bag of words (two colours, two shapes) in both of its bindings, so
        # training never decides a binding by its bag of words; the six bags take every
        # pair of colours once and every pair of shapes twice
        *_bag(("red", "green"), ("circle", "square")),
        *_bag(("blue", "yellow"), ("circle", "square")),
        *_bag(("red", "blue"), ("circle", "triangle")),
        *_bag(("green", "yellow"), ("circle", "triangle")),
        *_bag(("red", "yellow"), ("square", "triangle")),
        *_bag(("green", "blue"), ("square", "triangle")),
    }
)
"""position, color_attr: the pairs of coloured objects (colour, shape) held out, in either
order and every relation: 12 of the 36 pairs, each coloured object in exactly two of them,
each pair of colours twice and each pair of shapes four times, so every object, colour and
shape, and every binding, is still drawn beside other partners in training. They are six
whole bags of words (every pair of colours once, every pair of shapes twice and never twice
beside one colour), each in both bindings, so no caption's binding, held out or trained,
follows from its words without their order."""


def is_held_out(spec: CaptionSpec) -> bool:
    """Whether ``spec``'s caption is a held-out prompt (the rules are in the module docstring)."""
    if spec.category == "single_object":
        return spec.objects[0].shape == HELD_OUT_SHAPE
    if spec.category == "two_object":
        return {o.shape for o in spec.objects} == HELD_OUT_PAIR
    if spec.category == "counting":
        return (spec.objects[0].count, spec.objects[0].shape) in HELD_OUT_COUNTS
    if spec.category == "colors":
        return (spec.objects[0].colour, spec.objects[0].shape) in HELD_OUT_BINDINGS
    return frozenset((o.colour, o.shape) for o in spec.objects) in HELD_OUT_PAIRS


def split_prompts() -> tuple[list[str], list[str]]:
    """``(training, held_out)``: every caption of the world, in :func:`all_specs` order."""
    train, held_out = [], []
    for spec in all_specs():
        (held_out if is_held_out(spec) else train).append(caption(spec))
    return train, held_out


def balanced(prompts: Sequence[str], per_category: int) -> list[str]:
    """``per_category`` prompts of each category present in ``prompts`` (categories in
    :data:`CATEGORIES` order): a category's prompts cycled when it has fewer, an evenly spaced
    choice of them when it has more. An evaluation on the held-out set weighs each category
    alike this way (it has 1 single-object prompt and 96 position prompts).

    A prompt outside the shapes world is a ValueError naming it (:func:`parse`).
    """
    return [prompts[i] for i in balanced_indices(prompts, per_category)]


def balanced_indices(prompts: Sequence[str], per_category: int) -> list[int]:
    """The indices into ``prompts`` of :func:`balanced`'s choice, in its order."""
    by_category: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    for i, prompt in enumerate(prompts):
        by_category[parse(prompt).category].append(i)
    chosen = []
    for group in by_category.values():
        n = len(group)
        if n:
            chosen += [
                group[i * n // per_category] if n >= per_category else group[i % n]
                for i in range(per_category)
            ]
    return chosen


def _write_prompt_files() -> None:
    """Write the two shipped prompt files from :func:`split_prompts`."""
    from digen.prompts import BUILTIN_SETS

    data = Path(__file__).resolve().parent / "data"
    for name, prompts in zip(("shapes", "shapes-heldout"), split_prompts()):
        path = data / BUILTIN_SETS[name]
        path.write_text("".join(f"{p}\n" for p in prompts), encoding="utf-8")
        print(f"wrote {len(prompts)} prompts to {path}", file=sys.stderr)


if __name__ == "__main__":
    _write_prompt_files()
