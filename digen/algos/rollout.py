"""Sampling trajectories with log-probs, and re-scoring them under the current policy.

These functions tie a backbone adapter to the SDE math. Sampling draws every sample's initial
latent and step noise from that sample's own generator (see :mod:`digen.seeding`), in a fixed
order: the latent first, then one draw per SDE-window step. A sample therefore comes out the
same in any batch, on any worker.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from digen.algos.sde import StepOutput, dpm2_step, ode_step, sde_step
from digen.algos.transitions import LOG_PROBS
from digen.models.base import DiffusionAdapter, PromptEmbeds

__all__ = [
    "DRIFT_ROUNDINGS",
    "Rollout",
    "SamplerSpec",
    "logprob_drift_bound",
    "model_time",
    "sample_rollout",
    "score_step",
]

DRIFT_ROUNDINGS = 4
"""How many units of roundoff of the compute dtype a recomputed velocity may be off by, per
element, from the one that sampled (:func:`logprob_drift_bound`): the same weights run
again in another batch shape or kernel round their last few operations differently, by a
unit or so each."""


@dataclass(frozen=True, slots=True)
class SamplerSpec:
    """How a trajectory is sampled; shared by the sampler and the log-prob recomputation."""

    sigmas: torch.Tensor
    """``[N + 1]`` flow-matching sigmas, ending in 0."""
    window: tuple[int, ...]
    """Steps whose transitions are kept (and may be trained), ascending."""
    sde_type: str = "sde"
    noise_level: float = 0.7
    guidance_scale: float = 1.0
    stochastic: tuple[int, ...] | None = None
    """Steps that draw noise, ascending (a superset of ``window``); None: ``window``."""
    log_prob: str = "gaussian"
    """Log-prob form (:data:`digen.algos.transitions.LOG_PROBS`)."""
    algorithm: str | None = None
    """Whose step kinds (:meth:`digen.algos.base.Algorithm.transition`); None: the shared ones."""
    time_input: str = "sigma"
    """What the transformer is told the time is (:func:`model_time`)."""
    keep_means: bool = False
    """Keep each kept transition's mean under the sampling policy (GRPO-Guard's ratio)."""
    solver: str = "euler"
    """How the steps without noise move: ``euler`` (first order); ``dpm2`` (the second-order
    multistep DPM-Solver++ on the clean prediction, :func:`~digen.algos.sde.dpm2_step`; its
    history starts afresh after a noisy step); or ``dpm2-post`` (MixGRPO-Flash: Euler up to
    the last noisy step, DPM-Solver++ after it, with a history of every step's clean
    prediction, the noisy ones' included)."""

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    @property
    def noisy(self) -> tuple[int, ...]:
        return self.window if self.stochastic is None else self.stochastic


@dataclass(frozen=True, slots=True)
class Rollout:
    """B sampled trajectories, kept only where training needs them.

    The latents of the window's transitions are kept once each: the ``x_{i+1}`` a step draws
    is the ``x_i`` the next step starts from, so a window of K consecutive steps keeps K + 1
    latents a sample, not 2K (a window with gaps keeps one run of latents per stretch).
    """

    states: torch.Tensor
    """``[B, S, *latent]``: the latents the kept transitions start or end at, in step order."""
    starts: tuple[int, ...]
    """Per kept transition ``k`` (K of them), where its ``x_i`` is in ``states`` dim 1; its
    ``x_{i+1}`` is the one after it."""
    log_probs: torch.Tensor
    """``[B, K]``: log-prob of each drawn step under the sampling policy."""
    final: torch.Tensor | None = None
    """``[B, *latent]``: the fully denoised latent, to decode and score (None once decoded:
    training does not need it, unless it trains on it alone)."""
    means: torch.Tensor | None = None
    """``[B, K, *latent]``: each drawn step's mean under the sampling policy, where the loss
    reads it (``algo.ratio_norm``); else None."""

    @staticmethod
    def from_pairs(
        latents: torch.Tensor,
        next_latents: torch.Tensor,
        log_probs: torch.Tensor,
        final: torch.Tensor | None = None,
        means: torch.Tensor | None = None,
    ) -> Rollout:
        """A rollout from each transition's ``x_i`` and ``x_{i+1}`` (``[B, K, *latent]``
        each), kept as given: 2K latents a sample."""
        b, k = latents.shape[:2]
        states = torch.stack([latents, next_latents], dim=2).reshape(
            b, 2 * k, *latents.shape[2:]
        )  # [B, 2K, *latent]: x_i, x_{i+1} of each transition in turn
        return Rollout(states, tuple(range(0, 2 * k, 2)), log_probs, final, means)

    @property
    def _chained(self) -> bool:
        """Whether every transition starts where the one before ended (one run of latents)."""
        return self.starts == tuple(range(len(self.starts)))

    @property
    def latents(self) -> torch.Tensor:
        """``[B, K, *latent]``: ``x_i`` of each kept transition (a view where chained)."""
        if self._chained:
            return self.states[:, : len(self.starts)]
        return self.states[:, list(self.starts)]

    @property
    def next_latents(self) -> torch.Tensor:
        """``[B, K, *latent]``: ``x_{i+1}`` of each kept transition (a view where chained)."""
        if self._chained:
            return self.states[:, 1 : len(self.starts) + 1]
        return self.states[:, [s + 1 for s in self.starts]]

    def transition(
        self, rows: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x_i`` and ``x_{i+1}`` (``[R, *latent]`` each) of transition ``positions[j]`` of
        row ``rows[j]``, read from the one stack."""
        at = torch.tensor(self.starts, dtype=torch.long, device=positions.device)[positions]
        return self.states[rows, at], self.states[rows, at + 1]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Rollout:
        """``fn`` applied to each tensor kept (row-wise functions only)."""
        return Rollout(
            fn(self.states),
            self.starts,
            fn(self.log_probs),
            *(None if t is None else fn(t) for t in (self.final, self.means)),
        )

    def select(self, rows: torch.Tensor | slice) -> Rollout:
        """The trajectories at ``rows`` (an index tensor or a slice)."""
        return self.map(lambda t: t[rows])

    def to(self, device: torch.device | str) -> Rollout:
        """The same trajectories on ``device`` (no copy where they already are)."""
        return self.map(lambda t: t.to(device))

    def for_training(self, final: bool = False) -> Rollout:
        """What an update reads: the window's latents, log-probs (and means, where kept), and
        the final latent only when ``final`` (a forward-process algorithm trains on it alone)."""
        return Rollout(
            self.states, self.starts, self.log_probs, self.final if final else None, self.means
        )

    @property
    def nbytes(self) -> int:
        parts = (self.states, self.log_probs, self.final, self.means)
        return sum(t.nbytes for t in parts if t is not None)

    @staticmethod
    def cat(parts: Sequence[Rollout]) -> Rollout:
        """Concatenate batches of trajectories (same window)."""
        if len({p.starts for p in parts}) > 1:
            raise ValueError("rollouts of different windows cannot be concatenated")

        def joined(name: str) -> torch.Tensor | None:
            got = [getattr(p, name) for p in parts]
            return None if any(t is None for t in got) else torch.cat(got)

        return Rollout(
            torch.cat([p.states for p in parts]),
            parts[0].starts,
            torch.cat([p.log_probs for p in parts]),
            joined("final"),
            joined("means"),
        )


def model_time(sigma: torch.Tensor, time_input: str) -> torch.Tensor:
    """The time the transformer is given for ``sigma``: itself (``sigma``), or
    ``int(1000 sigma) / 1000`` (``int1000``: DanceGRPO's and MixGRPO's code)."""
    if time_input == "int1000":
        return torch.trunc(torch.as_tensor(sigma, dtype=torch.float32) * 1000) / 1000
    return sigma


def _velocity(
    adapter: DiffusionAdapter,
    x: torch.Tensor,
    sigma: torch.Tensor,
    cond: PromptEmbeds,
    neg_cond: PromptEmbeds | None,
    spec: SamplerSpec,
) -> torch.Tensor:
    t = model_time(sigma, spec.time_input)
    return adapter.predict_velocity(x, t, cond, neg_cond, spec.guidance_scale)


def _step_noise(
    generators: Sequence[torch.Generator], x: torch.Tensor, steps: Sequence[int]
) -> dict[int, torch.Tensor]:
    """Step -> ``[B, *latent]`` standard normal noise on ``x``'s device for each of the noisy
    ``steps`` (ascending), drawn now in the order the steps would draw it (each sample's
    generator: after its latent, one draw per noisy step) and sent in one copy, so no step
    waits on a transfer."""
    if not steps:
        return {}
    draws = torch.stack(
        [
            torch.stack(
                [torch.randn(x.shape[1:], generator=g, dtype=torch.float32) for g in generators]
            )
            for _ in steps
        ]
    )  # [S, B, *latent]
    return dict(zip(steps, draws.to(x.device, non_blocking=True).unbind(0), strict=True))


@torch.no_grad()
def sample_rollout(
    adapter: DiffusionAdapter,
    cond: PromptEmbeds,
    generators: Sequence[torch.Generator],
    spec: SamplerSpec,
    neg_cond: PromptEmbeds | None = None,
    initial_generators: Sequence[torch.Generator] | None = None,
) -> Rollout:
    """Denoise ``len(generators)`` samples from noise, drawing noise at ``spec.noisy`` steps
    and keeping the transitions of ``spec.window``.

    cond (and neg_cond): one row per sample, ``B = len(generators)``. The initial latents
    come from ``initial_generators`` when given (e.g. one shared by a group), else from each
    sample's own generator, which then draws the steps' noise.
    """
    initial = generators if initial_generators is None else initial_generators
    x = adapter.initial_latents(initial).float()  # [B, *latent]
    kept, noisy = set(spec.window), set(spec.noisy)
    noises = _step_noise(generators, x, sorted(noisy))
    states: list[torch.Tensor] = []  # one per latent kept: x_{i+1} of a step is x_i of the next
    starts: list[int] = []
    logps, means = [], []
    last_kept = None
    x0_prev = None  # dpm2: the last step's clean prediction (None: the history restarts)
    post = spec.solver == "dpm2-post"
    last_noisy = max(noisy, default=-1)
    for i in range(spec.num_steps):
        v = _velocity(adapter, x, spec.sigmas[i], cond, neg_cond, spec)
        if post and i <= last_noisy:  # the history Flash's solver keeps through the window
            x0 = x - spec.sigmas[i].float() * v.float()
        if i in noisy:
            out = _step(spec, v, x, i, noise=noises.pop(i))
            if out.log_prob is None:
                raise ValueError(f"step {i} of the SDE window has no noise; raise noise_level")
            if i in kept:
                if last_kept != i - 1:  # a new stretch of the window starts at x_i
                    states.append(x)
                starts.append(len(states) - 1)
                states.append(out.prev_sample)
                last_kept = i
                logps.append(out.log_prob)
                if spec.keep_means:
                    means.append(out.mean)
            x = out.prev_sample
            x0_prev = x0 if post else None
        elif spec.solver == "dpm2" or (post and i > last_noisy):
            x, x0_prev = dpm2_step(v, x, spec.sigmas, i, x0_prev)
        else:
            x = ode_step(v, x, spec.sigmas, i)
            x0_prev = x0 if post else None
    b = x.shape[0]
    empty = x.new_zeros((b, 0) + tuple(x.shape[1:]))
    return Rollout(
        states=torch.stack(states, dim=1) if states else empty,  # [B, S, *latent]
        starts=tuple(starts),
        log_probs=torch.stack(logps, dim=1) if logps else x.new_zeros((b, 0)),
        final=x,
        means=(torch.stack(means, dim=1) if means else empty) if spec.keep_means else None,
    )


def score_step(
    adapter: DiffusionAdapter,
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    step_index: int | torch.Tensor,
    cond: PromptEmbeds,
    spec: SamplerSpec,
    neg_cond: PromptEmbeds | None = None,
) -> StepOutput:
    """Log-prob of ``x_i -> x_{i+1}`` under the adapter's current weights (with grad).

    latents, next_latents: ``[B, *latent]``; step_index: int or ``[B]`` (a batch may mix
    timesteps: the velocity is evaluated at each row's own sigma).
    """
    idx = torch.as_tensor(step_index, dtype=torch.long)
    sigma = spec.sigmas[idx] if idx.ndim else spec.sigmas[int(idx)]
    v = _velocity(adapter, latents, sigma, cond, neg_cond, spec)
    return _step(spec, v, latents, step_index, prev_sample=next_latents)


def logprob_drift_bound(
    latents: torch.Tensor,
    next_latents: torch.Tensor,
    step_index: int | torch.Tensor,
    spec: SamplerSpec,
    out: StepOutput,
    dtype: torch.dtype,
) -> torch.Tensor:
    """``[B]``: how far a log-prob recomputed by :func:`score_step` (``out``) may fall from
    the one recorded at sampling when both came from the same weights computing in
    ``dtype``, so that the velocities differ by rounding only.

    Every step kind's mean is affine in the velocity, ``mu = a x + b v``, so a velocity off
    by a relative ``delta_e`` in element ``e`` moves the mean there by ``delta_e (mu_e -
    mu_0e)`` (``mu_0``: the mean at zero velocity) and the log-prob, to first order, by
    ``sum_e g_e delta_e (mu_e - mu_0e)`` with ``g = d logp / d mu``. Roundings of different
    elements are independent, so their effects add in quadrature: the bound is
    ``K u ||g (mu - mu_0)||_2`` with ``u`` the unit roundoff of ``dtype`` and ``K`` =
    :data:`DRIFT_ROUNDINGS`, plus the fp32 error of the log-prob's own mean over ``n``
    elements (``log2(n)`` roundings of terms of order 1). The latents are the recorded ones
    on both sides, so nothing else differs. In one process on a CPU the drift is exactly 0
    (every row is computed alike whatever the batch); the bound is for kernels that are not
    (GPU GEMMs chosen by batch shape).
    """
    x, prev = latents.float(), next_latents.float()
    with torch.no_grad():
        mu_0 = _step(spec, torch.zeros_like(x), x, step_index, prev_sample=prev).mean
        moved = (out.mean.detach() - mu_0).abs()  # |b v|: [B, *latent]
    mean = out.mean.detach().requires_grad_(True)
    with torch.enable_grad():
        logp = LOG_PROBS[spec.log_prob](prev, mean, out.std.detach())
        (slope,) = torch.autograd.grad(logp.sum(), mean)  # d logp_b / d mu: [B, *latent]
    sensitivity = (slope * moved).flatten(1).norm(dim=1)  # [B]
    n = moved[0].numel()
    u, u32 = torch.finfo(dtype).eps / 2, torch.finfo(torch.float32).eps / 2
    arithmetic = max(n - 1, 1).bit_length() * u32 * (logp.detach().abs() + 1)
    return DRIFT_ROUNDINGS * u * sensitivity + arithmetic


def _step(spec: SamplerSpec, v, x, step_index, **given) -> StepOutput:
    return sde_step(
        spec.sde_type,
        v,
        x,
        spec.sigmas,
        step_index,
        spec.noise_level,
        log_prob=spec.log_prob,
        algorithm=spec.algorithm,
        **given,
    )
