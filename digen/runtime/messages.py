"""The small types that cross between processes: what the driver sends a worker and what a
worker sends back. Torch-light on purpose (torch, never diffusers or peft), so the driver
process, which holds no model, can import them (``tests/sched/test_torch_free.py`` checks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from digen.algos.rollout import Rollout

__all__ = [
    "THUMBNAIL_SIDE",
    "EvalRequest",
    "EvalScores",
    "GenerateRequest",
    "LossStats",
    "SampleKey",
    "ScoreRequest",
    "Scores",
    "StepRequest",
    "StepResult",
    "TimedResult",
    "TrainItem",
    "UpdateRequest",
    "grid_frames",
    "thumbnails",
]


@dataclass(frozen=True, slots=True, order=True)
class SampleKey:
    """Identity of one sample: train step, prompt position in the step, sample in the group."""

    step: int
    prompt: int
    sample: int


# --- requests: what the driver asks a worker to do (one type per call that runs the model)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """Make micro-batch ``(step, mb)``: one trajectory per key, all of ``prompt``, with the
    worker's current weights, kept in its store (a generator, or a trainer for TAG)."""

    step: int
    mb: int
    keys: tuple[SampleKey, ...]
    prompt: str
    keep_pixels: bool = True
    """False: the rollout only, for a micro-batch already scored (made again for training)."""
    ahead: tuple[str, ...] = ()
    """The prompts the worker may sample next (the train step's): offloaded text encoders
    encode them in this call's visit to the device."""


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """Score micro-batch ``(step, mb)``, whose pixels ``holder`` keeps."""

    step: int
    mb: int
    holder: str
    prompts: tuple[str, ...]
    metadata: tuple[dict, ...]
    thumbnails: bool = False
    """Bring back small copies of the samples, for the step's sample grid."""


@dataclass(frozen=True, slots=True)
class UpdateRequest:
    """Forward/backward the samples ``keys`` of micro-batch ``(step, mb)`` into the gradients.

    ``rows``: their positions in the micro-batch, whose rollout ``holder`` keeps;
    ``advantages``: one per key; ``loss_scale``: what each term's loss is multiplied by (one
    over its optimizer step's terms); ``made_by``: the policy version that sampled them
    (behind the trainer's for a stale micro-batch; None: the trainer's own)."""

    step: int
    mb: int
    holder: str
    keys: tuple[SampleKey, ...]
    rows: tuple[int, ...]
    prompt: str
    advantages: tuple[float, ...]
    loss_scale: float
    made_by: int | None = None


@dataclass(frozen=True, slots=True)
class StepRequest:
    """Sum the gradients of ``microbatches`` over the trainers, clip and step; ``last``: the
    train step's last optimizer step, which moves the version."""

    microbatches: range
    last: bool = True


@dataclass(frozen=True, slots=True)
class EvalRequest:
    """Evaluation batch ``batch``: ``keys`` are ``(prompt, sample)`` pairs, ``prompts`` their
    texts (one per key) and ``metadata`` what the rewards read of each."""

    batch: int
    keys: tuple[tuple[int, int], ...]
    prompts: tuple[str, ...]
    metadata: tuple[dict, ...] = ()


# --- replies and records


@dataclass(slots=True)
class StepResult:
    """One finished train step, as the runner writes it out."""

    metrics: dict[str, Any]
    pixels: torch.Tensor | None
    """Samples of the step for its grid, ``uint8 [B, F, H, W, 3]`` (this worker's share when
    data-parallel; thumbnails in a disaggregated run); None when the step keeps none."""
    captions: list[str]


@dataclass(slots=True)
class TrainItem:
    """The samples of one update call: trajectories, prompts and advantages (rows aligned)."""

    keys: list[SampleKey]
    prompts: list[str]
    rollout: Rollout
    advantages: torch.Tensor
    """``[B]`` fp32."""
    version: int | None = None
    """The policy version that sampled them (behind the trainer's for a stale micro-batch);
    None: the trainer's own."""


