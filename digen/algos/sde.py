"""One denoising step of a flow-matching sampler, stochastic or not, with its log-prob.

Sigmas decrease from about 1 to 0; the velocity ``v`` is the model's prediction at ``sigma_i``
and ``dt = sigma_{i+1} - sigma_i < 0``. All math is fp32. The step index is always passed in
explicitly (an int, or one index per sample so a batch may mix timesteps); nothing here keeps
a hidden counter.

Three stochastic variants:

- ``sde`` (Flow-GRPO): the marginal-preserving SDE of the probability-flow ODE,
  ``std_t = a * sqrt(sigma / (1 - sigma))`` (``sigma_1`` replaces ``sigma`` in ``1 - sigma`` at
  ``sigma == 1``), step noise ``std_t * sqrt(-dt)``.
- ``cps`` (Flow-GRPO, coefficients-preserving): ``std = sigma_{i+1} * sin(a * pi / 2)``; the
  mean re-mixes the predicted clean image and noise so total variance is kept.
- ``dance`` (DanceGRPO): ``std = eta * sqrt(sigma - sigma_{i+1})`` with a score correction.

The log-prob is the Gaussian log-density of ``prev_sample`` under ``N(mean, std^2)``,
averaged over every non-batch dimension. Pass ``noise`` to sample, or ``prev_sample`` to
score a sample that was drawn earlier (training).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["SDE_TYPES", "StepOutput", "gaussian_log_prob", "ode_step", "sde_step"]

SDE_TYPES = ("sde", "cps", "dance")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


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


def _gather_sigma(
    sigmas: torch.Tensor, step_index: int | torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sigma_i`` and ``sigma_{i+1}`` shaped ``[B, 1, ...]`` to broadcast against ``like``."""
    b = like.shape[0]
    idx = torch.as_tensor(step_index, dtype=torch.long, device=sigmas.device)
    if idx.ndim == 0:
        idx = idx.expand(b)
    if idx.shape != (b,):
        raise ValueError(f"step_index must be an int or shape [{b}], got {tuple(idx.shape)}")
    if int(idx.max()) + 1 >= sigmas.numel() or int(idx.min()) < 0:
        raise IndexError(f"step_index out of range for {sigmas.numel() - 1} steps")
    view = (b,) + (1,) * (like.ndim - 1)
    sigmas = sigmas.to(device=like.device, dtype=torch.float32)
    idx = idx.to(like.device)
    return sigmas[idx].view(view), sigmas[idx + 1].view(view)


def gaussian_log_prob(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """``log N(x; mean, std^2)`` averaged over non-batch dims -> ``[B]``."""
    logp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    return logp.mean(dim=tuple(range(1, logp.ndim)))


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
) -> StepOutput:
    """One stochastic step from ``sample`` (``x_i``) with velocity ``v``.

    velocity, sample: ``[B, ...]``; sigmas: ``[N + 1]``; step_index: int or ``[B]``.
    Exactly one of ``noise`` (standard normal, ``[B, ...]``: draw ``prev_sample``) and
    ``prev_sample`` (score a given ``x_{i+1}``) must be given.
    """
    if (noise is None) == (prev_sample is None):
        raise ValueError("pass exactly one of noise (to sample) or prev_sample (to score)")
    x, v = sample.float(), velocity.float()
    sigma, sigma_next = _gather_sigma(sigmas, step_index, x)
    dt = sigma_next - sigma  # [B, 1, ...], negative

    if sde_type == "sde":
        sigma_max = sigmas[1].to(x.device, torch.float32)
        std_t = noise_level * torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma)))
        mean = (
            x * (1 + std_t**2 / (2 * sigma) * dt)
            + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        std = std_t * torch.sqrt(-dt)
    elif sde_type == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        x0 = x - sigma * v  # predicted clean sample
        x1 = x + (1 - sigma) * v  # predicted noise
        mean = x0 * (1 - sigma_next) + x1 * torch.sqrt((sigma_next**2 - std**2).clamp_min(0))
    elif sde_type == "dance":
        x0 = x - sigma * v
        std = noise_level * torch.sqrt(sigma - sigma_next)
        mean = x + dt * v + dt * (noise_level**2 / 2) * (x - (1 - sigma) * x0) / sigma**2
    else:
        raise ValueError(f"unknown sde_type {sde_type!r}; expected one of {SDE_TYPES}")

    deterministic = bool((std <= 0).all())
    if prev_sample is None:
        prev_sample = mean if deterministic else mean + std * noise.float()
    if bool((std <= 0).any()):
        if not deterministic or noise is None:
            raise ValueError(
                f"the {sde_type} step at step_index {step_index} has zero noise for some samples "
                "(noise_level 0, or the last step of cps), so it has no log-prob"
            )
        return StepOutput(prev_sample=prev_sample, log_prob=None, mean=mean, std=std)
    prev_sample = prev_sample.float()
    log_prob = gaussian_log_prob(prev_sample.detach(), mean, std)
    return StepOutput(prev_sample=prev_sample, log_prob=log_prob, mean=mean, std=std)
