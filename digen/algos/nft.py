"""DiffusionNFT: negative-aware fine-tuning on the forward process.

Published form (Zheng et al. 2025, arXiv 2509.16117, and its official SD3.5 training code):
no likelihoods and no trajectories. A deterministic sampler (the second-order multistep
DPM-Solver++, 10 steps, no CFG) draws each sample with the *old* policy, and only its clean
latent ``x0`` is kept. Each sample then trains a seeded random ``timestep_fraction`` (0.99:
9 of 10) of the sampler's own timesteps ``t``, each with fresh noise
``x_t = (1 - t) x0 + t eps``. With the trained velocity ``v`` and the old one ``v_old``:

- implicit positive and negative policies ``v+ = beta v + (1 - beta) v_old`` and
  ``v- = (1 + beta) v_old - beta v``, both read in x0-space, ``x0± = x_t - t v±``;
- each term's error divided by its detached per-sample mean ``|x0± - x0|`` (floored at
  1e-5): ``L± = mean((x0± - x0)^2) / max(mean|x0± - x0|, 1e-5)``;
- the advantage (per-prompt mean, whole-batch population std + 1e-4, clipped at ``c`` = 5)
  mapped to an optimality probability ``r = clamp(A / c / 2 + 1/2, 0, 1)``;
- ``loss = c * mean((r L+ + (1 - r) L-) / beta) + kl_coef * mean((v - v_ref)^2)`` with the
  reference the base weights (LoRA off), ``kl_coef`` 1e-4.

After each train step the old policy moves towards the trained one,
``old <- d old + (1 - d) theta``, with ``d = min(rate * max(g - start, 0), max)`` at ``g``
optimizer steps so far and 0 before ``start`` (published: ``rate`` 0.001, ``max`` 0.5; for OCR
``start`` 75, ``rate`` 0.0075, ``max`` 0.999; ``rate`` 0 keeps old = theta after each step).
Generators sample with the old policy: trainers serve it to them. Evaluation, as the
official script's, samples a separate moving average (0.9) of the trained weights
(``eval.ema``) with the ODE in 40 Euler steps.

The real-weights preset is the official SD3.5-M config ``sd3_geneval`` (``config/nft.py``;
``sd3_pickscore`` and ``sd3_hpsv2`` are the same) with ``scripts/train_nft_sd3.py``: 48 prompts
x 24 samples a round and one optimizer step, the sampler's transformer told
``int(1000 sigma)`` (``rollout.time_input=int1000``; training tells it ``1000 sigma``, as the
script does), LoRA rank 32 / alpha 64 on the joint attention. ``sd3_ocr`` and
``sd3_multi_reward`` are :meth:`NFT.variants`. What digen does differently, by choice: the
noise of each trained term is seeded per ``(seed, step, prompt, sample, timestep)`` instead
of drawn from a global stream, so a run is the same bit for bit in either mode; the rest
(bf16 against the script's fp16 autocast, ...) is listed in ``docs/TRAINING.md``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from digen.algos.base import Algorithm, ChunkLoss, NoisySteps, Param, TrainChunk
from digen.algos.flowgrpo import SD3_LORA_TARGETS

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import Tensor

    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["NFT", "old_decay"]

ADV_MODES = ("all", "positive_only", "negative_only", "one_only", "binary")
WEIGHT_FLOOR = 1e-5
"""Floor of the adaptive weight ``mean |x0± - x0|`` (the official code's)."""


def _positive(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return None if ok else "it must be a number > 0"


def _fraction(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1
    return None if ok else "it must be a number in [0, 1)"


def _non_negative(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    return None if ok else "it must be a number >= 0"


def _adv_mode(value: Any) -> str | None:
    return None if value in ADV_MODES else f"it must be one of {', '.join(ADV_MODES)}"


def old_decay(optimizer_steps: int, start: float, rate: float, most: float) -> float:
    """The old policy's decay after ``optimizer_steps`` optimizer steps: 0 before ``start``,
    then ``rate`` more each step, at most ``most``."""
    if optimizer_steps < start:
        return 0.0
    return min((optimizer_steps - start) * rate, most)


class NFT(Algorithm):
    name = "nft"
    title = (
        "DiffusionNFT (Zheng et al. 2025): forward-process fine-tuning on positive and "
        "negative samples, ODE sampling, no likelihoods"
    )
    sde_types = ("sde",)  # never used: it draws no noisy step
    stochastic_sampling = False
    kl_type = "exact"
    trains_on = "final"
    keeps_old_policy = True
    samples_without_guidance = True
    params = {
        "beta": Param(
            1.0,
            "strength of the implicit policies v± (1; 0.1 for OCR and several rewards)",
            _positive,
        ),
        "decay_start": Param(
            0, "optimizer steps before the old policy starts to lag", _non_negative
        ),
        "decay_rate": Param(
            0.001, "the old policy's decay added per optimizer step", _non_negative
        ),
        "decay_max": Param(0.5, "the old policy's largest decay", _fraction),
        "adv_mode": Param(
            "all",
            "which advantages train: all, positive_only, negative_only, one_only (1 for A > 0,"
            " else 0), binary (the sign)",
            _adv_mode,
        ),
    }

    def noisy_steps(self, cfg: DigenConfig, step: int) -> NoisySteps:
        return NoisySteps((), ())  # deterministic sampling; nothing kept but the clean latent

    def train_steps(self, cfg: DigenConfig, step: int) -> tuple[int, ...]:
        return tuple(range(cfg.rollout.num_inference_steps))  # the sampler's own timesteps

    def check(self, cfg: DigenConfig) -> str | None:
        r, a = cfg.rollout, cfg.algo
        if r.sde_window_size or r.sde_window_range is not None:
            return (
                f"rollout.sde_window_size = {r.sde_window_size} is not allowed: DiffusionNFT "
                "samples without noise and trains on the clean latent, leave the window unset"
            )
        if a.ratio_norm:
            return (
                "algo.ratio_norm = true is not allowed: DiffusionNFT has no likelihood ratio "
                "to normalise (GRPO-Guard is an option of the GRPO family)"
            )
        if a.best_of_n:
            return (
                f"algo.best_of_n = {a.best_of_n} is not allowed: DiffusionNFT trains every "
                "sample (its advantage weighs the positive and negative terms)"
            )
        return None

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        rollout = {
            "solver": "dpm2",
            "guidance_scale": 1.0,
            "timestep_fraction": 0.99,
            "sde_window_size": 0,
            "same_initial_noise": False,
        }
        algo = {
            "adv_std": "global",
            "adv_std_unbiased": False,
            "adv_eps": 1e-4,
            "adv_clip_max": 5.0,
            "kl_coef": 1e-4,
        }
        params = {"beta": 1.0, "decay_start": 0, "decay_rate": 0.001, "decay_max": 0.5}
        if not real_weights:
            return {
                "rollout": {**rollout, "n": 8, "num_inference_steps": 6},
                "algo": {**algo, "params": params},
                "eval": {"ema": 0.9},  # it evaluates an EMA of the trained weights
            }
        train: dict[str, Any] = {
            "lora_rank": 32,
            "lora_alpha": 64.0,
            "lr": 3e-4,
            "weight_decay": 1e-4,
            "max_grad_norm": 1.0,
            "mini_batch_size": 48,  # gradient_step_per_epoch 1: one optimizer step a round
        }
        if backbone.name == "sd3":
            train["lora_targets"] = list(SD3_LORA_TARGETS)
        return {  # config/nft.py sd3_geneval with scripts/train_nft_sd3.py
            # num_groups 48 of num_image_per_prompt 24
            "data": {"train_batch_size": 48},
            # the sampler tells the transformer long(1000 sigma)
            "rollout": {**rollout, "n": 24, "num_inference_steps": 10, "time_input": "int1000"},
            "algo": {**algo, "params": params},
            # eval_fn: the EMA (decay 0.9) sampled with solver "flow", deterministic, in
            # eval_num_steps 40
            "eval": {"ema": 0.9, "num_inference_steps": 40, "solver": "euler"},
            "train": train,
        }

    def variants(self, backbone: Backbone) -> dict[str, tuple[str, ...]]:
        return {  # config/nft.py
            "ocr": (  # sd3_ocr: beta 0.1, decay_type 2, gradient_step_per_epoch 2
                "algo.params.beta=0.1",
                "algo.params.decay_start=75",
                "algo.params.decay_rate=0.0075",
                "algo.params.decay_max=0.999",
                "train.mini_batch_size=24",
            ),
            "multi_reward": (  # sd3_multi_reward: 25 sampling steps, beta 0.1
                "rollout.num_inference_steps=25",
                "algo.params.beta=0.1",
            ),
        }

    # --- training --------------------------------------------------------------------------

    def optimality(self, cfg: DigenConfig, advantages: Tensor) -> Tensor:
        """``r`` in [0, 1] from the advantages (clipped at ``algo.adv_clip_max``, then
        ``algo.params.adv_mode``)."""
        import torch

        c = cfg.algo.adv_clip_max
        a = advantages.float().clamp(-c, c)
        mode = cfg.algo.params["adv_mode"]
        if mode == "positive_only":
            a = a.clamp(0, c)
        elif mode == "negative_only":
            a = a.clamp(-c, 0)
        elif mode == "one_only":
            a = torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
        elif mode == "binary":
            a = torch.sign(a)
        return torch.clamp(a / c / 2.0 + 0.5, 0, 1)

    def chunk_loss(self, cfg: DigenConfig, chunk: TrainChunk) -> ChunkLoss:
        from digen.algos.forward import forward_terms

        policy = chunk.policy
        f = forward_terms(cfg.seed, chunk)  # x_t = (1 - t) x0 + t eps, eps seeded per term
        x0, x_t, sigma, t = f.x0, f.x_t, f.sigma, f.t
        v_old = policy.old_velocity(x_t, sigma, chunk.cond, chunk.neg, chunk.version)
        v_old = v_old.float().detach()  # the old policy that sampled them (TCSS: behind)
        v = policy.velocity(x_t, sigma, chunk.cond, chunk.neg).float()
        beta = float(cfg.algo.params["beta"])
        r = self.optimality(cfg, chunk.advantages)  # [R]
        dims = tuple(range(1, x0.ndim))
        positive = _x0_loss(x_t - t * (beta * v + (1 - beta) * v_old), x0, dims)
        negative = _x0_loss(x_t - t * ((1 + beta) * v_old - beta * v), x0, dims)
        per_term = (r * positive / beta + (1 - r) * negative / beta) * cfg.algo.adv_clip_max
        loss = per_term.mean()
        kl_val = 0.0
        if cfg.algo.kl_coef > 0:
            v_ref = policy.reference_velocity(x_t, sigma, chunk.cond, chunk.neg).float()
            kl = ((v - v_ref) ** 2).mean(dim=dims).mean()
            loss = loss + cfg.algo.kl_coef * kl
            kl_val = kl.detach()
        moved = ((v.detach() - v_old) ** 2).mean()
        return ChunkLoss(loss, kl=kl_val, approx_kl=moved, values=per_term.detach())

    def update_old(
        self, cfg: DigenConfig, old: Sequence[Tensor], live: Sequence[Tensor], version: int
    ) -> None:
        """``old <- d old + (1 - d) theta`` after train step ``version - 1``, with ``d``
        :func:`old_decay` of the optimizer steps taken so far."""
        import torch

        from digen.algos.train_step import mini_batches

        p = cfg.algo.params
        steps = version * len(mini_batches(cfg))
        d = old_decay(steps, p["decay_start"], p["decay_rate"], p["decay_max"])
        with torch.no_grad():
            for o, theta in zip(old, live, strict=True):
                o.copy_(o * d + theta.clone() * (1.0 - d))


def _x0_loss(x0_pred: Tensor, x0: Tensor, dims: tuple[int, ...]) -> Tensor:
    """``mean((x0_pred - x0)^2) / w`` per row, ``w`` the detached mean ``|x0_pred - x0|``
    (in fp64, floored at :data:`WEIGHT_FLOOR`) -> ``[R]``."""
    import torch

    with torch.no_grad():
        w = (x0_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True)
        w = w.clip(min=WEIGHT_FLOOR)
    return ((x0_pred - x0) ** 2 / w).mean(dim=dims)
