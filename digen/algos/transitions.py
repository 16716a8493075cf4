"""The stochastic denoising steps the algorithms are built from, and their log-prob forms.

Each function takes ``x`` (``x_i``), the velocity ``v``, and ``sigma`` / ``sigma_next``
already shaped to broadcast (``[B, 1, ...]``), all fp32, with ``dt = sigma_next - sigma < 0``,
the noise level, and the schedule's second sigma ``sigma_1``, and returns the Gaussian the
next sample is drawn from (:class:`Transition`). Written with
tensor methods only, so this module — and the algorithm files that use it — import without
torch (config checks and presets stay light).

- ``flow_sde`` (Flow-GRPO's SDE): ``s_t = a sqrt(sigma / (1 - sigma~))`` with ``sigma~ =
  sigma_1`` at ``sigma = 1`` (the first step); ``mean = x (1 + s_t^2 dt / (2 sigma)) + v (1 +
  s_t^2 (1 - sigma) / (2 sigma)) dt``; step std ``s_t sqrt(-dt)``. The published code calls
  ``s_t`` (without ``sqrt(-dt)``) its ``std_dev_t``: its KL divides by it.
- ``cps`` (coefficients-preserving): ``std = sigma_next sin(a pi / 2)``; ``mean = (1 -
  sigma_next) x0 + sqrt(sigma_next^2 - std^2) x1`` with ``x0 = x - sigma v``, ``x1 = x + (1 -
  sigma) v``. No noise at the last step (``sigma_next = 0``).
- ``dance`` (DanceGRPO): ``std = eta sqrt(-dt)``; ``mean = x + dt v + dt (eta^2 / 2) (x - (1 -
  sigma) x0) / sigma^2``.

Log-prob forms, both averaged over every non-batch element (per-element means are what the
published clip ranges of 1e-4 / 1e-5 are calibrated for):

- ``gaussian``: the full log-density, ``-(x' - mean)^2 / (2 std^2) - log std - log sqrt(2 pi)``;
- ``mse`` (the published cps form): ``-(x' - mean)^2``, no ``1 / (2 std^2)``, no constants —
  its log-ratios are the Gaussian ones times ``2 std^2``, so a clip range means something else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from digen.registry.algos import SDE_TYPES

if TYPE_CHECKING:
    from torch import Tensor

__all__ = [
    "LOG_PROBS",
    "STEP_KINDS",
    "Transition",
    "cps",
    "dance",
    "flow_sde",
    "gaussian_log_prob",
    "mse_log_prob",
]

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass(frozen=True, slots=True)
class Transition:
    """``x_{i+1} ~ N(mean, std^2)``, per element."""

    mean: Tensor
    """``[B, ...]``."""
    std: Tensor
    """``[B, 1, ...]``: the step's standard deviation (broadcasts against ``mean``)."""
    kl_std: Tensor
    """``[B, 1, ...]``: the std the published KL divides by (``s_t`` for ``flow_sde``, where
    it lacks ``sqrt(-dt)``; the step std otherwise)."""


def flow_sde(
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, a: float, sigma_1: Tensor
) -> Transition:
    """Flow-GRPO's SDE step (module docstring); ``sigma_1``: the schedule's second sigma."""
    dt = sigma_next - sigma
    s_t = a * (sigma / (1 - sigma.where(sigma != 1, sigma_1))).sqrt()
    mean = x * (1 + s_t**2 / (2 * sigma) * dt) + v * (1 + s_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return Transition(mean, s_t * (-dt).sqrt(), s_t)


def cps(
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, a: float, sigma_1: Tensor
) -> Transition:
    """The coefficients-preserving step (module docstring)."""
    std = sigma_next * math.sin(a * math.pi / 2)
    x0, x1 = x - sigma * v, x + (1 - sigma) * v  # predicted clean sample, predicted noise
    mean = x0 * (1 - sigma_next) + x1 * (sigma_next**2 - std**2).clamp_min(0).sqrt()
    return Transition(mean, std, std)


def dance(
    x: Tensor, v: Tensor, sigma: Tensor, sigma_next: Tensor, eta: float, sigma_1: Tensor
) -> Transition:
    """DanceGRPO's step (module docstring)."""
    dt = sigma_next - sigma
    x0 = x - sigma * v
    std = eta * (-dt).sqrt()
    mean = x + dt * v + dt * (eta**2 / 2) * (x - (1 - sigma) * x0) / sigma**2
    return Transition(mean, std, std)


def _per_sample_mean(t: Tensor) -> Tensor:
    return t.mean(dim=tuple(range(1, t.ndim)))


def gaussian_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """``log N(x; mean, std^2)`` averaged over non-batch elements -> ``[B]``."""
    return _per_sample_mean(-((x - mean) ** 2) / (2 * std**2) - std.log() - _LOG_SQRT_2PI)


def mse_log_prob(x: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """The published cps form: ``-mean((x - mean)^2)`` -> ``[B]`` (``std`` unused)."""
    return -_per_sample_mean((x - mean) ** 2)


LOG_PROBS = {"gaussian": gaussian_log_prob, "mse": mse_log_prob}
"""Log-prob forms by name."""

STEP_KINDS = dict(zip(SDE_TYPES, (flow_sde, cps, dance), strict=True))
"""Each step kind the registry names (:data:`~digen.registry.algos.SDE_TYPES`), by its function."""
"""Stochastic step kinds by name (``rollout.sde_type``); one signature: ``(x, v, sigma,
sigma_next, noise_level, sigma_1)``."""
