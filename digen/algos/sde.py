"""One denoising step of a flow-matching sampler, stochastic or not, with its log-prob.

Sigmas decrease from about 1 to 0; the velocity ``v`` is the model's prediction at ``sigma_i``
and ``dt = sigma_{i+1} - sigma_i < 0``. All math is fp32. The step index is always passed in
explicitly (an int, or one index per sample so a batch may mix timesteps); nothing here keeps
a hidden counter.

The stochastic kinds (``sde``, ``cps``, ``dance``) and the log-prob forms (``gaussian``,
``mse``) are defined in :mod:`digen.algos.transitions`; an algorithm may bring its own kind
(:meth:`digen.algos.base.Algorithm.transition`). Pass ``noise`` to sample, or
``prev_sample`` to score a sample that was drawn earlier (training).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from digen.algos.transitions import LOG_PROBS, STEP_KINDS, Transition
from digen.registry.algos import SDE_TYPES, get_algorithm

__all__ = ["StepOutput", "dpm2_step", "gaussian_log_prob", "ode_step", "sde_step"]

gaussian_log_prob = LOG_PROBS["gaussian"]


@dataclass(frozen=True, slots=True)
class StepOutput:
    prev_sample: torch.Tensor
    """``x_{i+1}``: ``[B, ...]``, fp32."""
    log_prob: torch.Tensor | None
    """``[B]``: mean Gaussian log-density of ``prev_sample`` per element (None with zero noise)."""
    mean: torch.Tensor
    """``[B, ...]``: the Gaussian's mean."""
    std: torch.Tensor
    """``[B, 1, ...]``: the Gaussian's standard deviation (broadcasts against ``mean``)."""
    kl_std: torch.Tensor | None = None
    """``[B, 1, ...]``: the std the published KL divides by (see ``steps.Transition``)."""


