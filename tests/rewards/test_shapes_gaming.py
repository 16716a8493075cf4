"""Images made to game the shapes reward score no higher than the shipped model's samples.

GenEval's rule judges each named object by the most confident detection of its shape, so an
image that holds everything (every colour of every shape), a canvas filled with one colour,
noise or nothing should not beat a model that draws what it is asked. The model's figure is
measured here, on the same held-out prompts, with the evaluation's fixed noise.
"""

from __future__ import annotations

import json
from functools import cache

import numpy as np
import pytest
import torch

from digen.models.base import PRETRAINED_ROOT
from digen.rewards.shapes import accuracy, evaluate, find_objects
from digen.run.shapes_pretrain import evaluate_model, evaluation_prompts
from digen.shapes import PALETTE, SHAPES, Scene, SceneObject, render

# one worker samples the shipped model once for every case
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_shapes_gaming")]

PER_CATEGORY = 16
RESOLUTION = 32


def catalogue() -> np.ndarray:
    """Every colour x shape pair on one 32 px canvas: 4 columns of colours, 3 rows of shapes,
    6 px objects 2 px apart."""
    objects = [
        SceneObject(shape, colour, left=1 + 8 * c, top=2 + 10 * r, size=6)
        for r, shape in enumerate(SHAPES)
        for c, colour in enumerate(PALETTE)
    ]
    return render(Scene(RESOLUTION, tuple(objects)))


def fills() -> list[np.ndarray]:
    return [np.full((RESOLUTION, RESOLUTION, 3), rgb, dtype=np.uint8) for rgb in PALETTE.values()]


def noise() -> np.ndarray:
    rng = np.random.default_rng(0)
    return rng.integers(0, 256, (RESOLUTION, RESOLUTION, 3), dtype=np.uint8)


def blank() -> np.ndarray:
    return np.full((RESOLUTION, RESOLUTION, 3), 255, dtype=np.uint8)


@cache
def shipped_heldout() -> tuple[float, list[str]]:
    """The shipped FLUX shapes model's held-out accuracy, at its recipe's evaluation settings."""
    path = PRETRAINED_ROOT / "flux-shapes"
    recipe = json.loads((path / "recipe.json").read_text())["recipe"]
    results, _ = evaluate_model(
        path,
        steps=recipe["eval_steps"],
        guidance=recipe["eval_guidance"],
        per_category=PER_CATEGORY,
        prompt_sets=("heldout",),
    )
    return results["heldout"]["overall"], evaluation_prompts(PER_CATEGORY)["heldout"]


def score(frame: np.ndarray, prompts: list[str]) -> float:
    """Held-out accuracy of ``frame`` offered as the sample of every prompt."""
    samples = torch.from_numpy(np.stack([frame] * len(prompts)))[:, None]  # [B, 1, H, W, 3]
    return accuracy(evaluate(samples, prompts))["overall"]


def test_the_catalogue_is_read_as_every_colour_and_shape() -> None:
    read = sorted((o.colour, o.shape) for o in find_objects(catalogue()))
    assert read == sorted((c, s) for c in PALETTE for s in SHAPES)


@pytest.mark.parametrize(
    "name",
    [
        "catalogue",
        "fill-red",
        "fill-green",
        "fill-blue",
        "fill-yellow",
        "noise",
        "blank",
    ],
)
def test_a_gaming_image_scores_no_higher_than_the_shipped_model(name: str) -> None:
    """GenEval's rule lets extra objects pass, so the catalogue takes every single- and
    two-object caption (0.385 held-out); the shipped model scores above it by drawing
    counts, colours, sides and bindings right (0.61 at its recipe's settings)."""
    base, prompts = shipped_heldout()
    frame = {
        "catalogue": catalogue,
        "noise": noise,
        "blank": blank,
        **{f"fill-{c}": (lambda f=f: f) for c, f in zip(PALETTE, fills(), strict=True)},
    }[name]()
    assert score(frame, prompts) <= base, (name, base)
