"""What an RL algorithm for flow-matching models is, to digen: one :class:`Algorithm` object.

An algorithm file (``digen/algos/<name>.py``) defines one subclass and the registry
(:mod:`digen.registry.algos`) lists it. The object answers everything the rest of digen
asks, so nothing outside it branches on an algorithm's name:

- **config**: its default SDE kind, its own parameters (``algo.params.<key>``, with defaults
  and checks), its checks across sections, and its preset values per backbone;
- **sampling**: the :class:`NoisySteps` of each train step — which denoising steps draw noise,
  which of those may be trained, and which latent is decoded — a function of ``(seed,
  step)`` only, so every worker draws the same noisy steps;
- **the step math**: the :class:`~digen.algos.transitions.Transition` of a stochastic step and
  its log-prob form;
- **training**: what a trainer needs of a sample (:attr:`Algorithm.trains_on`: the SDE
  window's transitions with their log-probs, or only the clean final latent), which
  denoising steps a sample trains (seeded per sample), group advantages (and best-of-N),
  and the loss of a chunk of (sample, timestep) terms (:meth:`Algorithm.chunk_loss`: the
  clipped ratio and the KL to the reference for the GRPO family);
- **its own policy copies**: an algorithm that samples with a policy other than the trained
  one (DiffusionNFT's "old" policy) keeps it through :attr:`Algorithm.keeps_old_policy` and
  :meth:`Algorithm.update_old`; trainers then serve that copy to the generators.

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

    from digen.algos.rollout import Rollout, SamplerSpec
    from digen.config import AlgoConfig, DigenConfig
    from digen.models.base import PromptEmbeds
    from digen.registry.models import Backbone

__all__ = ["Algorithm", "ChunkLoss", "Param", "NoisySteps", "TrainChunk"]


@dataclass(frozen=True, slots=True)
class NoisySteps:
    """How the samples of one train step are drawn and which transitions train."""

    stochastic: tuple[int, ...]
    """Denoising steps that draw noise (ascending); the others are plain Euler (ODE) steps.
    The decoded latent is what the last step makes: an Euler last step (to ``sigma = 0``)
    makes exactly the clean prediction ``x - sigma v``, so noisy steps that leave the last step
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


@dataclass(frozen=True, slots=True)
class TrainChunk:
    """What one forward/backward of a trainer sees: ``R`` (sample, timestep) terms, ``R`` =
    ``d x B`` for ``d`` timesteps of ``B`` samples (timestep-major), each row at its own
    denoising step. Built by :meth:`~digen.runtime.worker.policy.Policy.accumulate`."""

    policy: Any
    """The trainer's :class:`~digen.runtime.worker.policy.Policy`: its velocity under the
    trained, reference and (if kept) old weights."""
    spec: SamplerSpec
    step: int
    """The train step the samples belong to."""
    keys: Sequence[Any]
    """``[R]``: each row's sample (a :class:`~digen.runtime.messages.SampleKey`)."""
    rollout: Rollout
    """The samples' rollout (``B`` rows); ``rows`` index it."""
    rows: Tensor
    """``[R]`` long: each term's row of ``rollout``."""
    positions: Tensor
    """``[R]`` long: each term's position in the sample's trajectory window
    (:meth:`Algorithm.train_steps`), i.e. into ``rollout.latents`` dim 1."""
    steps: Tensor
    """``[R]`` long: each term's denoising step index (into ``spec.sigmas``)."""
    cond: PromptEmbeds
    """``[R]`` text conditioning."""
    neg: PromptEmbeds | None
    advantages: Tensor
    """``[R]`` fp32."""
    version: int | None = None
    """The policy version whose weights sampled these samples (a stale micro-batch's is
    behind the trainer's); None: the trainer's own."""
    same_weights: bool = False
    """Whether the trained weights are, bit for bit, the ones that sampled these terms (the
    train step's first optimizer step not yet taken, the samples not stale): the recomputed
    log-probs should then equal the recorded ones up to rounding (:class:`ChunkLoss`'s
    drift)."""


