"""The clipped policy-gradient loss and the KL to the reference policy."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ClipStats", "clipped_policy_loss", "guard_log_ratio", "kl_to_reference"]


@dataclass(frozen=True, slots=True)
class ClipStats:
    """Diagnostics of one loss evaluation: detached 0-dim tensors where the loss is, read
    by the caller when it reads (reading each here would wait on the device for each)."""

    policy_loss: torch.Tensor
    clip_fraction: torch.Tensor
    """Fraction of (sample, timestep) terms whose ratio left ``[1 - eps, 1 + eps]``."""
    approx_kl: torch.Tensor
    """``0.5 * mean((logp - old_logp)^2)``: how far the policy moved since sampling."""
    ratio_mean: torch.Tensor


def clipped_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio: float,
    adv_clip_max: float | None = None,
    *,
    log_ratio: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ClipStats]:
    """PPO-clip loss averaged over every (sample, trained timestep) term.

    log_prob, old_log_prob: ``[B, K]`` (or ``[B]``); advantages: ``[B]`` or the same shape as
    log_prob. Returns ``mean(w max(-A r, -A clip(r, 1 - eps, 1 + eps)))`` and its stats, with
    ``r = exp(log_ratio)`` (default ``log_prob - old_log_prob``) and per-term weights ``w``
    (default 1).
    """
    adv = advantages.float()
    if adv.ndim < log_prob.ndim:
        adv = adv.view(adv.shape + (1,) * (log_prob.ndim - adv.ndim)).expand_as(log_prob)
    if adv_clip_max is not None:
        adv = adv.clamp(-adv_clip_max, adv_clip_max)
    diff = log_prob.float() - old_log_prob.float()
    ratio = torch.exp(diff if log_ratio is None else log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_ratio, 1.0 + clip_ratio)
    terms = torch.maximum(unclipped, clipped)
    loss = (terms if weight is None else terms * weight).mean()
    with torch.no_grad():
        stats = ClipStats(
            policy_loss=loss.detach(),
            clip_fraction=((ratio - 1.0).abs() > clip_ratio).float().mean(),
            approx_kl=0.5 * (diff**2).mean(),
            ratio_mean=ratio.mean(),
        )
    return loss, stats


def guard_log_ratio(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    mean: torch.Tensor,
    old_mean: torch.Tensor,
    std: torch.Tensor,
) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio (RatioNorm) of one Gaussian step per row -> ``[B]``.

    ``s (logp - old_logp) + mean((mu - mu_old)^2) / (2 s)`` with ``s`` the step's std and the
    log-probs per-element means (Flow-GRPO's): the plain log-ratio's mean shift
    ``-mean((mu - mu_old)^2) / (2 s^2)``, which pushes ratios below 1, is taken out and what
    is left is scaled to the step's noise. It equals ``mean((mu - mu_old) * eps)`` for the
    step's drawn noise ``eps = (x' - mu_old) / s``.
    log_prob, old_log_prob: ``[B]``; mean, old_mean: ``[B, ...]``; std: ``[B, 1, ...]``.
    """
    s = std.float().reshape(std.shape[0], -1)[:, 0]
    shift = ((mean.float() - old_mean.float()) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return s * (log_prob.float() - old_log_prob.float()) + shift / (2 * s)


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """KL between two Gaussians with equal std: ``mean(||mu - mu_ref||^2) / (2 std^2)`` -> ``[B]``.

    mean, ref_mean: ``[B, ...]``; std: broadcastable ``[B, 1, ...]``.
    """
    sq = ((mean.float() - ref_mean.float()) ** 2).mean(dim=tuple(range(1, mean.ndim)))
    return sq / (2 * std.float().reshape(std.shape[0], -1)[:, 0] ** 2)
