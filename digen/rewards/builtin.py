"""The JPEG rewards digen ships: a sample's JPEG size, a cheap reward with a clear optimum.

``jpeg_incompressibility`` (the quick start's reward: detailed samples score higher) and
``jpeg_compressibility`` (smooth samples score higher), named so in a config
(:mod:`digen.registry.rewards`). They take no ``options``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from digen.rewards.hooks import check_samples

__all__ = ["JPEG_QUALITY", "jpeg_compressibility", "jpeg_incompressibility", "jpeg_size_kb"]

JPEG_QUALITY = 95


def jpeg_size_kb(samples: torch.Tensor) -> torch.Tensor:
    """JPEG size (quality 95) in kB (bytes / 1000) of each sample, averaged over frames.

    samples: ``[B, F, H, W, 3]`` uint8 -> ``[B]`` float64.
    """
    check_samples(samples)
    frames = samples.detach().cpu().numpy()  # [B, F, H, W, 3]
    sizes = np.empty(frames.shape[:2], dtype=np.float64)  # [B, F]
    for b in range(frames.shape[0]):
        for f in range(frames.shape[1]):
            buffer = io.BytesIO()
            Image.fromarray(frames[b, f]).save(buffer, format="JPEG", quality=JPEG_QUALITY)
            sizes[b, f] = buffer.tell() / 1000.0
    return torch.from_numpy(sizes.mean(axis=1))


def jpeg_incompressibility(
    samples: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> torch.Tensor:
    """Reward = +JPEG size in kB: detailed, hard-to-compress samples score higher."""
    return jpeg_size_kb(samples)


def jpeg_compressibility(
    samples: torch.Tensor, prompts: Sequence[str], metadata: Sequence[Mapping[str, Any]]
) -> torch.Tensor:
    """Reward = -JPEG size in kB: smooth, easy-to-compress samples score higher (always <= 0)."""
    return -jpeg_size_kb(samples)
