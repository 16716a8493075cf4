"""What a backbone tells the runtime so that one sample's work can be split over devices.

Models are single-device code: nothing here communicates. A backbone describes, as data,
where its transformer's token sequence may be cut (:class:`SequencePlan`, read by the
runtime's sequence parallelism), and :class:`GuidanceBranch` is the one thing an adapter
calls when the runtime has put the two branches of classifier-free guidance on two devices.

Sequence parallelism (Ulysses) keeps ``1 / k`` of every stream's tokens on each of ``k``
devices through every token-wise layer (projections, MLPs, norms, modulation). Attention
alone needs the whole sequence: there an all-to-all trades the sequence split for a split of
the attention heads, each device attends over every token with its share of the heads, and a
second all-to-all trades back. A backbone's plan says three things: which inputs of which
modules carry tokens (and of which stream: the image's or the text's), which module's output
holds the finished image tokens to gather, and which attention modules attend over the split
sequence (cross-attention to an unsplit text does not).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

__all__ = ["STREAMS", "Cut", "GuidanceBranch", "SequencePlan"]

#: the token streams a plan may cut: the latent's tokens and the prompt's
STREAMS = ("image", "text")


@dataclass(frozen=True, slots=True)
class Cut:
    """A tensor with a token axis: ``dim`` holds the tokens of ``streams``, one after the
    other in that order (a joint attention mask over image then text tokens is
    ``Cut(("image", "text"), 3)``). Each stream is cut into ``k`` contiguous pieces, the
    first ``n % k`` one token longer; a device keeps its piece of every stream, in order.

    ``ndim``: cut only a tensor of this many dimensions (None: any); another is left whole
    (Wan 2.2's per-token timesteps are cut, Wan 2.1's per-sample ones are not)."""

    streams: tuple[str, ...]
    dim: int
    ndim: int | None = None

    def __post_init__(self) -> None:
        unknown = [s for s in self.streams if s not in STREAMS]
        if not self.streams or unknown:
            raise ValueError(f"a cut's streams are some of {STREAMS}, not {self.streams}")


@dataclass(frozen=True, slots=True)
class SequencePlan:
    """Where a backbone's transformer is cut along its tokens.

    Module paths are patterns over the transformer's ``named_modules`` names, matched name
    by name (``*`` stands for any one name, so ``transformer_blocks.*`` is every block and
    none of their submodules); ``""`` is the transformer itself.
    """

    #: module path -> {argument name -> cut}: inputs cut before the module runs. A stream's
    #: length is read from the first whole tensor of it that is cut in a forward pass.
    inputs: Mapping[str, Mapping[str, Cut]] = field(default_factory=dict)
    #: module path -> {output index -> cut}: outputs cut after the module runs (rotary
    #: tables the model makes for the whole sequence)
    outputs: Mapping[str, Mapping[int, Cut]] = field(default_factory=dict)
    #: the module whose output ``[B, S_image_local, C]`` is gathered back into ``[B, S, C]``:
    #: the last token-wise layer (the output projection)
    gather: str = "proj_out"
    #: attention modules whose attention spans the cut sequence (self- and joint attention)
    attention: tuple[str, ...] = ()


class GuidanceBranch(Protocol):
    """One of the two devices that share classifier-free guidance: this device runs one
    branch (``index`` 0: the prompt, 1: the negative prompt) on the whole batch, and
    :meth:`exchange` swaps its velocity for the other's."""

    @property
    def index(self) -> int: ...

    def exchange(self, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``mine [B, ...]`` -> ``(v_pos, v_neg)``, the same on both devices."""
        ...
