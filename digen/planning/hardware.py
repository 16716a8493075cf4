"""What a GPU layout costs beyond the tasks themselves: bytes moved over links, and memory.

A profile times each task on one device (:class:`~digen.sched.costs.Costs`). On a cluster a
layout also pays for moving weights, and which layouts are possible at all depends on what
fits in a device's memory. This module states those costs as explicit terms, each a small
formula over a :class:`Device` description and a :class:`ModelSize`, so the planner
(:mod:`digen.planning.layouts`) can add them to the measured task costs and anyone can check
them by hand:

- :func:`allgather_s`: a ring all-gather of ``n`` bytes over ``D`` devices moves
  ``n (D - 1) / D`` bytes into each device, over its link: ``n (D - 1) / (D x link)``;
- :func:`allreduce_s`: reduce-scatter then all-gather, twice that;
- :func:`sharded_sampling_s`: sampling with FSDP-sharded weights gathers every block at
  every forward pass: ``passes x blocks x allgather(block bytes)``; FSDP gathers the next
  block while the current one computes, so what the sampler waits for is
  ``max(compute, gathers)`` (:func:`overlapped`);
- :func:`fsdp_update_s`: one sharded update gathers the weights for the forward and again
  for the backward and reduce-scatters the trained parameters' gradients;
- :func:`offload_reload_s`: a phase switch that does not fit moves ``n`` bytes to host
  memory and back: ``2 n / host``;
- :func:`weight_sync_s`: new weights sent to the generators: ``n / link`` plus a fixed
  latency per bucket of ``bucket_mb`` (the runtime sends weights in buckets);
- memory: :func:`train_state_bytes` (bf16 weights and gradients, fp32 master copy and two
  Adam moments for what is trained: 16 bytes a trained parameter, 2 a frozen one),
  :func:`sampling_copy_bytes`, :func:`activation_bytes` (what a training pass keeps for its
  backward, with or without per-block checkpointing, when the model's token count is
  known), and :meth:`Device.fits`.

Device figures come from a hardware description (:func:`load_hardware`: a YAML or JSON file,
or a dict). Kinds in :data:`DEVICE_DEFAULTS` carry spec-sheet figures, marked as defaults
(``Device.default``): links and host bandwidths are the bus's nominal one-direction rate,
speed ratios between kinds follow dense bf16 throughput. A profile of each kind, or a stated
``speed``, should replace them where it matters.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from digen.errors import DigenError
from digen.registry.models import get_backbone

__all__ = [
    "ACTIVATION_BYTES",
    "DEVICE_DEFAULTS",
    "FROZEN_BYTES",
    "GB",
    "GRAD_BYTES",
    "Device",
    "Hardware",
    "ModelSize",
    "RECOMPUTE",
    "SAMPLING_BYTES",
    "activation_bytes",
    "allgather_s",
    "allreduce_s",
    "describe",
    "fsdp_update_s",
    "load_hardware",
    "offload_reload_s",
    "overlapped",
    "reward_bytes",
    "sampling_copy_bytes",
    "sample_tokens",
    "sampling_activation_bytes",
    "sharded_sampling_s",
    "TRAINED_BYTES",
    "train_state_bytes",
    "weakest",
    "ulysses_s",
    "weight_sync_s",
]

GB = 1e9
"""Bytes in a GB: bandwidths are GB/s, memory GB, both decimal as spec sheets give them."""

TRAINED_BYTES = 16
"""Bytes a trained parameter holds while training: bf16 weight (2) and gradient (2), fp32
master weight (4) and Adam's two moments (4 + 4)."""
FROZEN_BYTES = 2
"""Bytes a frozen parameter holds: its bf16 weight."""
GRAD_BYTES = 4
"""Bytes a gradient is reduced in (fp32)."""


def _number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _positive(x: object) -> bool:
    return _number(x) and x > 0  # type: ignore[operator]


