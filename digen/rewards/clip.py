"""CLIP score: how well each sample matches its prompt, by a CLIP model from a local directory.

    rewards:
      - {name: clip, options: {model_dir: /models/clip-vit-large-patch14}}

A reward hook written against the public hook API only (a class with ``setup`` / ``close``
and ``__call__(samples, prompts, metadata)``), as a user would write one: nothing of digen's
internals is used. The directory is a ``transformers`` CLIP checkpoint saved with
``save_pretrained`` — the model, its tokenizer and its image processor (``openai/clip-vit-*``
downloaded once, e.g. with ``huggingface-cli download --local-dir``). Nothing is fetched at
run time.

The score of a sample is ``scale x cos(image embedding, prompt embedding)``, each embedding
being the model's projected feature; a video scores the mean over its frames. ``scale`` is 1
by default (a cosine in [-1, 1]); 100 gives the ``CLIPScore`` convention of torchmetrics
(which also clips negatives to 0; set ``clip_negative=True`` for that).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["ClipScore"]


class ClipScore:
    """Reward hook ``(samples [B, F, H, W, 3] uint8, prompts, metadata) -> B floats``.

    ``model_dir``: the CLIP checkpoint; ``device``: where the model runs: ``worker`` (the
    default), the device of the worker that scores (its GPU, or the CPU), or a device such as
    ``cpu`` or ``cuda:1``; ``batch_size``: images per forward pass.
    """

    def __init__(
        self,
        model_dir: str,
        device: str = "worker",
        scale: float = 1.0,
        clip_negative: bool = False,
        batch_size: int = 32,
    ) -> None:
        path = Path(model_dir).expanduser()
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model_dir '{model_dir}' is not a CLIP checkpoint directory (no config.json): "
                "save one with CLIPModel.save_pretrained, with its tokenizer and image processor."
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self.model_dir, self.device = path, device
        self.scale, self.clip_negative, self.batch_size = float(scale), clip_negative, batch_size
        self._parts: tuple[Any, Any, Any] | None = None
        self._lock = threading.Lock()

    async def setup(self) -> None:
        """Load the model, tokenizer and image processor (once, off the event loop)."""
        await asyncio.to_thread(self._load)

    async def close(self) -> None:
        """Drop the model; a later call loads it again."""
        self._parts = None

    def _load(self) -> tuple[Any, Any, Any]:
        with self._lock:
            if self.device == "worker":  # on a thread of the scoring worker: its device
                from digen.rewards.loop import worker_device

                self.device = worker_device()
            if self._parts is None:
                from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

                from digen.quiet import hf_quiet

                # loading bars and optional-dependency notices would reach the terminal
                with hf_quiet():
                    model = CLIPModel.from_pretrained(self.model_dir).to(self.device).eval()
                    tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                    images = AutoImageProcessor.from_pretrained(self.model_dir)
                self._parts = (model, tokenizer, images)
            return self._parts

    @torch.no_grad()
    def __call__(
        self,
        samples: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]],
    ) -> list[float]:
        if len(prompts) != samples.shape[0]:
            raise ValueError(f"got {samples.shape[0]} samples but {len(prompts)} prompts.")
        model, tokenizer, processor = self._load()
        b, f = samples.shape[:2]
        frames = samples.detach().cpu().reshape(b * f, *samples.shape[2:]).numpy()
        image_emb = []
        for i in range(0, len(frames), self.batch_size):
            pixels = processor(images=list(frames[i : i + self.batch_size]), return_tensors="pt")
            feats = model.get_image_features(pixel_values=pixels["pixel_values"].to(self.device))
            image_emb.append(_unit(feats))
        text = tokenizer(
            list(prompts),
            padding=True,
            truncation=True,
            max_length=model.config.text_config.max_position_embeddings,
            return_tensors="pt",
        ).to(self.device)
        text_emb = _unit(model.get_text_features(**text))  # [B, D]
        cos = (torch.cat(image_emb).view(b, f, -1) * text_emb[:, None]).sum(-1)  # [B, F]
        if self.clip_negative:
            cos = cos.clamp(min=0.0)
        return (self.scale * cos.mean(dim=1)).float().cpu().tolist()


def _unit(x: Any) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):  # newer transformers return a model output
        x = x.pooler_output
    return torch.nn.functional.normalize(x.float(), dim=-1)
