"""AWM: Advantage Weighted Matching, the pretraining loss weighted by the advantage.

Published form (Xue et al. 2025, "Advantage Weighted Matching: Aligning RL with Pretraining in
Diffusion Models", arXiv 2509.25050, and its official code, scxue/advantage_weighted_matching:
``scripts/train_sd3_awm.py`` run with ``config/dgx_awm.py`` ``geneval_sd3_no_cfg_1node`` over
``config/base_awm.py``). The paper treats the final sample as a one-step policy whose
log-likelihood is the flow-matching (ELBO) loss, so the policy gradient weighs the pretraining
loss on the sampled clean images by their advantages; no SDE and no trajectory is needed.
Each sample keeps only its clean latent ``x0``; a trainer then takes ``K`` (6) of the
sampler's ``N`` (14) timesteps ``t`` for it, stratified over the first ``int(N f)`` (``f`` =
``rollout.timestep_fraction`` 0.9; ``time_type``: ``discrete_wo_init`` one index from each of
``K`` strata of ``linspace(1, int(N f), K + 1)``, ``discrete`` the same from 0,
``discrete_with_init`` index 0 and ``K - 1`` strata from 1), and for each with fresh noise
``x_t = (1 - t) x0 + t eps`` and the trained velocity ``v``:

- the matching error ``m = mean((v - (eps - x0))^2)``, weighted into ``l = w(m, t)``: the
  script's ``ghuber`` (published) ``t ((m + 1e-10)^p - 1e-10^p) / p`` with ``p`` 0.25, or
  ``uniform`` ``m``, ``t`` ``t m``, ``t2`` ``t^2 m``, ``huber`` ``t (sqrt(m + 1e-10) - 1e-5)``;
- the advantage (per-prompt mean, one population std over the batch ``+ 1e-4``, clipped at
  ``c`` = 5) rescaled to ``A' = A / c * advantage_max`` (1);
- ``loss = mean(A' l) + kl_coef mean((v - v_ref)^2)`` with the reference the base weights
  (LoRA off), ``kl_coef`` 0.001 (GenEval; 0.003 OCR, 1e-4 PickScore); ``kl_weight=elbo``
  divides each KL term by ``2 s_t^2``, ``s_t = 0.7 sqrt(t / (1 - min(t, 0.99)))``.

The script writes the policy term as ``-A' exp(-l + sg(l))`` clipped to ``[0, 2]``; it keeps
every term on-policy (one optimizer step a round, the old value the current one detached),
so the ratio is 1 and its gradient is exactly that of ``mean(A' l)``, which digen writes
directly (the logged value differs: the script logs ``-mean(A')``). The transformer is told
``1000 t`` in training and evaluation, sigma in digen's terms; training runs without CFG.

The real-weights preset is ``geneval_sd3_no_cfg_1node``: 72 prompts x 24 samples a round and
one optimizer step, 14 sampling steps without CFG at 512 px, LoRA rank 32 / alpha 64 on the
joint attention at lr 3e-4, evaluation with the ODE in 40 Euler steps. ``ocr`` and
``pickscore`` are :meth:`AWM.variants`. What digen does differently: the rollout is
deterministic (``rollout.solver=dpm2``, DPM-Solver++ 2M) where the script samples with
SA-Solver (order-2 predictor-corrector) at stochasticity 0.4 inside ``t`` in [0.3, 0.9]
(PickScore: 0, a deterministic solver); its second regulariser, ``ema_beta`` (1) times
``mean((v - v_ema)^2)`` to a copy of the LoRA that lags the trained one (decay ``min(0.3,
0.001 g)`` at ``g`` optimizer steps) while the trained weights sample, is not offered (digen
keeps a second copy only as the policy that samples, DiffusionNFT's old policy); the
stratified timesteps and the noise of each trained term are seeded per ``(seed, step,
prompt, sample[, timestep])`` instead of drawn per micro-batch from a GPU's stream, so a run
is the same bit for bit in either mode. ``docs/TRAINING.md`` lists the rest.
"""

from __future__ import annotations

import math
import struct
from typing import TYPE_CHECKING, Any

from digen.algos.base import Algorithm, ChunkLoss, NoisySteps, Param, TrainChunk
from digen.algos.flowgrpo import SD3_LORA_TARGETS

