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

The real-weights preset is the official config of the backbone (``config/grpo.py``:
``geneval_sd3`` for SD3.5-M, ``pickscore_flux`` for FLUX.1-dev, ``general_ocr_wan2_1`` for
Wan, ``pickscore_qwenimage`` for Qwen-Image): for SD3.5 and FLUX 48 prompts x 24 samples a
round and two optimizer steps of 24 prompts each, its LoRA and targets, and evaluation with
the ODE in its ``eval_num_steps`` (40 SD3.5, 28 FLUX, 50 Wan and Qwen-Image) Euler steps. What digen cannot express is listed in ``docs/TRAINING.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digen.algos.base import Algorithm, NoisySteps

if TYPE_CHECKING:
    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["FLUX_LORA_TARGETS", "SD3_LORA_TARGETS", "FlowGRPO", "lora_train", "recipe"]

SD3_LORA_TARGETS = (
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
)
"""LoRA targets of the official SD3.5 scripts (``scripts/train_sd3.py``, kept by DiffusionNFT's
``scripts/train_nft_sd3.py``): each block's joint attention, not SD3.5-M's second
self-attention ``attn2``, which the backbone's default bare names would adapt too."""

FLUX_LORA_TARGETS = (
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
"""LoRA targets of the official FLUX script (``scripts/train_flux.py``): attention and both
feed-forwards, not the single blocks' ``proj_mlp`` (the backbone's default has it)."""

# The official configs per backbone (``config/grpo.py``): noise level, sampling and
# evaluation steps, KL beta, LoRA rank / alpha / targets (None: the backbone's default).
_RECIPE: dict[str, dict[str, Any]] = {
    # pickscore_flux (scripts/train_flux.py)
    "flux": {
        "noise_level": 0.9,
        "steps": 6,
        "eval_steps": 28,
        "kl": 0.0,
        "rank": 64,
        "alpha": 128.0,
        "targets": FLUX_LORA_TARGETS,
    },
    # geneval_sd3 and general_ocr_sd3 (scripts/train_sd3.py); pickscore and clipscore are
    # variants (FlowGRPO.variants)
    "sd3": {
        "noise_level": 0.7,
        "steps": 10,
        "eval_steps": 40,
        "kl": 0.04,
        "rank": 32,
        "alpha": 64.0,
        "targets": SD3_LORA_TARGETS,
    },
    # general_ocr_wan2_1 (scripts/train_wan2_1.py): its targets' add_* projections are absent
    # from a text-to-video Wan, so the backbone's default names the same layers
    "wan": {
        "noise_level": 0.7,
        "steps": 20,
        "eval_steps": 50,
        "kl": 0.004,
        "rank": 32,
        "alpha": 64.0,
        "targets": None,
    },
    # pickscore_qwenimage (its training script is not in the code read: SD3.5's LoRA rank on
    # the backbone's targets)
    "qwenimage": {
        "noise_level": 1.2,
        "steps": 10,
        "eval_steps": 50,
        "kl": 0.0,
        "rank": 32,
        "alpha": 64.0,
        "targets": None,
    },
}
_DEFAULT_RECIPE = {**_RECIPE["sd3"], "targets": None}
"""A backbone without an official config (hunyuanvideo): SD3.5's numbers."""

_SECTIONS: dict[str, dict[str, dict[str, Any]]] = {
    # general_ocr_wan2_1: 4 videos a prompt, 2 prompts a sampling batch and 2 batches an epoch
    # on each GPU, an optimizer step a batch (its GPU count is not given: one GPU's share),
    # 240 x 416 x 33 at CFG 4.5, clip 1e-3, lr 1e-4, per-prompt std
    "wan": {
        "data": {"train_batch_size": 4},
        "model": {"height": 240, "width": 416, "num_frames": 33},
        "rollout": {"n": 4, "guidance_scale": 4.5},
        "algo": {"clip_ratio": 1e-3, "adv_std": "group"},
        "train": {"lr": 1e-4, "mini_batch_size": 2},
    },
    # pickscore_qwenimage: 32 prompts x 16 in two optimizer steps, noise and training in a
    # 2-step window drawn in the first half
    "qwenimage": {
        "data": {"train_batch_size": 32},
        "rollout": {"n": 16, "sde_window_size": 2, "sde_window_range": [0, 5]},
        "train": {"mini_batch_size": 16},
    },
}
"""A backbone's official settings beyond :data:`_RECIPE`'s, over the SD3.5 / FLUX batch."""


def lora_train(rec: dict[str, Any]) -> dict[str, Any]:
    """The ``train`` settings of a recipe's LoRA: rank, alpha and targets where it names them."""
    out: dict[str, Any] = {"lora_rank": rec["rank"], "lora_alpha": rec["alpha"]}
    if rec["targets"] is not None:
        out["lora_targets"] = list(rec["targets"])
    return out


def recipe(backbone: Backbone) -> dict[str, Any]:
    """The official Flow-GRPO numbers for ``backbone`` (:data:`_RECIPE`)."""
    return _RECIPE.get(backbone.name, _DEFAULT_RECIPE)


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
        rec = recipe(backbone)
        out: dict[str, dict[str, Any]] = {
            # 48 prompts x 24 a round, two optimizer steps (gradient_accumulation_steps is
            # half of num_batches_per_epoch): 24 prompts each
            "data": {"train_batch_size": 48},
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
            "train": {**lora_train(rec), "mini_batch_size": 24},
            # its eval(): the ODE (noise_level=0) in eval_num_steps Euler steps
            "eval": {"num_inference_steps": rec["eval_steps"], "solver": "euler"},
        }
        for section, values in _SECTIONS.get(backbone.name, {}).items():
            out[section] = {**out.get(section, {}), **values}
        return out

    def variants(self, backbone: Backbone) -> dict[str, tuple[str, ...]]:
        if backbone.name != "sd3":
            return {}
        return {  # config/grpo.py: geneval_sd3 and general_ocr_sd3 are the preset itself
            "pickscore": ("algo.kl_coef=0.01",),  # pickscore_sd3
            "clipscore": ("algo.kl_coef=0.02", "rollout.same_initial_noise=true"),  # clipscore_sd3
        }