def _gather_sigma(
    sigmas: torch.Tensor, step_index: int | torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sigma_i`` and ``sigma_{i+1}`` shaped ``[B, 1, ...]`` to broadcast against ``like``.

    Step indices are host data (an int, or a CPU tensor: the noisy steps'), checked here on the
    host; only the gathered sigmas go to ``like``'s device."""
    b = like.shape[0]
    idx = torch.as_tensor(step_index, dtype=torch.long, device=sigmas.device)
    if idx.ndim == 0:
        idx = idx.expand(b)
    if idx.shape != (b,):
        raise ValueError(f"step_index must be an int or shape [{b}], got {tuple(idx.shape)}")
    if int(idx.max()) + 1 >= sigmas.numel() or int(idx.min()) < 0:
        raise IndexError(f"step_index out of range for {sigmas.numel() - 1} steps")
    view = (b,) + (1,) * (like.ndim - 1)
    # gathered where the sigmas are (the host's) and sent in one copy that does not wait
    # for the device's queue (the host's memory is staged at once)
    pair = torch.stack([sigmas[idx], sigmas[idx + 1]]).to(torch.float32)  # [2, B]
    pair = pair.to(like.device, non_blocking=True)
    return pair[0].view(view), pair[1].view(view)


def ode_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int | torch.Tensor,
) -> torch.Tensor:
    """The deterministic Euler step ``x + (sigma_{i+1} - sigma_i) v`` (diffusers' flow-match Euler)."""
    x, v = sample.float(), velocity.float()
    sigma, sigma_next = _gather_sigma(sigmas, step_index, x)
    return x + (sigma_next - sigma) * v


def dpm2_step(
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int,
    x0_prev: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the second-order multistep DPM-Solver++ on a flow-matching schedule.

    The data prediction is ``x0 = x - sigma_i v`` and, with ``alpha = 1 - sigma`` and
    ``lambda = log(alpha / sigma)``, ``h = lambda_{i+1} - lambda_i``,
    ``r = (lambda_i - lambda_{i-1}) / h``:
    ``x' = (sigma_{i+1} / sigma_i) x - alpha_{i+1} (e^{-h} - 1) (x0 + (x0 - x0_prev) / (2 r))``.
    Without a history (``x0_prev`` None: the first step, or after a noisy one) and at the
    last step (``sigma_{i+1} = 0``, where ``lambda`` is infinite) it is the first-order
    step, which on this schedule is Euler's (``x' = x0`` at the end). The sigmas enter in
    fp64 and the latents stay fp32, as DiffusionNFT's sampler computes them.
    Returns ``(x', x0)``; pass ``x0`` back as the next step's ``x0_prev``.
    """
    x, v = sample.float(), velocity.float()
    s64 = sigmas.double()
    s, t = s64[step_index], s64[step_index + 1]
    x0 = x - sigmas[step_index].float() * v
    if x0_prev is None or step_index == sigmas.numel() - 2:
        noise = (x - (1 - s) * x0) / s
        return (1 - t) * x0 + t * noise, x0
    u = s64[step_index - 1]
    lam_t, lam_s, lam_u = (torch.log(1 - z) - torch.log(z) for z in (t, s, u))
    h, h0 = lam_t - lam_s, lam_s - lam_u
    d1 = (1.0 / (h0 / h)) * (x0 - x0_prev)
    a = (1 - t) * (torch.exp(-h) - 1.0)
    return (t / s) * x - a * x0 - 0.5 * a * d1, x0


def sde_step(
    sde_type: str,
    velocity: torch.Tensor,
    sample: torch.Tensor,
    sigmas: torch.Tensor,
    step_index: int | torch.Tensor,
    noise_level: float,
    *,
    noise: torch.Tensor | None = None,
    prev_sample: torch.Tensor | None = None,
    log_prob: str = "gaussian",
    algorithm: str | None = None,
) -> StepOutput:
    """One stochastic step from ``sample`` (``x_i``) with velocity ``v``.

    velocity, sample: ``[B, ...]``; sigmas: ``[N + 1]``; step_index: int or ``[B]``.
    Exactly one of ``noise`` (standard normal, ``[B, ...]``: draw ``prev_sample``) and
    ``prev_sample`` (score a given ``x_{i+1}``) must be given. ``log_prob``: the form
    (``gaussian`` or ``mse``); ``algorithm``: whose step kinds to use (None: the shared ones).
    """
    if (noise is None) == (prev_sample is None):
        raise ValueError("pass exactly one of noise (to sample) or prev_sample (to score)")
    if algorithm is None and sde_type not in STEP_KINDS:
        raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}")
    x, v = sample.float(), velocity.float()
    sigma, sigma_next = _gather_sigma(sigmas, step_index, x)
    sigma_1, _ = _gather_sigma(sigmas, 1, x[:1])  # [1, 1, ...]: broadcasts

    def transition(x: torch.Tensor, v: torch.Tensor, *sigma_args: torch.Tensor) -> Transition:
        if algorithm is None:
            return STEP_KINDS[sde_type](x, v, *sigma_args[:2], noise_level, sigma_args[2])
        return get_algorithm(algorithm).transition(
            sde_type, x, v, *sigma_args[:2], noise_level, sigma_args[2]
        )

    tr = transition(x, v, sigma, sigma_next, sigma_1)
    mean, std = tr.mean, tr.std.expand((x.shape[0],) + tuple(tr.std.shape[1:]))
    # Which rows have no noise, asked of the host's sigmas (a step's std is a function of
    # its sigmas and the noise level alone), so that a step never waits on the device.
    host = sigmas.detach().to("cpu", torch.float32)
    s_h, s1_h = _gather_sigma(host, step_index, host.new_zeros(x.shape[0], 1))
    std_h = transition(s_h.new_zeros(s_h.shape), s_h.new_zeros(s_h.shape), s_h, s1_h, host[1]).std
    quiet = std_h.expand(x.shape[0], 1) <= 0  # [B, 1] on the host
    deterministic = bool(quiet.all())
    if prev_sample is None:
        prev_sample = mean if deterministic else mean + std * noise.float()
    if bool(quiet.any()):
        if not deterministic or noise is None:
            raise ValueError(
                f"the {sde_type} step at step_index {step_index} has zero noise for some samples "
                "(noise_level 0, or the last step of cps), so it has no log-prob"
            )
        return StepOutput(prev_sample, None, mean, std, tr.kl_std)
    prev_sample = prev_sample.float()
    logp = LOG_PROBS[log_prob](prev_sample.detach(), mean, std)
    return StepOutput(prev_sample, logp, mean, std, tr.kl_std)