if TYPE_CHECKING:
    from torch import Tensor

    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["AWM", "KL_WEIGHTS", "TIME_TYPES", "WEIGHTINGS", "matching_loss", "timestep_strata"]

WEIGHTINGS = ("ghuber", "uniform", "t", "t2", "huber")
"""``algo.params.weighting``: how the matching error becomes the loss (the script's
``weighting``; ``t2`` is its ``t**2``)."""
TIME_TYPES = ("discrete_wo_init", "discrete", "discrete_with_init")
"""``algo.params.time_type``: how a sample's trained timesteps are stratified (the script's
discrete ``time_type`` kinds; its continuous ``uniform`` and ``logit_normal`` are off the
sampler's grid and not offered)."""
KL_WEIGHTS = ("uniform", "elbo")
"""``algo.params.kl_weight``: the KL term as it is, or divided by ``2 s_t^2``."""
EPS = 1e-10
"""The floor under the matching error in the Huber weightings (the script's)."""


def _positive(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return None if ok else "it must be a number > 0"


def _positive_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else "it must be an integer >= 1"


def _one_of(names: tuple[str, ...]):
    def check(value: Any) -> str | None:
        return None if value in names else f"it must be one of {', '.join(names)}"

    return check


def _linspace_f32(start: float, end: float, steps: int) -> list[float]:
    """``torch.linspace(start, end, steps)`` in fp32, without torch: the first half
    ``start + step i``, the rest ``end - step (steps - 1 - i)``, each rounded once (a fused
    multiply-add), ``step`` rounded to fp32; equal to torch's values (tested)."""

    def f32(x: float) -> float:
        return struct.unpack("f", struct.pack("f", x))[0]

    start, end = f32(start), f32(end)
    step = f32((end - start) / (steps - 1))
    half = steps // 2
    return [
        f32(start + step * i) if i < half else f32(end - step * (steps - 1 - i))
        for i in range(steps)
    ]


def timestep_strata(
    num_steps: int, fraction: float, count: int, time_type: str
) -> list[tuple[int, int]]:
    """The ``[lower, upper)`` step-index strata one sample draws its ``count`` timesteps from
    (one each), the script's ``torch.linspace(lo, int(num_steps * fraction), count +
    1).long()`` bounds with ``lo`` 1 (``discrete_wo_init``) or 0 (``discrete``);
    ``discrete_with_init`` is step 0, ``(0, 1)``, then ``count - 1`` strata from 1. A stratum
    with ``upper <= lower`` is empty (:meth:`AWM.check` refuses those). No torch: config
    checks call it."""
    top = int(num_steps * fraction)
    if time_type == "discrete_with_init":
        rest = (
            timestep_strata(num_steps, fraction, count - 1, "discrete_wo_init") if count > 1 else []
        )
        return [(0, 1), *rest]
    lo = 1 if time_type == "discrete_wo_init" else 0
    bounds = [math.trunc(b) for b in _linspace_f32(lo, top, count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def matching_loss(m: Tensor, t: Tensor, weighting: str, power: float) -> Tensor:
    """The per-term loss ``l`` of matching error ``m`` ``[R]`` at sigma ``t`` ``[R]``
    (:data:`WEIGHTINGS`; ``power`` is ``ghuber``'s ``p``), in ``m``'s dtype."""
    if weighting == "uniform":
        return m
    if weighting == "t":
        return t * m
    if weighting == "t2":
        return t**2 * m
    if weighting == "huber":
        return ((m + EPS).sqrt() - 1e-5) * t
    if weighting == "ghuber":
        return ((m + EPS) ** power - EPS**power) * t / power
    raise ValueError(f"unknown AWM weighting {weighting!r}; expected one of {WEIGHTINGS}")


class AWM(Algorithm):
    name = "awm"
    title = (
        "AWM (Xue et al. 2025): the flow-matching loss on the samples weighted by their "
        "advantage, ODE sampling, no likelihoods"
    )
    sde_types = ("sde",)  # never used: it draws no noisy step
    stochastic_sampling = False
    kl_type = "exact"
    trains_on = "final"
    samples_without_guidance = True
    params = {
        "weighting": Param(
            "ghuber",
            "how the matching error m weighs into the loss: ghuber t ((m + 1e-10)^p - 1e-10^p) / p, "
            "uniform m, t t m, t2 t^2 m, huber t (sqrt(m + 1e-10) - 1e-5)",
            _one_of(WEIGHTINGS),
        ),
        "ghuber_power": Param(0.25, "ghuber's p", _positive),
        "advantage_max": Param(
            1.0, "the clipped advantage is rescaled to [-advantage_max, advantage_max]", _positive
        ),
        "train_timesteps": Param(
            6, "trained timesteps per sample (one per stratum)", _positive_int
        ),
        "time_type": Param(
            "discrete_wo_init",
            "the strata over the sampler's first int(N rollout.timestep_fraction) steps: "
            "discrete_wo_init (from step 1), discrete (from 0), discrete_with_init (step 0, "
            "then from 1)",
            _one_of(TIME_TYPES),
        ),
        "kl_weight": Param(
            "uniform",
            "the KL term mean((v - v_ref)^2) as it is (uniform) or over 2 s_t^2 (elbo)",
            _one_of(KL_WEIGHTS),
        ),
    }

    # --- config ----------------------------------------------------------------------------

    def check(self, cfg: DigenConfig) -> str | None:
        r, a, p = cfg.rollout, cfg.algo, cfg.algo.params
        if r.sde_window_size or r.sde_window_range is not None:
            return (
                f"rollout.sde_window_size = {r.sde_window_size} is not allowed: AWM samples "
                "without noise and trains on the clean latent, leave the window unset"
            )
        if a.ratio_norm:
            return (
                "algo.ratio_norm = true is not allowed: AWM has no likelihood ratio to "
                "normalise (GRPO-Guard is an option of the GRPO family)"
            )
        if a.best_of_n:
            return (
                f"algo.best_of_n = {a.best_of_n} is not allowed: AWM trains every sample "
                "(its advantage weighs each one's loss)"
            )
        strata = timestep_strata(
            r.num_inference_steps, r.timestep_fraction, p["train_timesteps"], p["time_type"]
        )
        if any(hi <= lo for lo, hi in strata):
            top = int(r.num_inference_steps * r.timestep_fraction)
            return (
                f"algo.params.train_timesteps = {p['train_timesteps']} is not allowed: "
                f"{p['time_type']} strata over steps up to {top} (rollout.num_inference_steps "
                f"{r.num_inference_steps} x rollout.timestep_fraction {r.timestep_fraction}) "
                "would leave one empty; train fewer timesteps or sample more steps"
            )
        return None

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        rollout: dict[str, Any] = {
            "solver": "dpm2",  # deterministic; the script's SA-Solver is not in digen
            "guidance_scale": 1.0,  # no CFG in sampling or training
            "timestep_fraction": 0.9,  # the strata span int(N 0.9) steps
            "sde_window_size": 0,
            "same_initial_noise": False,
        }
        algo = {
            "adv_std": "global",  # global_std: one population std over the batch
            "adv_std_unbiased": False,
            "adv_eps": 1e-4,
            "adv_clip_max": 5.0,
            "kl_coef": 0.001,  # train.beta of geneval_sd3 (0.003 before the repository's update)
        }
        params = {
            "weighting": "ghuber",
            "ghuber_power": 0.25,
            "advantage_max": 1.0,
            "time_type": "discrete_wo_init",
            "kl_weight": "uniform",
        }
        if not real_weights:
            # scaled down: 2 of 6 steps a sample (published 6 of 14)
            return {
                "rollout": {**rollout, "n": 8, "num_inference_steps": 6},
                "algo": {**algo, "params": {**params, "train_timesteps": 2}},
            }
        train: dict[str, Any] = {
            "lora_rank": 32,
            "lora_alpha": 64.0,
            "lr": 3e-4,
            "weight_decay": 1e-4,
            "max_grad_norm": 1.0,
        }  # train.mini_batch_size stays null: its gradient accumulation spans the round
        if backbone.name == "sd3":
            train["lora_targets"] = list(SD3_LORA_TARGETS)  # lora_type "attn"
        return {  # config/dgx_awm.py geneval_sd3_no_cfg_1node
            # 8 GPUs x 6 images x 36 batches = 72 prompts x num_image_per_prompt 24
            "data": {"train_batch_size": 72},
            "model": {"height": 512, "width": 512},  # resolution 512
            "rollout": {**rollout, "n": 24, "num_inference_steps": 14},
            "algo": {**algo, "params": {**params, "train_timesteps": 6}},
            # eval(): determistic Euler in eval_num_steps 40; it logs the trained weights
            # ("non_ema") and an EMA (0.99): eval.ema=0.99 evaluates the latter
            "eval": {"num_inference_steps": 40, "solver": "euler", "ema": 0.0},
            "train": train,
        }

    def variants(self, backbone: Backbone) -> dict[str, tuple[str, ...]]:
        return {  # config/dgx_awm.py
            "ocr": ("algo.kl_coef=0.003",),  # ocr_sd3_no_cfg_1node
            # pickscore_sd3_no_cfg_1node: 8 x 24 // 8 // 2 batches of 6 on 8 GPUs: 24 prompts
            "pickscore": (
                "data.train_batch_size=24",
                "algo.kl_coef=0.0001",
                "algo.params.time_type=discrete",
            ),
        }

    # --- sampling --------------------------------------------------------------------------

    def noisy_steps(self, cfg: DigenConfig, step: int) -> NoisySteps:
        return NoisySteps((), ())  # deterministic sampling; nothing kept but the clean latent

    def train_steps(self, cfg: DigenConfig, step: int) -> tuple[int, ...]:
        return tuple(range(cfg.rollout.num_inference_steps))  # the sampler's own timesteps

    def terms_per_sample(self, cfg: DigenConfig, step: int) -> int:
        return int(cfg.algo.params["train_timesteps"])

    def trained_positions(self, cfg: DigenConfig, step: int, prompt: int, sample: int) -> list[int]:
        """One step index from each stratum (:func:`timestep_strata`), ``lower + int(u (upper
        - lower))`` with ``u`` uniform from a generator seeded by the sample, ascending."""
        import torch

        from digen.seeding import derive_seed

        r, p = cfg.rollout, cfg.algo.params
        strata = timestep_strata(
            r.num_inference_steps, r.timestep_fraction, p["train_timesteps"], p["time_type"]
        )
        g = torch.Generator().manual_seed(
            derive_seed("awm-timesteps", cfg.seed, step, prompt, sample)
        )
        u = torch.rand(len(strata), generator=g)  # fp32, as the script's rand_u
        lower = torch.tensor([lo for lo, _ in strata])
        width = torch.tensor([hi - lo for lo, hi in strata])
        return (lower + (u * width).long()).tolist()

    # --- training --------------------------------------------------------------------------

    def scaled_advantages(self, cfg: DigenConfig, advantages: Tensor) -> Tensor:
        """``A' = clip(A, -c, c) / c * advantage_max`` with ``c`` = ``algo.adv_clip_max``."""
        c = cfg.algo.adv_clip_max
        return advantages.double().clamp(-c, c) / c * float(cfg.algo.params["advantage_max"])

    def chunk_loss(self, cfg: DigenConfig, chunk: TrainChunk) -> ChunkLoss:
        from digen.algos.forward import forward_terms, mean_square

        p, policy = cfg.algo.params, chunk.policy
        f = forward_terms(cfg.seed, chunk)  # x_t = (1 - t) x0 + t eps, eps seeded per term
        # trained without CFG (the script's train.cfg is false): no negative conditioning
        v = policy.velocity(f.x_t, f.sigma, chunk.cond, None).double()  # [R, *latent]
        t = f.sigma.double()  # [R]
        m = mean_square(v, f.target.double())  # [R], in fp64 as the script
        per_term = self.scaled_advantages(cfg, chunk.advantages) * matching_loss(
            m, t, p["weighting"], float(p["ghuber_power"])
        )
        loss = per_term.mean()
        kl_val = 0.0
        if cfg.algo.kl_coef > 0:
            v_ref = policy.reference_velocity(f.x_t, f.sigma, chunk.cond, None).double()
            kl = mean_square(v, v_ref)  # [R]
            if p["kl_weight"] == "elbo":
                s = 0.7 * (t / (1 - t.clamp(0, 0.99))).sqrt()  # the script's std_dev_t
                kl = kl / (2 * s**2)
            loss = loss + cfg.algo.kl_coef * kl.mean()
            kl_val = kl.mean().detach().float()
        return ChunkLoss(loss.float(), kl=kl_val, values=per_term.detach().float())
