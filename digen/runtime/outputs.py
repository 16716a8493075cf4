"""What a run leaves in its output directory.

``config.yaml`` (fully resolved), ``metrics.jsonl`` (one JSON object per step), sample grids
``samples/step_XXXX.png``, ``trainer.log`` (structured log lines) and the final weights: a
LoRA adapter in the diffusers / peft format (``lora/``) or a full transformer (``transformer/``).
Every file is written whole (temp file + rename) or appended line by line, so an interrupted
run never leaves a half-written file behind.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw

__all__ = ["THUMBNAIL_SIDE", "RunOutputs", "sample_grid", "thumbnails"]

THUMBNAIL_SIDE = 64
"""Longest side of the thumbnails a disaggregated run brings back for its sample grids."""


def grid_frames(frames: int) -> list[int]:
    """The frames a sample grid shows of a video: first, middle and last."""
    return [0] if frames == 1 else sorted({0, frames // 2, frames - 1})


def thumbnails(pixels: torch.Tensor, max_side: int = THUMBNAIL_SIDE) -> torch.Tensor:
    """Small copies of decoded samples for sample grids: the grid's frames, area-downscaled.

    pixels: ``uint8 [B, F, H, W, 3]`` -> ``uint8 [B, F', h, w, 3]`` with ``max(h, w) <=
    max_side`` and ``F'`` the frames :func:`sample_grid` shows, so what crosses the network
    for a grid does not grow with the image size.
    """
    b, f, h, w, _ = pixels.shape
    x = pixels[:, grid_frames(f)]
    scale = max_side / max(h, w)
    if scale >= 1.0:
        return x.clone()
    size = (max(1, round(h * scale)), max(1, round(w * scale)))
    frames = x.shape[1]
    flat = x.reshape(b * frames, h, w, 3).permute(0, 3, 1, 2).float()  # [B*F', 3, H, W]
    small = torch.nn.functional.interpolate(flat, size=size, mode="area")
    small = small.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)  # [B*F', h, w, 3]
    return small.reshape(b, frames, *size, 3)


def sample_grid(
    pixels: torch.Tensor, captions: Sequence[str] | None = None, cols: int = 4
) -> Image.Image:
    """A grid of samples; each video sample is a strip of its first, middle and last frame.

    pixels: ``uint8 [B, F, H, W, 3]``.
    """
    b, f, h, w, _ = pixels.shape
    frames = grid_frames(f)
    tile_w = w * len(frames)
    label_h = 12 if captions else 0
    cols = max(1, min(cols, b))
    rows = math.ceil(b / cols)
    grid = Image.new("RGB", (cols * tile_w, rows * (h + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(b):
        r, c = divmod(i, cols)
        x0, y0 = c * tile_w, r * (h + label_h)
        for j, fr in enumerate(frames):
            tile = Image.fromarray(pixels[i, fr].numpy(), "RGB")
            grid.paste(tile, (x0 + j * w, y0 + label_h))
        if captions:
            draw.text((x0 + 1, y0), captions[i][: max(4, tile_w // 6)], fill="black")
    return grid


class RunOutputs:
    """The output directory of one run."""

    def __init__(self, out_dir: str | os.PathLike) -> None:
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "samples").mkdir(exist_ok=True)

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    @property
    def log_path(self) -> Path:
        return self.dir / "trainer.log"

    def write_config(self, cfg_dict: dict[str, Any]) -> None:
        import yaml

        _atomic_write(self.dir / "config.yaml", yaml.safe_dump(cfg_dict, sort_keys=False))

    def append_metrics(self, row: dict[str, Any]) -> None:
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, sort_keys=False) + "\n")
            fh.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        if not self.metrics_path.is_file():
            return []
        return [json.loads(line) for line in self.metrics_path.read_text().splitlines() if line]

    def save_samples(self, step: int, pixels: torch.Tensor, captions: Sequence[str]) -> Path:
        path = self.dir / "samples" / f"step_{step:04d}.png"
        tmp = path.with_suffix(".tmp.png")
        sample_grid(pixels, captions).save(tmp)
        os.replace(tmp, path)
        return path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