@dataclass(frozen=True, slots=True)
class ChunkLoss:
    """The loss of a :class:`TrainChunk` (a mean over its terms, with grad) and its
    diagnostics (detached floats, means over the terms)."""

    loss: Tensor
    kl: Tensor | float = 0.0
    clip_fraction: Tensor | float = 0.0
    approx_kl: Tensor | float = 0.0
    """How far the trained policy has moved from the one that sampled. These three are
    detached 0-dim tensors where computed: the trainer reads a chunk's values in one
    transfer."""
    values: Tensor | None = None
    """``[R]`` per-term values whose non-finite ones the error of a non-finite loss counts
    (read only then: counting them would sync the device at every chunk)."""
    drift: Tensor | None = None
    """``[R]`` ``|logp - logp recorded|`` per term where the trained weights sampled them
    (:attr:`TrainChunk.same_weights`); None elsewhere or without log-probs."""
    drift_bound: Tensor | None = None
    """``[R]`` what rounding alone allows each of :attr:`drift`
    (:func:`~digen.algos.rollout.logprob_drift_bound`)."""


class Algorithm:
    """Base class of the algorithms (module docstring)."""

    name: ClassVar[str]
    """Registry name, as ``algo.name`` and ``--algo`` spell it."""
    title: ClassVar[str]
    """One line for listings: what it is and where it comes from."""
    sde_types: ClassVar[tuple[str, ...]]
    """The stochastic step kinds it samples with (``rollout.sde_type``); the first is its
    default."""
    stochastic_sampling: ClassVar[bool] = True
    """It samples with stochastic steps of a ``rollout.sde_type``; False: deterministically
    (an ODE sampler), and ``rollout.sde_type`` does not apply."""
    kl_type: ClassVar[str] = "exact"
    """The KL convention its published coefficients mean (``algo.kl_type`` default)."""
    params: ClassVar[Mapping[str, Param]] = {}
    """Its own settings, ``algo.params.<name>``."""
    trains_on: ClassVar[str] = "transitions"
    """What training reads of a sample: ``transitions`` (the window's ``x_i -> x_{i+1}``
    and their log-probs, the GRPO family) or ``final`` (the clean latent alone: forward-
    process methods, which noise it again themselves). Generators keep and ship only that."""
    samples_without_guidance: ClassVar[bool] = False
    """Its recipe samples without classifier-free guidance (a task preset's guidance does
    not apply to it)."""
    keeps_old_policy: ClassVar[bool] = False
    """Trainers keep a second copy of the trained weights, the "old" policy, which samples
    (generators receive it instead of the trained weights) and which :meth:`chunk_loss`
    may read (:meth:`Algorithm.update_old` moves it after each train step)."""

    # --- config ----------------------------------------------------------------------------

    def check(self, cfg: DigenConfig) -> str | None:
        """What is wrong with ``cfg`` for this algorithm across sections (``"key = value is
        not allowed: ..."`` form), or None."""
        return None

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        """Config sections (``rollout``, ``algo``, ``train``...) for ``backbone``: the
        published recipe with real weights, a laptop-sized one for the tiny flavours."""
        raise NotImplementedError

    def variants(self, backbone: Backbone) -> dict[str, tuple[str, ...]]:
        """The published code's other per-task configs for ``backbone``, by name: the
        ``key=value`` overrides (``digen run ... KEY=VALUE``) that turn the real-weights
        preset, which mirrors one task's config, into each (``digen algos`` lists them)."""
        return {}

    # --- sampling --------------------------------------------------------------------------

    def noisy_steps(self, cfg: DigenConfig, step: int) -> NoisySteps:
        """The :class:`NoisySteps` of train step ``step`` (a function of the seed and step)."""
        raise NotImplementedError

    def train_steps(self, cfg: DigenConfig, step: int) -> tuple[int, ...]:
        """The denoising steps a sample of train step ``step`` may train, ascending: the
        noisy steps' trainable transitions (a forward-process method: every step of the
        schedule)."""
        return self.noisy_steps(cfg, step).trainable

    def terms_per_sample(self, cfg: DigenConfig, step: int) -> int:
        """Trained timesteps of one sample of ``step`` (:meth:`trained_positions` draws
        this many)."""
        trainable = len(self.train_steps(cfg, step))
        frac = cfg.rollout.timestep_fraction
        return trainable if frac >= 1.0 else max(1, int(trainable * frac))

    def trained_positions(self, cfg: DigenConfig, step: int, prompt: int, sample: int) -> list[int]:
        """Positions (into :meth:`train_steps`) one sample trains: all of them, or a seeded
        random ``rollout.timestep_fraction`` of them (DanceGRPO's per-sample subset)."""
        from digen.algos.timesteps import train_timesteps

        return train_timesteps(
            list(self.train_steps(cfg, step)),
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

    def guarded_loss(self, cfg: DigenConfig, chunk: TrainChunk, out: Any) -> tuple[Tensor, Any]:
        """GRPO-Guard (``algo.ratio_norm``): the clipped loss on the normalised ratio
        (:func:`~digen.algos.loss.guard_log_ratio`, against the sampling-time step mean the
        generator kept), each term divided by its step's ``|dt|`` so every noise level pulls
        alike."""
        from digen.algos.loss import clipped_policy_loss, guard_log_ratio

        ro, r, pos = chunk.rollout, chunk.rows, chunk.positions
        if ro.means is None:
            raise ValueError("algo.ratio_norm needs the sampling-time step means in the rollout")
        old_log_prob = ro.log_probs[r, pos]
        log_ratio = guard_log_ratio(out.log_prob, old_log_prob, out.mean, ro.means[r, pos], out.std)
        sigmas = chunk.spec.sigmas.to(out.log_prob.device)
        dt = (sigmas[chunk.steps + 1] - sigmas[chunk.steps]).abs().float()  # [R]
        return clipped_policy_loss(
            out.log_prob,
            old_log_prob,
            chunk.advantages,
            cfg.algo.clip_ratio,
            cfg.algo.adv_clip_max,
            log_ratio=log_ratio,
            weight=1.0 / dt,
        )

    def chunk_loss(self, cfg: DigenConfig, chunk: TrainChunk) -> ChunkLoss:
        """The loss of one chunk of terms (GRPO): each term's transition re-scored under
        the trained weights, the clipped ratio to the sampling log-prob (:meth:`loss`), plus
        ``algo.kl_coef`` times the KL to the reference (:meth:`kl`)."""
        from digen.algos.rollout import score_step

        ro, r, pos = chunk.rollout, chunk.rows, chunk.positions
        x_t, x_next = ro.transition(r, pos)  # [R, *latent]
        policy, spec = chunk.policy, chunk.spec
        out = score_step(policy.adapter, x_t, x_next, chunk.steps, chunk.cond, spec, chunk.neg)
        if cfg.algo.ratio_norm:
            loss, ls = self.guarded_loss(cfg, chunk, out)
        else:
            loss, ls = self.loss(cfg.algo, out.log_prob, ro.log_probs[r, pos], chunk.advantages)
        if cfg.algo.old_kl_coef > 0:  # MixGRPO's kl_coeff: the squared log-ratio
            diff = out.log_prob.float() - ro.log_probs[r, pos].float()
            loss = loss + cfg.algo.old_kl_coef * 0.5 * (diff**2).mean()
        kl_val = 0.0
        if cfg.algo.kl_coef > 0:
            ref_mean = policy.reference_mean(x_t, chunk.steps, chunk.cond, spec, chunk.neg)
            kl = self.kl(cfg.algo, out.mean, ref_mean, out).mean()
            loss = loss + cfg.algo.kl_coef * kl
            kl_val = kl.detach()
        drift = bound = None
        if chunk.same_weights:
            from digen.algos.rollout import logprob_drift_bound

            drift = (out.log_prob.detach() - ro.log_probs[r, pos]).abs()
            dtype = policy.adapter.dtype
            bound = logprob_drift_bound(x_t, x_next, chunk.steps, spec, out, dtype)
        return ChunkLoss(
            loss,
            kl=kl_val,
            clip_fraction=ls.clip_fraction,
            approx_kl=ls.approx_kl,
            values=out.log_prob.detach(),
            drift=drift,
            drift_bound=bound,
        )

    def update_old(
        self, cfg: DigenConfig, old: Sequence[Tensor], live: Sequence[Tensor], version: int
    ) -> None:
        """Move the old policy (:attr:`keeps_old_policy`) after the train step that made
        policy version ``version``, in place. The base class keeps none."""
