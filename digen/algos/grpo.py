"""One train step's group math, shared by the colocated trainer and the disaggregated driver.

- :func:`score_groups`: rewards of whole groups -> advantages and which samples are trained
  (all of them, or DanceGRPO's best-of-N);
- :func:`terms_per_sample` / :func:`step_terms`: how many (sample, timestep) loss terms a step
  has, which scales every backward so the summed gradient is that of the mean loss however
  the terms are split over calls, workers and micro-batches.
"""

from __future__ import annotations

import torch

from digen.algos.advantages import best_of_n, group_advantages
from digen.algos.timesteps import sde_window
from digen.config import AlgoConfig, DigenConfig

__all__ = ["score_groups", "step_terms", "step_window", "terms_per_sample"]


def score_groups(rewards: torch.Tensor, algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and the trained-sample mask of whole groups.

    rewards: ``[G, n]`` (one row per prompt) -> ``(advantages [G, n] fp32, keep [G, n] bool)``.
    """
    adv = group_advantages(
        rewards, norm=algo.adv_norm, eps=algo.adv_eps, clip_max=algo.adv_clip_max
    )
    keep = torch.ones_like(adv, dtype=torch.bool)
    if algo.best_of_n:
        keep.zero_()
        keep.scatter_(1, best_of_n(adv, algo.best_of_n), True)
    return adv, keep


def step_window(cfg: DigenConfig, step: int) -> list[int]:
    """The SDE window of train step ``step`` (shared by every sample of the step)."""
    r = cfg.rollout
    return sde_window(
        seed=cfg.seed,
        step=step,
        num_inference_steps=r.num_inference_steps,
        window_size=r.sde_window_size,
        window_range=r.sde_window_range,
        sde_type=r.sde_type,
    )


def terms_per_sample(cfg: DigenConfig, step: int) -> int:
    """Trained timesteps of one sample of ``step`` (the window, or its timestep fraction)."""
    window = len(step_window(cfg, step))
    frac = cfg.rollout.timestep_fraction
    return window if frac >= 1.0 else max(1, int(window * frac))


def step_terms(cfg: DigenConfig, step: int, prompts: int | None = None) -> int:
    """Loss terms of ``prompts`` groups of ``step`` (default: the whole train batch)."""
    groups = cfg.data.train_batch_size if prompts is None else prompts
    kept = cfg.algo.best_of_n or cfg.rollout.n
    return groups * kept * terms_per_sample(cfg, step)
