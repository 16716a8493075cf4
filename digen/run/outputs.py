"""What a run leaves in its output directory.

``config.yaml`` (fully resolved), ``metrics.jsonl`` (one JSON object per step), sample grids
``samples/step_XXXX.png``, ``trainer.log`` (structured log lines), the trace (``trace.jsonl``,
:mod:`digen.sched.trace`), with ``--mode auto`` ``plan.json`` (the layouts it weighed) and the
final weights: a LoRA adapter in the diffusers / peft format
(``lora/``) or a full transformer (``transformer/``).
Every file is written whole (temp file + rename) or appended line by line, so an interrupted
run never leaves a half-written file behind; the final weights, like a checkpoint, are written
under a temporary name, flushed to disk and moved into place by
:func:`~digen.checkpoint.publish`, which deletes the ones they replace only after.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image, ImageDraw, ImageFont

from digen.runtime.messages import grid_frames

__all__ = ["RunOutputs", "caption_lines", "sample_grid"]

MIN_TILE_WIDTH = 192
"""Narrowest tile a sample grid draws, in pixels: smaller samples (tiny flavours, thumbnails)
are scaled up by a whole factor, so they can be seen and a caption has room."""
CAPTION_LINES = 3
"""Lines a caption may take; a longer prompt ends in an ellipsis."""


def sample_grid(
    pixels: torch.Tensor, captions: Sequence[str] | None = None, cols: int = 4
) -> Image.Image:
    """A grid of samples; each video sample is a strip of its first, middle and last frame.

    pixels: ``uint8 [B, F, H, W, 3]``. A tile narrower than :data:`MIN_TILE_WIDTH` is scaled up
    (nearest pixel) by the smallest whole factor that reaches it; each caption is wrapped over
    up to :data:`CAPTION_LINES` lines above its tile (:func:`caption_lines`).
    """
    b, f, h, w, _ = pixels.shape
    frames = grid_frames(f)
    zoom = max(1, math.ceil(MIN_TILE_WIDTH / (w * len(frames))))
    h, w = h * zoom, w * zoom
    tile_w = w * len(frames)
    font = _caption_font()
    lines = [caption_lines(c, tile_w - 4, font) for c in captions] if captions else []
    line_h = font.getbbox("Ag")[3] + 2
    label_h = max(map(len, lines)) * line_h + 4 if lines else 0
    cols = max(1, min(cols, b))
    rows = math.ceil(b / cols)
    grid = Image.new("RGB", (cols * tile_w, rows * (h + label_h)), "white")
    draw = ImageDraw.Draw(grid)
    for i in range(b):
        r, c = divmod(i, cols)
        x0, y0 = c * tile_w, r * (h + label_h)
        for j, fr in enumerate(frames):
            tile = Image.fromarray(pixels[i, fr].numpy(), "RGB")
            if zoom > 1:
                tile = tile.resize((w, h), Image.Resampling.NEAREST)
            grid.paste(tile, (x0 + j * w, y0 + label_h))
        for k, line in enumerate(lines[i] if lines else ()):
            draw.text((x0 + 2, y0 + 1 + k * line_h), line, fill="black", font=font)
    return grid


def caption_lines(
    text: str, width: float, font: ImageFont.ImageFont | ImageFont.FreeTypeFont | None = None
) -> list[str]:
    """``text`` wrapped at spaces into at most :data:`CAPTION_LINES` lines no wider than
    ``width`` pixels in ``font`` (default: the one sample grids use). A word wider than a line
    is broken; text that does not fit ends in an ellipsis."""
    font = font or _caption_font()
    ellipsis = "\u2026" if isinstance(font, ImageFont.FreeTypeFont) else "..."

    def fits(s: str) -> bool:
        return font.getlength(s) <= width

    lines: list[str] = []
    line = ""
    for word in text.split():
        if fits(f"{line} {word}" if line else word):
            line = f"{line} {word}" if line else word
            continue
        if line:
            lines.append(line)
        while len(word) > 1 and not fits(word):  # wider than a line: break it
            cut = 1
            while fits(word[: cut + 1]):
                cut += 1
            lines.append(word[:cut])
            word = word[cut:]
        line = word
    if line:
        lines.append(line)
    if len(lines) > CAPTION_LINES:
        last = lines[CAPTION_LINES - 1]
        while last and not fits(last + ellipsis):
            last = last[:-1]
        lines = [*lines[: CAPTION_LINES - 1], last.rstrip() + ellipsis]
    return lines


def _caption_font() -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    """Pillow's own font at 12 px (its bitmap font where Pillow was built without FreeType)."""
    return ImageFont.load_default(size=12)


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

    @property
    def trace_path(self) -> Path:
        """The run's trace file, which a :class:`~digen.sched.trace.Trace` appends each task
        to as it finishes (``Trace(path=outputs.trace_path)``)."""
        return self.dir / "trace.jsonl"

    def write_config(self, cfg_dict: dict[str, Any]) -> None:
        import yaml

        _atomic_write(self.dir / "config.yaml", yaml.safe_dump(cfg_dict, sort_keys=False))

    def write_json(self, name: str, data: Any) -> None:
        """``data`` as indented JSON in ``name``, whole or not at all."""
        _atomic_write(self.dir / name, json.dumps(data, indent=2) + "\n")

    def append_metrics(self, row: dict[str, Any]) -> None:
        with self.metrics_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, sort_keys=False) + "\n")
            fh.flush()

    @property
    def eval_path(self) -> Path:
        """One row per evaluation (``eval.every``), the first before training."""
        return self.dir / "eval.jsonl"

    def append_eval(self, row: dict[str, Any]) -> None:
        with self.eval_path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, sort_keys=False) + "\n")
            fh.flush()

    def save_samples(self, step: int, pixels: torch.Tensor, captions: Sequence[str]) -> Path:
        return self._save_grid(f"step_{step:04d}.png", pixels, captions)

    def save_eval_grid(self, version: int, pixels: torch.Tensor, captions: Sequence[str]) -> Path:
        """The evaluation images of policy version ``version``: ``samples/eval_v0003.png``."""
        return self._save_grid(f"eval_v{version:04d}.png", pixels, captions)

    def _save_grid(self, name: str, pixels: torch.Tensor, captions: Sequence[str]) -> Path:
        path = self.dir / "samples" / name
        tmp = path.with_suffix(".tmp.png")
        sample_grid(pixels, captions).save(tmp)
        os.replace(tmp, path)
        return path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
