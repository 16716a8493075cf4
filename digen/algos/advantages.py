"""Group-relative advantages and DanceGRPO's best-of-N selection."""

from __future__ import annotations

import torch

__all__ = ["best_of_n", "group_advantages"]


def group_advantages(
    rewards: torch.Tensor,
    *,
    norm: str = "group",
    std: str = "group",
    unbiased: bool = False,
    eps: float = 1e-4,
    clip_max: float | None = None,
) -> torch.Tensor:
    """Advantages of each sample relative to its group.

    rewards: ``[G, n]`` (G groups of n samples of one prompt each) -> ``[G, n]`` fp32.
    ``norm="group"``: ``(r - mean_g) / (s + eps)``, with ``s`` each group's std
    (``std="group"``) or one std over every reward given (``std="global"``: Flow-GRPO's
    shipped configs, over the whole batch), population or ``unbiased`` (``n - 1``: DanceGRPO,
    MixGRPO); ``norm="none"`` (Dr.GRPO): ``r - mean_g``. Clipped to ``[-clip_max,
    clip_max]`` when given. With ``std="group"`` a group needs only its own n rewards, so
    it can be computed as soon as it is scored.
    """
    if rewards.ndim != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be [groups, n] with n >= 2, got {tuple(rewards.shape)}")
    r = rewards.float()
    adv = r - r.mean(dim=1, keepdim=True)
    if norm == "group":
        if std == "group":
            scale = r.std(dim=1, unbiased=unbiased, keepdim=True)
        elif std == "global":
            scale = r.std(unbiased=unbiased)
        else:
            raise ValueError(f"unknown advantage std {std!r}; expected 'group' or 'global'")
        adv = adv / (scale + eps)
    elif norm != "none":
        raise ValueError(f"unknown advantage norm {norm!r}; expected 'group' or 'none'")
    if clip_max is not None:
        adv = adv.clamp(-clip_max, clip_max)
    return adv


def best_of_n(advantages: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k/2`` best and ``k/2`` worst samples of each group.

    advantages: ``[G, n]`` -> LongTensor ``[G, k]`` (best first, then the worst half in
    descending order; among ties the lower index ranks higher). DanceGRPO trains only on
    these, the most informative samples of each group.
    """
    g, n = advantages.shape
    if k % 2 or not 2 <= k <= n:
        raise ValueError(f"best_of_n k must be even and in [2, {n}], got {k}")
    order = torch.sort(advantages, dim=1, descending=True, stable=True).indices  # [G, n]
    # both halves from one ordering, so they never overlap, even when all advantages tie
    return torch.cat([order[:, : k // 2], order[:, n - k // 2 :]], dim=1)
