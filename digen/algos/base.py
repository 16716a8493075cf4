"""What an RL algorithm for flow-matching models is, to digen: one :class:`Algorithm` object.

An algorithm file (``digen/algos/<name>.py``) defines one subclass and the registry
(:mod:`digen.algos.registry`) lists it. The object answers everything the rest of digen
asks, so nothing outside it branches on an algorithm's name:

- **config**: its default SDE kind, its own parameters (``algo.params.<key>``, with defaults
  and checks), its checks across sections, and its preset values per backbone;
- **sampling**: the :class:`StepPlan` of each train step — which denoising steps draw noise,
  which of those may be trained, and which latent is decoded — a function of ``(seed,
  step)`` only, so every worker makes the same plan;
- **the step math**: the :class:`~digen.algos.transitions.Transition` of a stochastic step and
  its log-prob form;
- **training**: which of a sample's trainable steps it trains (seeded per sample),
  group advantages (and best-of-N), the clipped loss and the KL to the reference.

The base class holds the GRPO parts the algorithms share; a subclass overrides what is its
own. Modules here import torch only inside the functions that need it, so config checks and
presets never load it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from digen.algos.transitions import LOG_PROBS, STEP_KINDS, Transition

if TYPE_CHECKING:
    from torch import Tensor

    from digen.config import AlgoConfig, DigenConfig
    from digen.models.registry import Backbone

__all__ = ["Algorithm", "Param", "StepPlan"]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """How the samples of one train step are drawn and which transitions train."""

    stochastic: tuple[int, ...]
    """Denoising steps that draw noise (ascending); the others are plain Euler (ODE) steps.
    The decoded latent is what the last step makes: an Euler last step (to ``sigma = 0``)
    makes exactly the clean prediction ``x - sigma v``, so a plan that leaves the last step
    out keeps every drawn noise off the image's final step (DanceGRPO, MixGRPO)."""
    trainable: tuple[int, ...]
    """The stochastic steps whose transitions are kept and may be trained (ascending)."""

    def __post_init__(self) -> None:
        if not set(self.trainable) <= set(self.stochastic):
            raise ValueError(f"trainable steps {self.trainable} must all be stochastic")


@dataclass(frozen=True, slots=True)
class Param:
    """One algorithm-specific setting, ``algo.params.<name>``."""

    default: Any
    doc: str
    check: Callable[[Any], str | None] = lambda value: None
    """Returns what is wrong with a value (one clause), or None when it is fine."""