@dataclass(frozen=True, kw_only=True, slots=True)
class Device:
    """One kind of accelerator, as the planner needs it."""

    kind: str
    """A name (``h100``); the pool's workers are billed and sped as this kind."""
    memory_gb: float
    """Device memory."""
    link_gb_s: float
    """Bandwidth to another device of its pool, one direction (NVLink, or PCIe / network)."""
    host_gb_s: float
    """Bandwidth between the device and host memory, one direction (PCIe)."""
    tflops: float
    """Dense bf16 throughput: the default speed ratio between kinds."""
    price_h: float = 0.0
    """Price per device-hour (any currency; 0: not priced)."""
    speed: float | None = None
    """Speed relative to the device the costs were measured on, when stated; None: from
    ``gen_s`` when both kinds have one, else the ratio of ``tflops``."""
    gen_s: float | None = None
    """Seconds this kind took to generate one micro-batch in a profile (``profile:`` in a
    hardware file reads it from a run's ``profile.json``): two kinds' ``gen_s`` give their
    measured speed ratio."""
    reserve_gb: float = 10.0
    """Memory kept for activations, the sampler's latents and workspace."""
    default: bool = False
    """The figures are :data:`DEVICE_DEFAULTS`' spec-sheet values, not stated or measured."""

    def __post_init__(self) -> None:
        for name in ("memory_gb", "link_gb_s", "host_gb_s", "tflops"):
            value = getattr(self, name)
            if not _positive(value):
                raise DigenError(f"{self.kind}: {name} must be a number > 0, got {value!r}")
        if not _number(self.price_h) or self.price_h < 0:
            raise DigenError(f"{self.kind}: price_h must be a number >= 0, got {self.price_h!r}")
        for name in ("speed", "gen_s"):
            value = getattr(self, name)
            if value is not None and not _positive(value):
                raise DigenError(f"{self.kind}: {name} must be a number > 0, got {value!r}")
        if not _number(self.reserve_gb) or not 0 <= self.reserve_gb < self.memory_gb:
            raise DigenError(
                f"{self.kind}: reserve_gb must be from 0 to memory_gb, got {self.reserve_gb!r}"
            )

    def fits(self, nbytes: float) -> bool:
        """Whether ``nbytes`` fit beside the reserve."""
        return nbytes + self.reserve_gb * GB <= self.memory_gb * GB


DEVICE_DEFAULTS: dict[str, Device] = {
    d.kind: d
    for d in (
        # SXM parts: NVLink 4 (900 GB/s both ways) or 3 (600), PCIe Gen5 / Gen4 x16 to the host
        Device(kind="h200", memory_gb=141, link_gb_s=450, host_gb_s=64, tflops=989, default=True),
        Device(kind="h100", memory_gb=80, link_gb_s=450, host_gb_s=64, tflops=989, default=True),
        Device(kind="a100", memory_gb=80, link_gb_s=300, host_gb_s=32, tflops=312, default=True),
        Device(
            kind="a100-40gb", memory_gb=40, link_gb_s=300, host_gb_s=32, tflops=312, default=True
        ),
        # inference-class PCIe cards: no NVLink, device to device over PCIe Gen4 x16
        Device(kind="l40s", memory_gb=48, link_gb_s=32, host_gb_s=32, tflops=362, default=True),
        Device(kind="l4", memory_gb=24, link_gb_s=32, host_gb_s=32, tflops=121, default=True),
    )
}
"""Spec-sheet figures of common GPUs, labelled defaults (``Device.default``)."""


