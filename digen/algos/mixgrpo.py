"""MixGRPO: mixed ODE-SDE sampling with a window that slides from high noise to low noise.

Published form (Li et al. 2025, official code): of ``N`` (25) denoising steps only a window
of ``W`` (4) consecutive steps draws noise — Flow-GRPO's ``sde`` step with ``a = 0.7`` — and
trains, every step in it; all other steps are Euler (ODE) steps, so the decoded image is the
last step's clean prediction. The window starts at step 0 and moves ``stride`` (1) steps
later every ``shift_every`` (25) train steps, within steps ``0 .. N-3``, rolling back to 0 at
the end. Advantages per group with the unbiased std (+ 1e-8), clipped at 5; the samples of a
group share their initial noise; PPO clip 1e-4; no KL. Its FLUX sigmas take a fixed shift of
3 (``rollout.shift``), its transformer is told ``int(1000 sigma) / 1000``
(``rollout.time_input``), several rewards mix as each one's advantages with weights
normalised to sum 1, and its optional ``kl_coeff`` term is ``0.5 mean((logp - logp_old)^2)``
(``algo.old_kl_coef``, published 0). The official schedule's empty window (start ``N - 2``)
is never made: see :meth:`MixGRPO.window_start`.

The real-weights preset mirrors ``scripts/finetune/finetune_flux_grpo_MixGRPO.sh``: 32 GPUs
of one prompt x 12 a round, 720 px, and an optimizer step per 3 samples of a GPU, so four a
round (digen's four mini-batches of 8 whole groups, where the script's each take a quarter
of every group). It fine-tunes fully at lr 1e-5; the preset trains a LoRA
(``docs/TRAINING.md`` says why).

This file is the example of what an algorithm is in digen: its parameters
(``algo.params.*``), its checks, its presets, and its :class:`~digen.algos.base.NoisySteps`;
the step math (``sde``) and the GRPO parts come from the shared base.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digen.algos.base import Algorithm, NoisySteps, Param

if TYPE_CHECKING:
    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["MixGRPO"]


def _positive_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else "it must be an integer >= 1"


def _non_negative_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return None if ok else "it must be an integer >= 0"


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "it must be true or false"


class MixGRPO(Algorithm):
    name = "mixgrpo"
    title = (
        "MixGRPO (Li et al. 2025): SDE only in a window that slides over the steps, ODE elsewhere"
    )
    sde_types = ("sde",)
    kl_type = "exact"
    params = {
        "shift_every": Param(25, "train steps between two moves of the window", _positive_int),
        "stride": Param(
            1, "denoising steps the window moves each time (0 keeps it still)", _non_negative_int
        ),
        "roll_back": Param(
            True, "back to step 0 past the last start (else it stays there)", _boolean
        ),
    }

    def window_start(self, cfg: DigenConfig, step: int) -> int:
        """Where the window starts at train step ``step``: 0, then ``stride`` later every
        ``shift_every`` steps while the start is at most ``N - 3``; past it, back to 0
        (``roll_back``, as the official schedule rolls back) or stay at ``N - 3``.

        The official schedule also visits start ``N - 2``, whose window is empty (every
        step ODE, nothing trained), and clips there without roll-back; its script cannot
        train such a step, and its published runs (300 steps of 25-step windows) never
        reach it. digen never makes an empty window: a train step always trains something.
        Up to the first visit of ``N - 2`` the starts are the official ones."""
        p = cfg.algo.params
        last = cfg.rollout.num_inference_steps - 3  # the last start with a step to train
        moves, stride = step // p["shift_every"], p["stride"]
        if stride == 0:
            return 0
        if p["roll_back"]:
            return moves % (last // stride + 1) * stride
        return min(moves * stride, last)

    def noisy_steps(self, cfg: DigenConfig, step: int) -> NoisySteps:
        start = self.window_start(cfg, step)
        end = min(start + cfg.rollout.sde_window_size, cfg.rollout.num_inference_steps - 2)
        window = tuple(range(start, end))
        return NoisySteps(window, window)

    def check(self, cfg: DigenConfig) -> str | None:
        r = cfg.rollout
        if r.num_inference_steps < 3:
            return (
                f"rollout.num_inference_steps = {r.num_inference_steps} is not allowed: "
                "MixGRPO's window slides over steps 0 .. N-3, so it needs at least 3"
            )
        if r.sde_window_size < 1:
            return (
                f"rollout.sde_window_size = {r.sde_window_size} is not allowed: it is "
                "MixGRPO's window, give it at least 1 step"
            )
        if r.sde_window_range is not None:
            return (
                f"rollout.sde_window_range = {list(r.sde_window_range)} is not allowed: "
                "MixGRPO's window moves by its own schedule (algo.params), leave it unset"
            )
        return None

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        algo = {
            "clip_ratio": 1e-4,
            "adv_clip_max": 5.0,
            "adv_std": "group",
            "adv_std_unbiased": True,
            "adv_eps": 1e-8,
            "kl_coef": 0.0,
            "old_kl_coef": 0.0,  # its kl_coeff, published 0
            # several rewards: each reward's group advantages, weights normalised to sum 1
            "reward_weighting": "advantage",
            "normalize_reward_weights": True,
        }
        out: dict[str, dict[str, Any]] = {}
        if not real_weights:  # 6 steps: the window visits starts 0..3, moving every 3 steps
            rollout = {"n": 8, "num_inference_steps": 6, "sde_window_size": 2}
            params = {"shift_every": 3, "stride": 1, "roll_back": True}
        else:  # the paper's FLUX run; it fine-tunes fully at lr 1e-5, the preset uses LoRA
            rollout = {"n": 12, "num_inference_steps": 25, "sde_window_size": 4}
            params = {"shift_every": 25, "stride": 1, "roll_back": True}
            # 32 GPUs x 1 prompt a round; gradient_accumulation_steps 3 of 12: 4 steps a round
            out["data"] = {"train_batch_size": 32}
            out["train"] = {"mini_batch_size": 8}
        rollout |= {
            "sde_type": "sde",
            "noise_level": 0.7,
            "same_initial_noise": True,
            "time_input": "int1000",  # its code tells the transformer int(1000 sigma) / 1000
        }
        if real_weights and backbone.name == "flux":
            rollout["shift"] = 3.0  # its FLUX schedule: a fixed shift, not FLUX's dynamic one
            out["model"] = {"height": 720, "width": 720}
        return {**out, "rollout": rollout, "algo": {**algo, "params": params}}