class Algorithm:
    """Base class of the algorithms (module docstring)."""

    name: ClassVar[str]
    """Registry name, as ``algo.name`` and ``--algo`` spell it."""
    title: ClassVar[str]
    """One line for listings: what it is and where it comes from."""
    sde_types: ClassVar[tuple[str, ...]]
    """The stochastic step kinds it samples with (``rollout.sde_type``); the first is its
    default."""
    kl_type: ClassVar[str] = "exact"
    """The KL convention its published coefficients mean (``algo.kl_type`` default)."""
    params: ClassVar[Mapping[str, Param]] = {}
    """Its own settings, ``algo.params.<name>``."""

    # --- config ----------------------------------------------------------------------------

    def check(self, cfg: DigenConfig) -> str | None:
        """What is wrong with ``cfg`` for this algorithm across sections (``"key = value is
        not allowed: ..."`` form), or None."""
        return None

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        """Config sections (``rollout``, ``algo``, ``train``...) for ``backbone``: the
        published recipe with real weights, a laptop-sized one for the tiny flavours."""
        raise NotImplementedError

    # --- sampling --------------------------------------------------------------------------

    def plan(self, cfg: DigenConfig, step: int) -> StepPlan:
        """The :class:`StepPlan` of train step ``step`` (a function of the seed and step)."""
        raise NotImplementedError

    def trained_positions(
        self, cfg: DigenConfig, step: int, plan: StepPlan, prompt: int, sample: int
    ) -> list[int]:
        """Positions (into ``plan.trainable``) one sample trains: all of them, or a seeded
        random ``rollout.timestep_fraction`` of them (DanceGRPO's per-sample subset)."""
        from digen.algos.timesteps import train_timesteps

        return train_timesteps(
            list(plan.trainable),
            cfg.rollout.timestep_fraction,
            seed=cfg.seed,
            step=step,
            prompt_index=prompt,
            sample_index=sample,
        )

    def transition(
        self,
        kind: str,
        x: Tensor,
        v: Tensor,
        sigma: Tensor,
        sigma_next: Tensor,
        noise_level: float,
        sigma_1: Tensor,
    ) -> Transition:
        """The Gaussian of a stochastic step of kind ``kind`` (one of :attr:`sde_types`;
        :data:`~digen.algos.transitions.STEP_KINDS` unless an algorithm brings its own)."""
        return STEP_KINDS[kind](x, v, sigma, sigma_next, noise_level, sigma_1)

    def log_prob_form(self, kind: str, cfg: DigenConfig) -> str:
        """Which :data:`~digen.algos.transitions.LOG_PROBS` form step kind ``kind`` uses."""
        return "gaussian"

    def log_prob(self, kind: str, cfg: DigenConfig, x_next: Tensor, tr: Transition) -> Tensor:
        return LOG_PROBS[self.log_prob_form(kind, cfg)](x_next, tr.mean, tr.std)

    # --- training --------------------------------------------------------------------------

    def advantages(
        self,
        rewards: Tensor,
        algo: AlgoConfig,
        components: Sequence[tuple[float, Tensor]] = (),
    ) -> tuple[Tensor, Tensor]:
        """Advantages and the trained-sample mask of whole groups (GRPO).

        rewards: ``[G, n]`` (one row per prompt; with ``algo.adv_std = global`` the whole
        batch) -> ``(advantages [G, n] fp32, keep [G, n] bool)``. With
        ``algo.reward_weighting = advantage`` and ``components`` (each reward's weight and
        raw ``[G, n]`` scores) the advantages are the weighted sum of each reward's own,
        clipped after the sum.
        """
        from digen.algos.advantages import best_of_n, group_advantages

        def of(scores: Tensor, clip: float | None) -> Tensor:
            return group_advantages(
                scores,
                norm=algo.adv_norm,
                std=algo.adv_std,
                unbiased=algo.adv_std_unbiased,
                eps=algo.adv_eps,
                clip_max=clip,
            )

        if algo.reward_weighting == "advantage" and components:
            adv = sum(weight * of(scores, None) for weight, scores in components)
            adv = adv.clamp(-algo.adv_clip_max, algo.adv_clip_max)
        else:
            adv = of(rewards, algo.adv_clip_max)
        keep = adv.new_ones(adv.shape, dtype=bool)  # type: ignore[arg-type]
        if algo.best_of_n:
            keep.zero_()
            keep.scatter_(1, best_of_n(adv, algo.best_of_n), True)
        return adv, keep

    def kl(self, algo: AlgoConfig, mean: Tensor, ref_mean: Tensor, tr: Transition) -> Tensor:
        """KL of a step to the reference policy's -> ``[B]``: ``mean((mu - mu_ref)^2) / (2
        s^2)`` with ``s`` the step std (``exact``) or the published ``std_dev_t``
        (``flowgrpo``: for Flow-GRPO's SDE that leaves out ``sqrt(-dt)``, so the term is
        ``|dt|`` times the exact one)."""
        from digen.algos.loss import kl_to_reference

        std = tr.std if algo.resolved_kl_type == "exact" else tr.kl_std
        return kl_to_reference(mean, ref_mean, std)

    def loss(
        self, algo: AlgoConfig, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor
    ) -> tuple[Tensor, Any]:
        """The clipped policy loss (PPO-clip, mean over sample x timestep terms)."""
        from digen.algos.loss import clipped_policy_loss

        return clipped_policy_loss(
            log_prob, old_log_prob, advantages, algo.clip_ratio, algo.adv_clip_max
        )
