"""Flow-GRPO: GRPO for flow matching with an SDE that keeps the probability-flow marginals.

Published form (Liu et al. 2025, official code): every denoising step draws noise with the
``sde`` step (``a = 0.7`` for SD3.5, ``0.9`` for FLUX; 10 and 6 sampling steps), the last
step's noise included — its output is the decoded image — and the first ``N - 1`` steps
train (its ``timestep_fraction = 0.99``); the log-prob is the Gaussian density per element;
advantages are centred per prompt and divided by one population std over the whole batch
(+ 1e-4), clipped at 5; PPO clip 1e-4; KL ``beta = 0.04`` (SD3.5 OCR / GenEval) divided by
``std_dev_t^2`` without the step's ``|dt|`` (``algo.kl_type: flowgrpo``). The "fast"
variant draws noise only inside a window of ``W`` steps whose start is drawn per step
(``rollout.sde_window_size``, ``rollout.sde_window_range``), ODE elsewhere; its ``cps``
step (coefficients-preserving sampling) uses the log-prob ``-mean((x' - mu)^2)``
(``rollout.cps_logprob: published``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digen.algos.base import Algorithm, NoisySteps

if TYPE_CHECKING:
    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["FlowGRPO"]

# Published sampling per backbone: noise level, steps, KL beta, LoRA rank / alpha.
_RECIPE = {
    "flux": {"noise_level": 0.9, "steps": 6, "kl": 0.0, "rank": 64, "alpha": 128.0},
    "sd3": {"noise_level": 0.7, "steps": 10, "kl": 0.04, "rank": 32, "alpha": 64.0},
    "wan": {"noise_level": 0.7, "steps": 10, "kl": 0.004, "rank": 32, "alpha": 64.0},
}
_DEFAULT_RECIPE = _RECIPE["sd3"]


class FlowGRPO(Algorithm):
    name = "flowgrpo"
    title = "Flow-GRPO (Liu et al. 2025): marginal-preserving SDE or coefficients-preserving (cps) steps"
    sde_types = ("sde", "cps")
    kl_type = "flowgrpo"

    def noisy_steps(self, cfg: DigenConfig, step: int) -> NoisySteps:
        """No window: every step draws noise (not the last with ``cps``, whose last step
        has none) and all but the last train. A window: it alone draws noise and trains."""
        r = cfg.rollout
        n = r.num_inference_steps
        if r.sde_window_size == 0:
            noisy = n - 1 if r.sde_type == "cps" else n
            return NoisySteps(tuple(range(noisy)), tuple(range(min(noisy, n - 1))))
        from digen.algos.timesteps import sde_window

        window = sde_window(
            seed=cfg.seed,
            step=step,
            num_inference_steps=n,
            window_size=r.sde_window_size,
            window_range=r.sde_window_range,
            sde_type=r.sde_type,
        )
        return NoisySteps(tuple(window), tuple(window))

    def log_prob_form(self, kind: str, cfg: DigenConfig) -> str:
        if kind == "cps" and cfg.rollout.cps_logprob == "published":
            return "mse"
        return "gaussian"

    def check(self, cfg: DigenConfig) -> str | None:
        r = cfg.rollout
        if r.num_inference_steps < 2:
            return (
                f"rollout.num_inference_steps = {r.num_inference_steps} is not allowed: "
                "Flow-GRPO trains all but the last step, so it needs at least 2"
            )
        return None

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        if not real_weights:
            # scaled down: a 2-step window in the first half of 6 steps; per-group std (the
            # published whole-batch std would hold every update until the batch is scored)
            return {
                "rollout": {
                    "n": 8,
                    "num_inference_steps": 6,
                    "sde_type": "sde",
                    "noise_level": 0.7,
                    "sde_window_size": 2,
                    "sde_window_range": [0, 3],
                },
                "algo": {"clip_ratio": 1e-4, "adv_clip_max": 5.0, "kl_coef": 0.0},
            }
        rec = _RECIPE.get(backbone.name, _DEFAULT_RECIPE)
        return {
            "rollout": {
                "n": 24,
                "num_inference_steps": rec["steps"],
                "sde_type": "sde",
                "noise_level": rec["noise_level"],
                "sde_window_size": 0,
            },
            "algo": {
                "clip_ratio": 1e-4,
                "adv_clip_max": 5.0,
                "adv_std": "global",
                "adv_std_unbiased": False,
                "adv_eps": 1e-4,
                "kl_coef": rec["kl"],
                "kl_type": "flowgrpo",
            },
            "train": {"lora_rank": rec["rank"], "lora_alpha": rec["alpha"]},
        }
