"""Which denoising steps are stochastic (the SDE window) and which of them are trained.

Both choices are seeded, never drawn from a global RNG: the window from ``(seed, step)`` so
every sample of a train step shares it wherever it is made; the trained subset from
``(seed, step, prompt, sample)`` so it does not depend on the worker or the batch.
"""

from __future__ import annotations

import torch

from digen.seeding import derive_seed, step_generator

__all__ = ["sde_window", "train_timesteps"]


def sde_window(
    *,
    seed: int,
    step: int,
    num_inference_steps: int,
    window_size: int,
    window_range: tuple[int, int] | None = None,
    sde_type: str = "sde",
) -> list[int]:
    """Step indices of the SDE window of train step ``step``, ascending.

    ``window_size == 0`` makes every step stochastic. Otherwise the window start is drawn
    uniformly from ``[lo, hi - window_size]`` of ``window_range`` (default: all steps).
    ``cps`` has no noise at the last step (``sigma_{N} = 0``), so its window stops before it.
    """
    last = num_inference_steps - 1 if sde_type == "cps" else num_inference_steps
    if window_size == 0:
        return list(range(last))
    lo, hi = window_range if window_range is not None else (0, num_inference_steps)
    hi = min(hi, last)
    if hi - lo < window_size:
        raise ValueError(
            f"SDE window of {window_size} steps does not fit in [{lo}, {hi}) for {sde_type}"
        )
    g = step_generator(seed, step, "sde_window")
    start = lo + int(torch.randint(0, hi - lo - window_size + 1, (1,), generator=g))
    return list(range(start, start + window_size))


def train_timesteps(
    window: list[int],
    fraction: float,
    *,
    seed: int,
    step: int,
    prompt_index: int,
    sample_index: int,
) -> list[int]:
    """Positions (into ``window``) trained for one sample, ascending.

    ``fraction == 1`` trains every window step; otherwise ``max(1, int(len * fraction))``
    positions drawn without replacement (DanceGRPO's timestep fraction).
    """
    k = len(window)
    if fraction >= 1.0:
        return list(range(k))
    count = max(1, int(k * fraction))
    g = torch.Generator().manual_seed(
        derive_seed("timesteps", seed, step, prompt_index, sample_index)
    )
    return sorted(torch.randperm(k, generator=g)[:count].tolist())
