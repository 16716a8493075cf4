"""Starting configs per model x algorithm x mode: the layer under a user's own settings.

Two scales. With real weights (``model.path`` set) each algorithm's preset is its published
recipe (see the algorithm's file and the tables in ``docs/TRAINING.md``, which list what
digen cannot reproduce), with the backbone's published sampling size and guidance where the
algorithm's own config does not set them. The tiny flavours run the same algorithms scaled
down so a run takes a minute on a laptop CPU: fewer steps and samples, a small LoRA, a larger
learning rate so learning shows within a few dozen steps. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any

from digen.registry.algos import ALGO_NAMES, get_algorithm
from digen.registry.models import get_backbone

__all__ = ["ALGO_NAMES", "SHAPES_TASK", "preset"]

SHAPES_LR = 1e-3
"""The LoRA learning rate of RL from the shapes flavour (a model that already draws)."""


SHAPES_TASK: dict[str, Any] = {
    "data": {"prompts": "shapes", "train_batch_size": 4, "per_category": 192},
    "rewards": [{"name": "shapes"}],
    "eval": {"every": 10, "samples": 1, "per_category": 32},
    "rollout": {"num_inference_steps": 10, "guidance_scale": 3.0},
}
"""What the pretrained ``shapes`` flavour trains on by default: the shapes world's training
captions, 4 a step (the tiny flavours' 2 barely move the held-out reward in 30 steps), each
category's captions 192 times an epoch (every caption kept; drawn as they come, 192 of the
262 are position captions and 2 ask for one object, and the FLUX weights fell with both
seeds tried where with every category alike none of ten runs fell), the GenEval-style
``shapes`` reward, and held-out accuracy every 10 steps on 32 images of each category (the
held-out set has 1 to 96 prompts a category, so one image a prompt would leave the
single-object figure to 1 image and GenEval's per-category mean to chance). 10 sampling
steps: at 6 the base model gets few held-out captions right. Guidance 3 against the empty
prompt (the flavours were pretrained with caption dropout for it), in sampling and
evaluation as Flow-GRPO samples with CFG. docs/TRAINING.md has the measurements."""


def preset(
    model: str,
    algo: str,
    *,
    real_weights: bool = False,
    mode: str = "colocated",
    flavour: str = "tiny",
) -> dict[str, Any]:
    """The nested config dict for ``model`` x ``algo`` (tiny flavour unless ``real_weights``).

    ``flavour="shapes"`` (weights pretrained on the shapes world) keeps the flavour's own
    32 px and trains the shapes task (:data:`SHAPES_TASK`) at a learning rate for a model
    that already draws.

    ``mode`` is only written into ``runtime.mode``: both modes run the same recipe (the
    same mini-batches and optimizer steps), so a comparison of modes compares speed alone.
    """
    backbone = get_backbone(model)
    algorithm = get_algorithm(algo)
    cfg: dict[str, Any] = {"model": {"name": model}, "algo": {"name": algo}}
    if real_weights:
        recipe = backbone.recipe
        cfg["model"].update(
            {"height": recipe["height"], "width": recipe["width"], "dtype": "bfloat16"}
        )
        if "num_frames" in recipe:
            cfg["model"]["num_frames"] = recipe["num_frames"]
        cfg["rollout"] = {"guidance_scale": recipe["guidance_scale"]}
        # each algorithm's preset sets its published batch (data.train_batch_size prompts,
        # train.mini_batch_size of them an optimizer step) and LoRA; the learning rate is
        # train.lr's default (the published LoRA rate) unless it says otherwise
        cfg["train"] = {
            "lora_rank": 32,
            "lora_alpha": 64.0,
            "lora_dtype": "float32",
            "micro_batch_size": 4,
        }
    else:
        cfg["steps"] = 30
        if flavour == "shapes":
            pass  # the flavour's own size: what its weights were trained at
        elif not backbone.video:
            # 64 px: at 32 px a JPEG is mostly header and the reward barely depends on the sample
            cfg["model"].update({"height": 64, "width": 64})
        cfg["data"] = {"train_batch_size": 2}
        cfg["train"] = {
            # a random-init tiny model needs a large step to move visibly in a few dozen steps
            "lr": 1e-1,
            "lora_rank": 16,
            "lora_alpha": 16.0,
            "mini_batch_size": 1,  # two optimizer steps per train step: the second is off-policy
            "micro_batch_size": 8,
            "max_grad_norm": 1.0,
        }
    for section, values in algorithm.preset(backbone, real_weights).items():
        cfg[section] = {**cfg.get(section, {}), **values}
    if flavour == "shapes" and not real_weights:
        cfg["model"]["flavour"] = "shapes"
        cfg["train"]["lr"] = SHAPES_LR
        for section, values in SHAPES_TASK.items():
            cfg[section] = (
                values if isinstance(values, list) else {**cfg.get(section, {}), **values}
            )
        if algorithm.samples_without_guidance:  # its recipe's own: the task's is for the rest
            cfg["rollout"]["guidance_scale"] = 1.0
    cfg["runtime"] = {"mode": mode}
    return cfg
