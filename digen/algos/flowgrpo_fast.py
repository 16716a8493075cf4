"""Flow-GRPO-Fast: Flow-GRPO that draws noise, and trains, only in a short window.

Published form (the Flow-GRPO repository's ``*_fast_nocfg`` configs for SD3.5-M): of 10
sampling steps, a window of 3 consecutive steps whose start is drawn per train step from the
first half (``sde_window_range = (0, N // 2)``) draws noise with the coefficients-preserving
``cps`` step (noise level 0.8, log-prob ``-mean((x' - mu)^2)``) and trains; every other
step is an Euler (ODE) step. No CFG in sampling or training, PPO clip 1e-5, no KL, whole-
batch advantage std. The rest is Flow-GRPO's.

digen's SDE window already expresses all of it (``rollout.sde_window_size`` /
``sde_window_range`` with :class:`~digen.algos.flowgrpo.FlowGRPO`'s noisy steps), so this file is
the recipe alone: the same noisy steps, step math and loss as ``flowgrpo``, with the published
settings as its preset. ``--algo flowgrpo`` with the same settings runs the same thing.
With real weights the preset is ``geneval_sd3_fast_nocfg`` for SD3.5-M and
``geneval_flux_fast`` for FLUX (6 steps, a window in ``[0, 3)``; FLUX's guidance is its
embedded 3.5, with no CFG), with Flow-GRPO's batch, LoRA and evaluation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digen.algos.flowgrpo import FlowGRPO, lora_train, recipe

if TYPE_CHECKING:
    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["FlowGRPOFast"]


class FlowGRPOFast(FlowGRPO):
    name = "flowgrpo-fast"
    title = (
        "Flow-GRPO-Fast (Flow-GRPO repository): noise and training in a 3-step cps window "
        "of the first half, ODE elsewhere, no CFG"
    )
    sde_types = ("cps", "sde")
    samples_without_guidance = True

    def check(self, cfg: DigenConfig) -> str | None:
        if cfg.rollout.sde_window_size == 0:
            return (
                "rollout.sde_window_size = 0 is not allowed: Flow-GRPO-Fast trains a window "
                "of steps (use --algo flowgrpo to train every step)"
            )
        return super().check(cfg)

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        rec = recipe(backbone)
        steps, window = (rec["steps"], 3) if real_weights else (6, 2)
        rollout = {
            "n": 24 if real_weights else 8,
            "num_inference_steps": steps,
            "sde_type": "cps",
            "noise_level": 0.8,
            "sde_window_size": window,
            "sde_window_range": [0, steps // 2],
            "guidance_scale": 1.0,
        }
        algo = {
            "clip_ratio": 1e-5,
            "adv_clip_max": 5.0,
            "adv_std": "global",
            "adv_std_unbiased": False,
            "adv_eps": 1e-4,
            "kl_coef": 0.0,
        }
        out: dict[str, dict[str, Any]] = {"rollout": rollout, "algo": algo}
        if real_weights:  # geneval_sd3_fast_nocfg / geneval_flux_fast: Flow-GRPO's batch
            out["data"] = {"train_batch_size": 48}
            out["train"] = {**lora_train(rec), "mini_batch_size": 24}
            out["eval"] = {"num_inference_steps": rec["eval_steps"], "solver": "euler"}
        return out