@dataclass(slots=True)
class LossStats:
    """Sums over (sample, trained timestep) terms; divide by ``terms`` for means."""

    terms: int = 0
    loss: float = 0.0
    kl: float = 0.0
    clip_fraction: float = 0.0
    approx_kl: float = 0.0
    dropped: int = 0
    """Loss chunks left out for a non-finite loss (``train.on_nonfinite = drop``)."""
    drift_terms: int = 0
    """Terms trained with the weights that sampled them, whose log-prob drift is measured."""
    drift: float = 0.0
    """The sum of their ``|logp - logp recorded|``."""
    drift_max: float = 0.0
    """The largest of them (combined by max, not by sum)."""
    drift_over: int = 0
    """How many of them drift further than rounding allows
    (:func:`~digen.algos.rollout.logprob_drift_bound`)."""
    extra: dict[str, float] = field(default_factory=dict)

    def add(self, other: LossStats) -> None:
        self.dropped += other.dropped
        self.terms += other.terms
        self.loss += other.loss
        self.kl += other.kl
        self.clip_fraction += other.clip_fraction
        self.approx_kl += other.approx_kl
        self.drift_terms += other.drift_terms
        self.drift += other.drift
        self.drift_max = max(self.drift_max, other.drift_max)
        self.drift_over += other.drift_over

    def as_tensor(self) -> torch.Tensor:
        """The fields that add up, for an all-reduce (sum); :attr:`drift_max` takes a max."""
        return torch.tensor(
            [
                self.terms,
                self.loss,
                self.kl,
                self.clip_fraction,
                self.approx_kl,
                self.dropped,
                self.drift_terms,
                self.drift,
                self.drift_over,
            ],
            dtype=torch.float64,
        )

    @classmethod
    def from_tensor(cls, t: torch.Tensor, drift_max: float = 0.0) -> LossStats:
        terms, loss, kl, clip, akl, dropped, d_terms, drift, over = t.tolist()
        return cls(
            int(terms), loss, kl, clip, akl, int(dropped), int(d_terms), drift, drift_max, int(over)
        )

    def means(self) -> dict[str, float]:
        n = max(self.terms, 1)
        row = {
            "loss": self.loss / n,
            "kl": self.kl / n,
            "clip_fraction": self.clip_fraction / n,
            "approx_kl": self.approx_kl / n,
            "dropped_microbatches": self.dropped,
        }
        if self.drift_terms:
            row["train/logprob_drift_max"] = self.drift_max
            row["train/logprob_drift_mean"] = self.drift / self.drift_terms
            row["train/logprob_drift_over"] = self.drift_over
        return row


@dataclass(slots=True)
class TimedResult:
    """A result with the span of the work that made it."""

    value: Any
    t0: float
    t1: float
    memory_gb: float = 0.0
    """Peak memory of the worker so far: device memory on a GPU, resident size on the CPU."""


@dataclass(slots=True)
class Scores:
    """Rewards of one micro-batch's samples, in sample order (plain floats: a few bytes)."""

    total: list[float]
    components: dict[str, list[float]]
    latency_s: dict[str, float] = field(default_factory=dict)
    """Seconds each reward's call took."""
    thumbnails: torch.Tensor | None = None
    """Small copies of the samples for the run's sample grid, when asked for."""


@dataclass(slots=True)
class EvalScores:
    """Evaluation images of one batch, scored (plain floats, and thumbnails for the grid)."""

    total: list[float]
    components: dict[str, list[float]]
    """Each configured reward's raw scores."""
    passed: list[float] | None
    """Each image judged against its prompt (:func:`digen.rewards.judge.judge`): 1.0 when it
    meets every requirement, else 0.0; None where the prompts have no rule."""
    groups: list[str] | None
    """Each prompt's group for the judge's overall score (GenEval's category), beside
    ``passed``."""
    thumbnails: torch.Tensor


THUMBNAIL_SIDE = 64
"""Longest side of the thumbnails a disaggregated run brings back for its sample grids."""


def grid_frames(frames: int) -> list[int]:
    """The frames a sample grid shows of a video: first, middle and last."""
    return [0] if frames == 1 else sorted({0, frames // 2, frames - 1})


def thumbnails(pixels: torch.Tensor, max_side: int = THUMBNAIL_SIDE) -> torch.Tensor:
    """Small copies of decoded samples for sample grids: the grid's frames, area-downscaled.

    pixels: ``uint8 [B, F, H, W, 3]`` -> ``uint8 [B, F', h, w, 3]`` with ``max(h, w) <=
    max_side`` and ``F'`` the frames a sample grid shows (:func:`grid_frames`), so what
    crosses the network for a grid does not grow with the image size.
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
