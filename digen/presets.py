"""Starting configs per model x algorithm.

Two scales. With real weights (``model.path`` set) the settings follow the published
recipes: Flow-GRPO (SDE noise 0.7, a 2-step SDE window in the first half of 10 steps, clip
1e-4, advantages clipped at 5, KL 0.04, LoRA rank 32 / alpha 64, lr 3e-4) and DanceGRPO
(eta 0.3, 16 steps, 60 % of timesteps trained, clip 1e-4, advantages clipped at 5). The tiny
flavours run the same algorithms scaled down so a run takes minutes on a laptop CPU: fewer
steps and samples, a small LoRA, and a larger learning rate so learning is visible quickly.
"""

from __future__ import annotations

from typing import Any

from digen.errors import DigenError
from digen.models.registry import BACKBONES, MODEL_NAMES

__all__ = ["ALGO_NAMES", "preset"]

ALGO_NAMES = ("flowgrpo", "dancegrpo")


def preset(
    model: str, algo: str, *, real_weights: bool = False, mode: str = "colocated"
) -> dict[str, Any]:
    """The nested config dict for ``model`` x ``algo`` (tiny flavour unless ``real_weights``).

    ``mode="disaggregated"`` steps the optimizer once per train step (no mini-batches).
    """
    if model not in MODEL_NAMES:
        raise DigenError(f"unknown model '{model}'; choose one of: {', '.join(MODEL_NAMES)}.")
    if algo not in ALGO_NAMES:
        raise DigenError(f"unknown algorithm '{algo}'; choose one of: {', '.join(ALGO_NAMES)}.")
    cfg: dict[str, Any] = {"model": {"name": model}, "algo": {"name": algo}}
    if real_weights:
        _real(cfg, model, algo)
    else:
        _tiny(cfg, model, algo)
    cfg["runtime"] = {"mode": mode}
    if mode == "disaggregated":
        cfg["train"].pop("mini_batch_size", None)
    return cfg


def _tiny(cfg: dict[str, Any], model: str, algo: str) -> None:
    cfg["steps"] = 30
    if not BACKBONES[model].video:
        # 64 px: at 32 px a JPEG is mostly header and the reward barely depends on the sample
        cfg["model"].update({"height": 64, "width": 64})
    cfg["data"] = {"train_batch_size": 2}
    cfg["train"] = {
        # a random-init tiny model needs a large step to move visibly within a few dozen steps
        "lr": 1e-1,
        "lora_rank": 16,
        "lora_alpha": 16.0,
        "mini_batch_size": 1,  # two optimizer steps per train step: the second one is off-policy
        "micro_batch_size": 8,
        "max_grad_norm": 1.0,
    }
    if algo == "flowgrpo":
        cfg["rollout"] = {
            "n": 8,
            "num_inference_steps": 6,
            "sde_type": "sde",
            "noise_level": 0.7,
            "sde_window_size": 2,
            "sde_window_range": [0, 3],
        }
        # no KL for the tiny demo: it holds a random model near its random start
        cfg["algo"].update({"clip_ratio": 1e-4, "adv_clip_max": 5.0, "kl_coef": 0.0})
    else:
        cfg["rollout"] = {
            "n": 8,
            "num_inference_steps": 6,
            "sde_type": "dance",
            "noise_level": 0.3,
            "sde_window_size": 0,
            "timestep_fraction": 0.5,
        }
        cfg["algo"].update({"clip_ratio": 1e-4, "adv_clip_max": 5.0, "kl_coef": 0.0})


def _real(cfg: dict[str, Any], model: str, algo: str) -> None:
    m = BACKBONES[model].recipe
    cfg["model"].update({"height": m["height"], "width": m["width"], "dtype": "bfloat16"})
    if "num_frames" in m:
        cfg["model"]["num_frames"] = m["num_frames"]
    cfg["data"] = {"train_batch_size": 8}
    cfg["train"] = {
        "lr": 3e-4,
        "lora_rank": 32,
        "lora_alpha": 64.0,
        "lora_dtype": "float32",
        "mini_batch_size": 4,
        "micro_batch_size": 4,
    }
    if algo == "flowgrpo":
        cfg["rollout"] = {
            "n": 16,
            "num_inference_steps": 10,
            "sde_type": "sde",
            "noise_level": 0.7,
            "sde_window_size": 2,
            "sde_window_range": [0, 5],
            "guidance_scale": m["guidance_scale"],
        }
        cfg["algo"].update({"clip_ratio": 1e-4, "adv_clip_max": 5.0, "kl_coef": 0.04})
    else:
        cfg["rollout"] = {
            "n": 12,
            "num_inference_steps": 16,
            "sde_type": "dance",
            "noise_level": 0.3,
            "sde_window_size": 0,
            "timestep_fraction": 0.6,
            "guidance_scale": m["guidance_scale"],
        }
        cfg["algo"].update({"clip_ratio": 1e-4, "adv_clip_max": 5.0, "kl_coef": 0.0})
