"""Every backbone digen knows, by name: one entry each, and nothing heavy to import.

Config validation, presets and the CLI read this (a typo in ``--model`` is reported without
importing torch or diffusers); :func:`digen.models.get_adapter_class` imports an adapter only
when it is used. To add a backbone, write its adapter file (``digen/models/<name>.py``, one
class over the diffusers model, see ``docs/EXTENDING.md``) and add one line here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from digen.errors import DigenError

__all__ = ["BACKBONES", "FLAVOURS", "MODEL_NAMES", "Backbone", "get_backbone"]

FLAVOURS: tuple[str, ...] = ("tiny", "medium", "shapes")
"""Weights a backbone runs without ``model.path`` (``model.flavour``): the random-init sizes
every backbone builds from code, ``tiny`` (toy width, tests and CPUs) and ``medium`` (about 1B
transformer parameters, for a GPU), and ``shapes``, weights pretrained on the shapes world
(:mod:`digen.shapes`) that ship inside the package for the backbones that have them (flux, sd3),
so RL on the shapes task starts from a model that already draws it."""


@dataclass(frozen=True, slots=True)
class Backbone:
    """One registered backbone."""

    name: str
    adapter: str
    """``"module:Class"`` of its :class:`~digen.models.base.DiffusionAdapter`."""
    video: bool
    """Generates videos (frames) rather than images."""
    pipeline: str = ""
    """The diffusers pipeline class a model directory of this backbone names in its
    ``model_index.json`` (``_class_name``)."""
    recipe: dict[str, Any] = field(default_factory=dict)
    """Sampling settings of the published recipes with real weights: ``height``, ``width``,
    ``num_frames`` (videos), ``guidance_scale``."""
    run_flavour: str = "tiny"
    """The flavour ``digen run`` trains when told no weights (no ``--flavour``,
    ``--model-path``, ``--config`` or ``model.*`` weights override): for flux, the default
    backbone, its pretrained ``shapes`` model, so the bare command shows a model learning
    something a person can judge; ``tiny`` for the others (sd3 ships shapes weights too,
    taken with ``--flavour shapes``)."""
    params: float = 0.0
    """Parameters of the published transformer (the denoiser only), from its model card: what
    the planner (:mod:`digen.planning.hardware`) moves and stores on a GPU."""
    blocks: int = 0
    """Transformer blocks of the published model (a sharded model gathers one at a time)."""
    hidden: int = 0
    """Hidden width of the published model (a LoRA adapter's size follows it)."""


BACKBONES: dict[str, Backbone] = {
    b.name: b
    for b in (
        Backbone(
            "hunyuanvideo",
            "digen.models.hunyuanvideo:HunyuanVideoAdapter",
            video=True,
            pipeline="HunyuanVideoPipeline",
            recipe={"height": 320, "width": 512, "num_frames": 33, "guidance_scale": 1.0},
            params=13e9,
            blocks=60,
            hidden=3072,
        ),
        Backbone(
            "wan",
            "digen.models.wan:WanAdapter",
            video=True,
            pipeline="WanPipeline",
            recipe={"height": 480, "width": 832, "num_frames": 33, "guidance_scale": 5.0},
            params=14e9,
            blocks=40,
            hidden=5120,
        ),
        Backbone(
            "flux",
            "digen.models.flux:FluxAdapter",
            video=False,
            pipeline="FluxPipeline",
            recipe={"height": 512, "width": 512, "guidance_scale": 1.0},
            run_flavour="shapes",
            params=12e9,
            blocks=57,
            hidden=3072,
        ),
        Backbone(
            "qwenimage",
            "digen.models.qwenimage:QwenImageAdapter",
            video=False,
            pipeline="QwenImagePipeline",
            recipe={"height": 512, "width": 512, "guidance_scale": 4.0},
            params=20e9,
            blocks=60,
            hidden=3072,
        ),
        Backbone(
            "sd3",
            "digen.models.sd3:SD3Adapter",
            video=False,
            pipeline="StableDiffusion3Pipeline",
            recipe={"height": 512, "width": 512, "guidance_scale": 4.5},
            params=8.1e9,
            blocks=38,
            hidden=2432,
        ),
    )
}
MODEL_NAMES: tuple[str, ...] = tuple(BACKBONES)


def get_backbone(name: str) -> Backbone:
    """The backbone registered as ``name``; one sentence naming the choices when none is."""
    if name not in BACKBONES:
        raise DigenError(f"unknown model '{name}'; choose one of: {', '.join(MODEL_NAMES)}.")
    return BACKBONES[name]
