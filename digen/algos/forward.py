"""The forward process of the algorithms that train on the clean latent alone (DiffusionNFT,
AWM, DGPO).

Each trained term -- one sample at one of its trained timesteps -- noises the sample's clean
latent ``x0`` afresh: ``x_t = (1 - t) x0 + t eps`` with ``t`` the timestep's sigma. The noise
``eps`` comes from a generator seeded by the term alone (:func:`~digen.seeding.nft_noise_generator`:
run seed, train step, prompt, sample, timestep) or, for noise a group shares, by the group and
timestep (:func:`~digen.seeding.group_noise_generator`), never from a global stream: a term's
noise is the same whichever worker trains it and in whatever pass, so a run is the same bit
for bit in either mode. The flow-matching target of a term is the velocity ``eps - x0``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from digen.algos.base import TrainChunk

__all__ = ["ForwardTerms", "forward_terms", "mean_square"]


@dataclass(frozen=True, slots=True)
class ForwardTerms:
    """The noised terms of a :class:`~digen.algos.base.TrainChunk`, fp32 on its device."""

    x0: Tensor
    """``[R, *latent]``: each term's clean latent."""
    noise: Tensor
    """``[R, *latent]``: each term's ``eps``."""
    sigma: Tensor
    """``[R]``: each term's sigma ``t``."""
    x_t: Tensor
    """``[R, *latent]``: ``(1 - t) x0 + t eps``."""

    @property
    def t(self) -> Tensor:
        """``[R, 1, ...]``: sigma broadcastable over a latent."""
        return self.sigma.view(-1, *([1] * (self.x0.ndim - 1)))

    @property
    def target(self) -> Tensor:
        """``[R, *latent]``: the flow-matching velocity target ``eps - x0``."""
        return self.noise - self.x0

    @property
    def dims(self) -> tuple[int, ...]:
        """The latent dims of a term (what per-term means reduce)."""
        return tuple(range(1, self.x0.ndim))


def forward_terms(seed: int, chunk: TrainChunk, *, shared_by_group: bool = False) -> ForwardTerms:
    """``chunk``'s terms noised with their seeded noise: each term's own, or with
    ``shared_by_group`` one draw per (group, timestep) that every sample of the group uses."""
    import torch

    from digen.seeding import group_noise_generator, nft_noise_generator

    x0 = chunk.rollout.final[chunk.rows].float()  # [R, *latent]

    def draw(k, i: int) -> Tensor:
        if shared_by_group:
            g = group_noise_generator(seed, k.step, k.prompt, i)
        else:
            g = nft_noise_generator(seed, k.step, k.prompt, k.sample, i)
        return torch.randn(x0.shape[1:], generator=g, dtype=torch.float32)

    noise = torch.stack(
        [draw(k, i) for k, i in zip(chunk.keys, chunk.steps.tolist(), strict=True)]
    ).to(x0.device)  # [R, *latent]
    sigma = chunk.spec.sigmas.to(x0.device)[chunk.steps]  # [R]
    t = sigma.view(-1, *([1] * (x0.ndim - 1)))  # [R, 1, ...]
    x_t = (1 - t) * x0 + t * noise
    return ForwardTerms(x0, noise, sigma, x_t)


def mean_square(a: Tensor, b: Tensor) -> Tensor:
    """``mean((a - b)^2)`` over each row's non-batch dims -> ``[R]``."""
    return ((a - b) ** 2).mean(dim=tuple(range(1, a.ndim)))
