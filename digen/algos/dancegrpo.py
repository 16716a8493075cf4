"""DanceGRPO: GRPO on visual generation with a score-corrected SDE at every step.

Published form (Xue et al. 2025, official code): the first ``N - 1`` denoising steps draw
noise with the ``dance`` step (``eta = 0.3`` FLUX, ``0.25`` HunyuanVideo; 16 steps); the image
decoded is the last step's clean prediction ``x - sigma v``, so no drawn noise reaches it
directly; each sample trains its own random ``timestep_fraction`` (0.6) of steps ``0 ..
N - 2``; the samples of a group share their initial noise; advantages are per group with the
unbiased std (+ 1e-8), clipped at 5; best-of-N (HunyuanVideo: 8 of 24) keeps the top and
bottom halves by advantage; PPO clip 1e-4; no KL term. Its transformer is told
``int(1000 sigma)`` (``rollout.time_input=int1000``) on sigmas with a fixed shift
(``rollout.shift``: 3 FLUX and Wan, 5 HunyuanVideo).

The real-weights presets mirror the official scripts (``scripts/finetune/``): for the image
backbones ``finetune_flux_grpo_8gpus_lora.sh`` (16 prompts x 12 a round on 8 GPUs, an
optimizer step per 12 samples of a GPU, so two of 8 prompts each; 12 steps, 720 px, LoRA rank
128 / alpha 256 on ``to_q/k/v/out.0`` at lr 3e-4); for HunyuanVideo
``finetune_hunyuan_grpo.sh``; for Wan ``finetune_wan_2_1_grpo.sh``. Those two fine-tune
fully at lr 1e-5 where the presets keep the FLUX LoRA (``docs/TRAINING.md`` says why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digen.algos.base import Algorithm, NoisySteps

if TYPE_CHECKING:
    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["LORA_TARGETS", "DanceGRPO"]

LORA_TARGETS = ("to_k", "to_q", "to_v", "to_out.0")
"""LoRA targets of ``train_grpo_flux_lora.py``: every attention's query, key, value and output."""

_LORA = {
    "lora_rank": 128,
    "lora_alpha": 256.0,
    "lora_init": True,  # init_lora_weights=True: peft's Kaiming-uniform A
    "lr": 3e-4,
    "weight_decay": 1e-4,
    "max_grad_norm": 1.0,
}
"""The LoRA recipe of ``finetune_flux_grpo_8gpus_lora.sh`` (on :data:`LORA_TARGETS`)."""

_RECIPE: dict[str, dict[str, dict[str, Any]]] = {
    # finetune_flux_grpo_8gpus_lora.sh: 8 GPUs x 2 prompts x 12, gradient_accumulation_steps 12
    "flux": {
        "data": {"train_batch_size": 16},
        "model": {"height": 720, "width": 720},
        "rollout": {"n": 12, "num_inference_steps": 12, "noise_level": 0.3, "shift": 3.0},
        "train": {"mini_batch_size": 8},
    },
    # finetune_hunyuan_grpo.sh: 32 GPUs x 1 prompt x 24, best of 8, gradient_accumulation_steps
    # 4 (two optimizer steps of 4 kept samples a GPU: 16 prompts' worth)
    "hunyuanvideo": {
        "data": {"train_batch_size": 32},
        "model": {"height": 480, "width": 480, "num_frames": 53},
        "rollout": {"n": 24, "num_inference_steps": 16, "noise_level": 0.25, "shift": 5.0},
        "algo": {"best_of_n": 8},
        "train": {"mini_batch_size": 16},
    },
    # finetune_wan_2_1_grpo.sh: Wan2.1-T2V-1.3B on single frames, 8 GPUs x 2 prompts x 12,
    # gradient_accumulation_steps 24 (one optimizer step a round), CFG 5 (cfg_infer)
    "wan": {
        "data": {"train_batch_size": 16},
        "model": {"height": 512, "width": 512, "num_frames": 1},
        "rollout": {
            "n": 12,
            "num_inference_steps": 20,
            "noise_level": 0.3,
            "shift": 3.0,
            "guidance_scale": 5.0,
        },
        "train": {"mini_batch_size": 16},
    },
}


class DanceGRPO(Algorithm):
    name = "dancegrpo"
    title = "DanceGRPO (Xue et al. 2025): score-corrected SDE at every step, clean last-step decode"
    sde_types = ("dance",)
    kl_type = "exact"

    def noisy_steps(self, cfg: DigenConfig, step: int) -> NoisySteps:
        """Steps ``0 .. N-2`` draw noise and may train; the last is the Euler step to
        ``sigma = 0``, which makes exactly the clean prediction ``x - sigma v`` (decoded)."""
        steps = tuple(range(cfg.rollout.num_inference_steps - 1))
        return NoisySteps(steps, steps)

    def check(self, cfg: DigenConfig) -> str | None:
        r = cfg.rollout
        if r.sde_window_size != 0:
            return (
                f"rollout.sde_window_size = {r.sde_window_size} is not allowed: DanceGRPO draws "
                "noise at every step but the last, so leave it 0 (rollout.timestep_fraction "
                "chooses the trained steps)"
            )
        if r.num_inference_steps < 2:
            return (
                f"rollout.num_inference_steps = {r.num_inference_steps} is not allowed: "
                "DanceGRPO trains steps 0 .. N-2, so it needs at least 2"
            )
        return None

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        common = {
            "sde_type": "dance",
            "sde_window_size": 0,
            "same_initial_noise": True,
            "time_input": "int1000",  # its code tells the transformer int(1000 sigma) / 1000
        }
        algo = {
            "clip_ratio": 1e-4,
            "adv_clip_max": 5.0,
            "adv_std": "group",
            "adv_std_unbiased": True,
            "adv_eps": 1e-8,
            "kl_coef": 0.0,
        }
        if not real_weights:
            rollout = {"n": 8, "num_inference_steps": 6, "noise_level": 0.3}
            rollout["timestep_fraction"] = 0.5
            return {"rollout": {**common, **rollout}, "algo": algo}
        # a backbone without an official script of its own (sd3, qwenimage): FLUX's, at the
        # backbone's own size and schedule
        rec = _RECIPE.get(backbone.name)
        if rec is None:
            rec = {k: v for k, v in _RECIPE["flux"].items() if k != "model"}
            rec["rollout"] = {k: v for k, v in rec["rollout"].items() if k != "shift"}
        out: dict[str, dict[str, Any]] = {
            "rollout": {**common, "timestep_fraction": 0.6},
            "algo": algo,
            "train": {**_LORA, "lora_targets": list(LORA_TARGETS)},
        }
        for section, values in rec.items():
            out[section] = {**out.get(section, {}), **values}
        return out
