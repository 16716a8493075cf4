"""Placement-independent randomness.

Every sample's initial latent and SDE noise come from its own generator, seeded from
``(run seed, step, prompt index, sample index)``, so a sample is the same whichever process
makes it, in whatever batch and order. Nothing in digen draws from the process-global RNG.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = [
    "derive_seed",
    "eval_generator",
    "group_generator",
    "group_noise_generator",
    "nft_noise_generator",
    "sample_generator",
    "step_generator",
]

_MASK = (1 << 63) - 1


def derive_seed(*parts: int | str) -> int:
    """A 63-bit seed from any tuple of ints / strings (stable across processes and runs)."""
    text = "/".join(str(p) for p in parts)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


def sample_generator(seed: int, step: int, prompt_index: int, sample_index: int) -> torch.Generator:
    """The CPU generator of one sample: its initial latent, then its SDE noise, in order."""
    return torch.Generator("cpu").manual_seed(
        derive_seed("sample", seed, step, prompt_index, sample_index)
    )


def eval_generator(seed: int, prompt_index: int, sample_index: int) -> torch.Generator:
    """The CPU generator of one evaluation image: its initial latent, the same at every
    evaluation of a run (a separate stream: evaluating never moves a training sample's)."""
    return torch.Generator("cpu").manual_seed(derive_seed("eval", seed, prompt_index, sample_index))


def group_generator(seed: int, step: int, prompt_index: int) -> torch.Generator:
    """The CPU generator of a group's shared initial latent (``rollout.same_initial_noise``)."""
    return torch.Generator("cpu").manual_seed(derive_seed("group", seed, step, prompt_index))


def nft_noise_generator(
    seed: int, step: int, prompt_index: int, sample_index: int, timestep: int
) -> torch.Generator:
    """The CPU generator of the noise a forward-process algorithm adds to one sample's clean
    latent at one trained timestep (its own stream: it moves no sampling noise)."""
    return torch.Generator("cpu").manual_seed(
        derive_seed("forward-noise", seed, step, prompt_index, sample_index, timestep)
    )


def group_noise_generator(
    seed: int, step: int, prompt_index: int, timestep: int
) -> torch.Generator:
    """The CPU generator of the noise a forward-process algorithm adds to every clean latent
    of one group at one trained timestep, shared by the group (DGPO's shared noise)."""
    return torch.Generator("cpu").manual_seed(
        derive_seed("group-forward-noise", seed, step, prompt_index, timestep)
    )


def step_generator(seed: int, step: int, purpose: str) -> torch.Generator:
    """A CPU generator for a per-step choice shared by all samples (e.g. the SDE window)."""
    return torch.Generator("cpu").manual_seed(derive_seed("step", seed, step, purpose))
