"""A reward that is smooth in the samples, for tests comparing runs whose samples may differ
in their last bits (another batch shape, another kernel): the mean brightness moves by
``1 / (255 x pixels)`` when one pixel rounds to the next level, where a JPEG size can jump by
bytes, turning the last bits of a sample into other advantages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


def brightness(
    samples: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> torch.Tensor:
    """The mean of every pixel in ``[0, 1]`` (``uint8 [B, F, H, W, 3]`` -> ``[B]``)."""
    return samples.to(torch.float64).mean(dim=(1, 2, 3, 4)) / 255.0