# -- the model's sizes ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSize:
    """The sizes of what a run moves and stores: the denoiser, its adapter, the reward model."""

    params: float
    """Denoiser parameters."""
    blocks: int
    """Transformer blocks (a sharded model is gathered a block at a time)."""
    trained: float
    """Parameters trained: all of them, or the LoRA adapter's."""
    reward_params: float = 0.0
    """Parameters of the reward model, resident where scoring runs (0: a rule or a server)."""
    name: str = ""
    hidden: int = 0
    """Width of a block (its hidden size)."""
    tokens: int = 0
    """Tokens one sample's denoiser pass attends over (latent patches and text); 0: not
    known, and activation memory is left to ``Device.reserve_gb``."""

    @classmethod
    def of(
        cls, model: str, *, lora_rank: int = 0, reward_params: float = 0.0, tokens: int = 0
    ) -> ModelSize:
        """The published sizes of backbone ``model`` (:mod:`digen.registry.models`).

        With ``lora_rank`` r > 0 the trained parameters are an estimate: rank-r adapters on
        the four attention projections (q, k, v, out) of every block, ``blocks x 4 x 2 x
        hidden x r``. ``tokens``: a sample's sequence length, for activation memory.
        """
        b = get_backbone(model)
        if not b.params:
            raise DigenError(f"the registry has no published size for model '{model}'")
        trained = b.params if lora_rank <= 0 else float(b.blocks * 4 * 2 * b.hidden * lora_rank)
        return cls(
            params=b.params,
            blocks=b.blocks,
            trained=trained,
            reward_params=reward_params,
            name=model,
            hidden=b.hidden,
            tokens=tokens,
        )

    @property
    def lora(self) -> bool:
        return self.trained < self.params


