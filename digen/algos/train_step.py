"""One train step's group math, shared by the colocated trainer and the disaggregated driver.

Each function asks the run's algorithm (:mod:`digen.registry.algos`):

- :func:`score_groups`: rewards of whole groups -> advantages and which samples are trained
  (all of them, or DanceGRPO's best-of-N);
- :func:`terms_per_sample` / :func:`step_terms`: how many (sample, timestep) loss terms a step
  has, which scales every backward so the summed gradient is that of the mean loss however
  the terms are split over calls, workers and micro-batches;
- :func:`mini_batches`: the prompts of each optimizer step of a train step
  (``train.mini_batch_size``; one mini-batch, one optimizer step, when it is null).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from digen.config import AlgoConfig, DigenConfig
from digen.registry.algos import get_algorithm

__all__ = [
    "dropped_groups",
    "mini_batches",
    "score_groups",
    "step_terms",
    "terms_per_sample",
]


def score_groups(
    rewards: torch.Tensor,
    algo: AlgoConfig,
    components: Sequence[tuple[float, torch.Tensor]] = (),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and the trained-sample mask of whole groups.

    rewards: ``[G, n]`` (one row per prompt) -> ``(advantages [G, n] fp32, keep [G, n] bool)``;
    ``components``: each reward's weight and raw ``[G, n]`` scores, used when
    ``algo.reward_weighting = advantage``. A group with a non-finite reward
    (``train.on_nonfinite = drop`` lets them through) is dropped whole: advantage 0, nothing
    kept. The other groups keep the advantages they have with any finite value in its place
    (the same tensor shape, so the same bits); a batch-wide std spans only the finite groups.
    """
    algorithm = get_algorithm(algo.name)
    if algo.reward_weighting != "advantage":
        components = ()
    elif algo.normalize_reward_weights and components:
        total = sum(w for w, _ in components)
        components = [(w / total, c) for w, c in components]
    bad = dropped_groups(rewards)  # [G]
    if not bad.any():
        return algorithm.advantages(rewards, algo, components)
    if algo.adv_std == "global":
        adv = torch.zeros(rewards.shape, dtype=torch.float32)
        keep = torch.zeros(rewards.shape, dtype=torch.bool)
        if not bad.all():
            kept = [(w, c[~bad]) for w, c in components]
            adv[~bad], keep[~bad] = algorithm.advantages(rewards[~bad], algo, kept)
        return adv, keep
    filled = [(w, c.masked_fill(bad[:, None], 0.0)) for w, c in components]
    adv, keep = algorithm.advantages(rewards.masked_fill(bad[:, None], 0.0), algo, filled)
    return adv.masked_fill(bad[:, None], 0.0), keep.masked_fill(bad[:, None], False)


def dropped_groups(rewards: torch.Tensor) -> torch.Tensor:
    """``[G]`` bool: the groups of ``rewards [G, n]`` holding a non-finite reward."""
    return ~torch.isfinite(rewards).all(dim=1)


def terms_per_sample(cfg: DigenConfig, step: int) -> int:
    """Trained timesteps of one sample of ``step`` (its trainable steps, or their fraction)."""
    return get_algorithm(cfg.algo.name).terms_per_sample(cfg, step)


def step_terms(cfg: DigenConfig, step: int, prompts: int | None = None) -> int:
    """Loss terms of ``prompts`` groups of ``step`` (default: the whole train batch)."""
    groups = cfg.data.train_batch_size if prompts is None else prompts
    kept = cfg.algo.best_of_n or cfg.rollout.n
    return groups * kept * terms_per_sample(cfg, step)


def mini_batches(cfg: DigenConfig) -> list[range]:
    """The prompts of each mini-batch of a train step, in the order they are trained.

    A train step samples ``data.train_batch_size`` prompts with one policy, then takes one
    optimizer step per mini-batch of ``train.mini_batch_size`` prompts (whole groups), as
    flow_grpo's inner loop does; every step after the first is off-policy, which the clipped
    ratio bounds. Null: one mini-batch, one optimizer step.
    """
    prompts = cfg.data.train_batch_size
    size = cfg.train.mini_batch_size or prompts
    return [range(lo, lo + size) for lo in range(0, prompts, size)]
