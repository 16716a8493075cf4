"""DanceGRPO: GRPO on visual generation with a score-corrected SDE at every step.

Published form (Xue et al. 2025, official code): the first ``N - 1`` denoising steps draw
noise with the ``dance`` step (``eta = 0.3`` FLUX, ``0.25`` HunyuanVideo; 16 steps); the image
decoded is the last step's clean prediction ``x - sigma v``, so no drawn noise reaches it
directly; each sample trains its own random ``timestep_fraction`` (0.6) of steps ``0 ..
N - 2``; the samples of a group share their initial noise; advantages are per group with the
unbiased std (+ 1e-8), clipped at 5; best-of-N (HunyuanVideo: 8 of 24) keeps the top and
bottom halves by advantage; PPO clip 1e-4; no KL term.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digen.algos.base import Algorithm, NoisySteps

if TYPE_CHECKING:
    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["DanceGRPO"]

_ETA = {"flux": 0.3, "hunyuanvideo": 0.25}


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
        video = backbone.video
        rollout = {
            "n": 24 if video else 12,
            "num_inference_steps": 16,
            "noise_level": _ETA.get(backbone.name, 0.3),
            "timestep_fraction": 0.6,
        }
        if video:
            algo["best_of_n"] = 8
        # the published LoRA recipe (FLUX): rank 128 / alpha 256 at lr 3e-4, weight decay 1e-4
        # (the last two are train.lr's and train.weight_decay's defaults)
        train = {"lora_rank": 128, "lora_alpha": 256.0}
        return {"rollout": {**common, **rollout}, "algo": algo, "train": train}