def sample_tokens(height: int, width: int, frames: int | None = None, text: int = 0) -> int:
    """The tokens one sample's denoiser pass attends over, as the five backbones make them:
    16 pixels a token each way (an 8x VAE, 2x2 patches), a quarter of the frames plus the
    first for video, and the prompt's ``text`` tokens."""
    tokens = (height // 16) * (width // 16)
    if frames and frames > 1:
        tokens *= (frames - 1) // 4 + 1
    return tokens + text


def train_state_bytes(model: ModelSize, shards: int = 1) -> float:
    """Bytes of training state on one of ``shards`` devices that shard it (FSDP): frozen
    weights at :data:`FROZEN_BYTES`, trained ones at :data:`TRAINED_BYTES`."""
    frozen = model.params - model.trained if model.lora else 0.0
    return (frozen * FROZEN_BYTES + model.trained * TRAINED_BYTES) / shards


def sampling_copy_bytes(model: ModelSize) -> float:
    """Bytes of a full bf16 copy of the denoiser, as a sampler holds it (adapter included)."""
    extra = model.trained if model.lora else 0.0
    return (model.params + extra) * FROZEN_BYTES


def reward_bytes(model: ModelSize) -> float:
    """Bytes of the reward model in bf16."""
    return model.reward_params * FROZEN_BYTES


ACTIVATION_BYTES = 34
"""Bytes a transformer block keeps for its backward per token and hidden unit, in bf16 with
attention by a fused kernel (no score matrix kept): the estimate of Korthikanti et al.,
"Reducing Activation Recomputation in Large Transformer Models" (34 s b h a layer), which a
DiT block (attention and a 4x MLP, with its modulation) is close to."""

RECOMPUTE = 4 / 3
"""What per-block checkpointing multiplies an update's compute by: every block's forward
runs again in the backward (a forward is about a third of a forward and backward)."""


SAMPLING_BYTES = 24
"""Bytes a block holds per token and hidden unit at its peak in a sampling (gradient-free)
forward pass, bf16, one block at a time: its input and residual stream, q, k, v and the
attention's output, and the MLP's 4x-wide hidden (2 bytes x about 12)."""


def activation_bytes(model: ModelSize, rows: int, *, checkpointing: bool, degree: int = 1) -> float:
    """Bytes of activations one training forward/backward pass of ``rows`` rows keeps on a
    device (rows: the pass's terms, samples x TSP degree; a row is ``model.tokens`` long,
    ``1 / degree`` of it on each device of a sequence-parallel group): every block's
    (``rows x tokens x hidden x blocks x`` :data:`ACTIVATION_BYTES`), or with per-block
    checkpointing each block's input in bf16 and one block's whole while it is
    recomputed. 0 when the token count is not known."""
    per_block = rows * -(-model.tokens // degree) * model.hidden
    if checkpointing:
        return per_block * (model.blocks * FROZEN_BYTES + ACTIVATION_BYTES)
    return per_block * model.blocks * ACTIVATION_BYTES


def sampling_activation_bytes(model: ModelSize, rows: int, degree: int = 1) -> float:
    """Bytes one sampling pass of ``rows`` rows holds at its peak on a device of a
    sequence-parallel group of ``degree`` (:data:`SAMPLING_BYTES`); 0 with tokens unknown."""
    return rows * -(-model.tokens // degree) * model.hidden * SAMPLING_BYTES


# -- the terms ------------------------------------------------------------------------------


def allgather_s(nbytes: float, devices: int, link_gb_s: float) -> float:
    """Seconds of a ring all-gather of ``nbytes`` (the whole, gathered) over ``devices``."""
    if devices <= 1:
        return 0.0
    return nbytes * (devices - 1) / devices / (link_gb_s * GB)


def allreduce_s(nbytes: float, devices: int, link_gb_s: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes``: a reduce-scatter and an all-gather."""
    return 2 * allgather_s(nbytes, devices, link_gb_s)


def sharded_sampling_s(model: ModelSize, devices: int, link_gb_s: float, passes: int) -> float:
    """Seconds of gathers to sample one micro-batch with weights sharded over ``devices``:
    each of ``passes`` forward passes gathers every block (bf16)."""
    block = model.params * FROZEN_BYTES / model.blocks
    return passes * model.blocks * allgather_s(block, devices, link_gb_s)


def fsdp_update_s(model: ModelSize, devices: int, link_gb_s: float) -> float:
    """Seconds of communication in one sharded update: the weights gathered for the forward
    and for the backward (bf16), and the trained parameters' gradients reduce-scattered
    (fp32; a reduce-scatter moves what an all-gather does)."""
    weights = model.params * FROZEN_BYTES
    return 2 * allgather_s(weights, devices, link_gb_s) + allgather_s(
        model.trained * GRAD_BYTES, devices, link_gb_s
    )


def ulysses_s(
    model: ModelSize,
    rows: int,
    degree: int,
    link_gb_s: float,
    *,
    backward: bool = False,
    latency_s: float = 0.0,
    value_bytes: float = FROZEN_BYTES,
) -> float:
    """Seconds of one pass's all-to-alls on a device of a sequence-parallel group of
    ``degree`` (Ulysses): every block's attention trades its q, k and v for a share of the
    heads over all tokens and trades the output back, four all-to-alls of the device's
    ``rows x tokens / degree x hidden`` values (bf16: ``value_bytes``), each sending
    ``(degree - 1) / degree`` of them and paying ``latency_s``. A backward pass trades as
    many gradients again."""
    if degree <= 1:
        return 0.0
    local = rows * -(-model.tokens // degree) * model.hidden * value_bytes
    moved = local * (degree - 1) / degree / (link_gb_s * GB)
    per_pass = model.blocks * 4 * (moved + latency_s)
    return per_pass * (2 if backward else 1)


def overlapped(compute_s: float, comm_s: float) -> float:
    """Compute and communication that prefetching runs side by side: the longer of the two."""
    return max(compute_s, comm_s)


def offload_reload_s(nbytes: float, host_gb_s: float) -> float:
    """Seconds to move ``nbytes`` to host memory and back (a phase switch that does not fit)."""
    return 2 * nbytes / (host_gb_s * GB)


def weight_sync_s(
    nbytes: float, link_gb_s: float, *, bucket_mb: float = 256.0, latency_s: float = 1e-3
) -> float:
    """Seconds to send ``nbytes`` of new weights: over the link, plus ``latency_s`` for each
    bucket of ``bucket_mb`` (a broadcast tree or ring pipelines the buckets, so the bytes
    cross each link once)."""
    if nbytes <= 0:
        return 0.0
    buckets = math.ceil(nbytes / (bucket_mb * 1e6))
    return nbytes / (link_gb_s * GB) + buckets * latency_s


# -- the hardware description ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
    """The devices of the two pools and how they are linked."""

    generator: Device
    trainer: Device
    generators: int | None = None
    """Devices in the generator pool when it is a fixed set (different kinds); None: any
    split of ``--devices``."""
    trainers: int | None = None
    profiled: Device | None = None
    """The device the costs were measured on; None: the trainer's kind."""
    cross_gb_s: float | None = None
    """Bandwidth between the pools; None: the slower of the two pools' links."""
    bucket_mb: float = 256.0
    """Weight-sync bucket size."""
    sync_latency_s: float = 1e-3
    """Fixed cost of one weight-sync bucket."""

    def __post_init__(self) -> None:
        if (self.generators is None) != (self.trainers is None):
            raise DigenError("give both pools a count, or neither")
        for name in ("generators", "trainers"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise DigenError(f"{name} must be an integer >= 1, got {n!r}")
        if self.cross_gb_s is not None and not _positive(self.cross_gb_s):
            raise DigenError(f"cross_gb_s must be a number > 0, got {self.cross_gb_s!r}")

    @property
    def homogeneous(self) -> bool:
        return self.generator == self.trainer

    @property
    def cross_link_gb_s(self) -> float:
        if self.cross_gb_s is not None:
            return self.cross_gb_s
        return min(self.generator.link_gb_s, self.trainer.link_gb_s)

    def speed(self, device: Device) -> float:
        """``device``'s speed relative to the device the costs were measured on."""
        if device.speed is not None:
            return device.speed
        base = self.profiled or self.trainer
        if device.gen_s is not None and base.gen_s is not None:
            return base.gen_s / device.gen_s
        return device.tflops / base.tflops

    @property
    def defaults_used(self) -> list[str]:
        """The kinds whose figures are spec-sheet defaults."""
        kinds = {d.kind: d for d in (self.generator, self.trainer, self.profiled) if d}
        return sorted(k for k, d in kinds.items() if d.default)


_DEVICE_KEYS = {f.name for f in dataclasses.fields(Device)} - {"default"}
_POOL_KEYS = _DEVICE_KEYS | {"count", "profile"}
_TOP_KEYS = {"device", "generator", "trainer", "profiled", "cross_gb_s", "bucket_mb"}
_TOP_KEYS |= {"sync_latency_s", "devices"}


def _known(spec: Mapping[str, Any], allowed: set[str], where: str) -> None:
    """One sentence naming the keys of ``spec`` that are not ``allowed`` (a typo is not
    silently ignored)."""
    extra = set(spec) - allowed
    if extra:
        raise DigenError(
            f"{where} has unknown key(s) {', '.join(sorted(extra))}; "
            f"expected some of {', '.join(sorted(allowed))}"
        )


def _device(spec: Any, where: str) -> tuple[Device, int | None]:
    if isinstance(spec, str):
        spec = {"kind": spec}
    if not isinstance(spec, Mapping):
        raise DigenError(f"{where} must be a device kind or a mapping, got {spec!r}")
    _known(spec, _POOL_KEYS, where)
    kind = spec.get("kind")
    if not isinstance(kind, str) or not kind:
        raise DigenError(f"{where} needs a kind (e.g. h100)")
    given = {k: v for k, v in spec.items() if k not in ("kind", "count", "profile")}
    if spec.get("profile") is not None:
        from digen.planning.simulate import load_costs

        given["gen_s"] = load_costs(spec["profile"]).gen
    base = DEVICE_DEFAULTS.get(kind.lower())
    if base is None:
        missing = {"memory_gb", "link_gb_s", "host_gb_s", "tflops"} - set(given)
        if missing:
            raise DigenError(
                f"{where}: '{kind}' is not a known kind ({', '.join(DEVICE_DEFAULTS)}); "
                f"give its {', '.join(sorted(missing))}"
            )
        device = Device(kind=kind, **given)
    else:
        # stated figures replace the defaults; the device stays marked default only if its
        # spec-sheet figures (memory, links, throughput) are all still the table's
        stated = {"memory_gb", "link_gb_s", "host_gb_s", "tflops"} & set(given)
        measured = "speed" in given or "gen_s" in given
        device = dataclasses.replace(base, **given, default=not stated and not measured)
    count = spec.get("count")
    return device, count


def load_hardware(source: Hardware | Mapping[str, Any] | str | os.PathLike[str]) -> Hardware:
    """A :class:`Hardware` from a mapping or a YAML / JSON file.

    ``device: h100`` gives both pools one kind; ``generator:`` and ``trainer:`` give each its
    own (a kind, or a mapping with ``kind``, any :class:`Device` field to override its
    figures, ``count``, and ``profile``: a run's ``profile.json`` on that kind, whose
    generation time sets ``gen_s``). ``profiled:`` names the kind the costs were measured on;
    ``cross_gb_s``, ``bucket_mb`` and ``sync_latency_s`` set the links between the pools.
    """
    if isinstance(source, Hardware):
        return source
    if not isinstance(source, Mapping):
        path = Path(source)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise DigenError(f"hardware file {str(path)!r} does not exist") from None
        try:
            import yaml

            data = yaml.safe_load(text)
        except Exception as exc:  # yaml's errors are several classes
            raise DigenError(f"hardware file {str(path)!r} is not YAML or JSON ({exc})") from None
        if not isinstance(data, Mapping):
            raise DigenError(f"hardware file {str(path)!r} holds no mapping")
        source = data
    _known(source, _TOP_KEYS, "the hardware description")
    both = source.get("device")
    if both is not None and ("generator" in source or "trainer" in source):
        raise DigenError("give the hardware either device (both pools) or generator and trainer")
    if both is None and not ("generator" in source and "trainer" in source):
        raise DigenError("the hardware description needs device, or generator and trainer")
    gen, g = _device(both if both is not None else source["generator"], "generator")
    tr, t = _device(both if both is not None else source["trainer"], "trainer")
    profiled = None
    if source.get("profiled") is not None:
        profiled, _ = _device(source["profiled"], "profiled")
    kw = {k: source[k] for k in ("cross_gb_s", "bucket_mb", "sync_latency_s") if k in source}
    return Hardware(generator=gen, trainer=tr, generators=g, trainers=t, profiled=profiled, **kw)


def weakest(a: Device, b: Device) -> Device:
    """One device as slow, small and poorly linked as the weaker of ``a`` and ``b`` in each
    figure: what a data-parallel layout over both kinds runs at (its phases wait for the
    slowest member, and every member must hold the same state)."""
    if a == b:
        return a
    return Device(
        kind=f"{a.kind}+{b.kind}",
        memory_gb=min(a.memory_gb, b.memory_gb),
        link_gb_s=min(a.link_gb_s, b.link_gb_s),
        host_gb_s=min(a.host_gb_s, b.host_gb_s),
        tflops=min(a.tflops, b.tflops),
        speed=None if a.speed is None or b.speed is None else min(a.speed, b.speed),
        reserve_gb=max(a.reserve_gb, b.reserve_gb),
        default=a.default and b.default,
    )


def describe(hw: Hardware) -> str:
    """One line: the pools' kinds and which figures are defaults."""
    pools = (
        hw.trainer.kind
        if hw.homogeneous
        else f"generators on {hw.generator.kind}, trainers on {hw.trainer.kind}"
    )
    defaults = hw.defaults_used
    note = f" ({', '.join(defaults)}: spec-sheet defaults)" if defaults else ""
    return f"{pools}{note}"
