"""Run configuration: dataclasses with their checks, loaded from YAML plus dotted overrides.

Every field has a docstring comment; every bad value fails at load time with one sentence
naming the key, the value and what is allowed (a :class:`digen.errors.ConfigError`).

Precedence when loading, lowest first: the dataclass defaults, a ``preset`` mapping, the YAML
file, the ``base`` mapping (what the CLI's own flags set), then the ``key=value`` overrides.
"""

from __future__ import annotations

import copy
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum, StrEnum
from pathlib import Path
from typing import Any, Literal, get_args

import yaml

from digen.errors import ConfigError
from digen.registry.algos import ALGO_NAMES, SDE_TYPES, get_algorithm
from digen.registry.models import BACKBONES, FLAVOURS, MODEL_NAMES
from digen.registry.rewards import BUILTIN_REWARDS
from digen.registry.trackers import TRACKERS
from digen.sched.admission import StalenessSchedule
from digen.sched.plan import SchedulePlan, plan_schedule
from digen.sched.tag import TagPolicyName

__all__ = [
    "AlgoConfig",
    "ConfigError",
    "DataConfig",
    "DigenConfig",
    "ElasticConfig",
    "EvalConfig",
    "ModelConfig",
    "PlacementConfig",
    "RewardSpec",
    "RolloutConfig",
    "RuntimeConfig",
    "ScheduleConfig",
    "TrainConfig",
    "TransportConfig",
    "config_to_dict",
    "dump_config",
    "field_docs",
    "knobs_table",
    "load_config",
    "validate",
]

_DEVICE_RE = re.compile(r"cpu|meta|cuda(:\d+)?|mps|xpu(:\d+)?")
LORA_INITS = (
    "gaussian", "true", "false", "eva", "olora", "pissa", "pissa_niter_<n>", "corda", "loftq",
    "orthogonal",
)  # fmt: skip
"""``train.lora_init``: peft's ``init_lora_weights`` (true: its default Kaiming-uniform A)."""
_LORA_INIT_RE = re.compile("|".join(v.replace("<n>", r"\d+") for v in LORA_INITS))


# --------------------------------------------------------------------------- choices
# A setting with a fixed set of values is a StrEnum: the loader turns the user's string into
# its member, and a member equals (and prints as) its plain string.


class Dtype(StrEnum):
    """A weights dtype: ``model.dtype``, ``train.lora_dtype``, ``runtime.placement.*_dtype``."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class CpsLogprob(StrEnum):
    """``rollout.cps_logprob``."""

    PUBLISHED = "published"
    GAUSSIAN = "gaussian"


class Solver(StrEnum):
    """``rollout.solver``."""

    EULER = "euler"
    DPM2 = "dpm2"
    DPM2_POST = "dpm2-post"


class TimeInput(StrEnum):
    """``rollout.time_input``."""

    SIGMA = "sigma"
    INT1000 = "int1000"


class AdvNorm(StrEnum):
    """``algo.adv_norm``."""

    GROUP = "group"
    NONE = "none"


class AdvStd(StrEnum):
    """``algo.adv_std``."""

    GROUP = "group"
    GLOBAL = "global"


class KlType(StrEnum):
    """``algo.kl_type``."""

    FLOWGRPO = "flowgrpo"
    EXACT = "exact"


class RewardWeighting(StrEnum):
    """``algo.reward_weighting``."""

    SUM = "sum"
    ADVANTAGE = "advantage"


class LrSchedule(StrEnum):
    """``train.lr_schedule``."""

    CONSTANT = "constant"
    COSINE = "cosine"


class NonfinitePolicy(StrEnum):
    """``train.on_nonfinite``."""

    FAIL = "fail"
    DROP = "drop"


class GradOrder(StrEnum):
    """``train.grad_order``."""

    AUTO = "auto"
    FIXED = "fixed"
    ARRIVAL = "arrival"


class RewardErrorPolicy(StrEnum):
    """``rewards.<i>.on_error``."""

    FAIL = "fail"
    DROP = "drop"


class Mode(StrEnum):
    """``runtime.mode``."""

    COLOCATED = "colocated"
    DISAGGREGATED = "disaggregated"


class TrainerParallel(StrEnum):
    """``runtime.placement.trainer_parallel``."""

    REPLICATE = "replicate"
    FSDP = "fsdp"
    HSDP = "hsdp"


class ShardDeal(StrEnum):
    """``runtime.placement.shard_deal``."""

    SAMPLES = "samples"
    TERMS = "terms"
    SEQUENCE = "sequence"


class TrainerSampling(StrEnum):
    """``runtime.placement.trainer_sampling``."""

    ROWS = "rows"
    SEQUENCE = "sequence"


SHARDED_PARALLEL = frozenset({TrainerParallel.FSDP, TrainerParallel.HSDP})
"""The ``runtime.placement.trainer_parallel`` values whose trainers shard one model (and
move as one)."""


class MicrobatchAxis(StrEnum):
    """``runtime.schedule.microbatch_axis``."""

    GENERATION = "generation"
    PROMPT = "prompt"


class WeightSync(StrEnum):
    """``runtime.transport.weight_sync``."""

    RPC = "rpc"
    BROADCAST = "broadcast"


class GeneratorLoss(StrEnum):
    """``runtime.elastic.on_generator_loss``."""

    CONTINUE = "continue"
    FAIL = "fail"


# Choices derived from the registries: the config types name them, and the loader checks them.
ModelName = Literal[MODEL_NAMES]  # type: ignore[valid-type]
AlgoName = Literal[ALGO_NAMES]  # type: ignore[valid-type]
SdeType = Literal[SDE_TYPES]  # type: ignore[valid-type]
Devices = list[str] | None
"""A pool's devices (the loader also takes one comma-separated string)."""


# --------------------------------------------------------------------------- messages


def _show(value: Any) -> str:
    """A value as the user would write it back (tuples print as lists)."""
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, tuple):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    if isinstance(value, list):
        return "[" + ", ".join(_show(v) for v in value) + "]"
    return repr(value)


def _bad(key: str, value: Any, allowed: str) -> ConfigError:
    """``<key> = <value> is not allowed: <allowed>.`` -- one sentence."""
    return ConfigError(f"{key} = {_show(value)} is not allowed: {allowed}.")


def _key(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _choice(key: str, value: str, options: Sequence[str]) -> None:
    if value not in options:
        raise _bad(key, value, "choose one of " + ", ".join(options))


# --------------------------------------------------------------------------- type coercion


def _as_int(value: Any, key: str) -> int:
    # bool is an int subclass, and 2.0 would hide a typo such as n: 2.5 elsewhere: ints only.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(key, value, "it must be an integer")
    return int(value)


def _as_float(value: Any, key: str) -> float:
    # PyYAML reads `1e-4` (no dot) as a string, so numeric strings are accepted here.
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise _bad(key, value, "it must be a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _bad(key, value, "it must be a number")
    value = float(value)
    if not math.isfinite(value):
        raise _bad(key, value, "it must be a finite number")
    return value


def _as_str(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise _bad(key, value, "it must be a string")
    return value


def _as_pair(value: Any, key: str) -> tuple[int, int]:
    if (
        not isinstance(value, list | tuple)
        or len(value) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in value)
    ):
        raise _bad(key, value, "it must be a pair of integers [lo, hi] or null")
    return (int(value[0]), int(value[1]))


def _as_device_list(value: Any, key: str) -> list[str]:
    if isinstance(value, str):  # the command line's cuda:0,cuda:1
        value = [part.strip() for part in value.split(",")]
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(v, str) for v in value)
    ):
        raise _bad(key, value, "it must be a list of devices such as [cuda:0, cuda:1], or null")
    return list(value)


def _as_str_list(value: Any, key: str) -> list[str]:
    if (
        not isinstance(value, list | tuple)
        or not value
        or any(not isinstance(v, str) or not v for v in value)
    ):
        raise _bad(key, value, "it must be a non-empty list of module names or null")
    return list(value)


def _as_bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise _bad(key, value, "it must be true or false")
    return value


def _optional(convert: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    def convert_optional(value: Any, key: str) -> Any:
        return None if value is None else convert(value, key)

    return convert_optional


def _as_mapping(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _bad(key, value, "it must be a mapping of settings")
    return dict(value)


def _member(choices: type[StrEnum], allowed: str = "") -> Callable[[Any, str], StrEnum]:
    """The converter of a setting whose values are ``choices``: the user's string becomes
    its member; anything else fails naming the values (or ``allowed``)."""

    def convert(value: Any, key: str) -> StrEnum:
        try:
            return choices(value)
        except (ValueError, TypeError):
            raise _bad(key, value, allowed or "choose one of " + ", ".join(choices)) from None

    return convert


def _one_of(choices: Any) -> Callable[[Any, str], str]:
    options = get_args(choices)

    def convert(value: Any, key: str) -> str:
        if value not in options:
            raise _bad(key, value, "choose one of " + ", ".join(options))
        return value

    return convert


# Field annotations (strings, because of `from __future__ import annotations`) -> converter.
_CONVERTERS: dict[str, Callable[[Any, str], Any]] = {
    "ModelName": _one_of(ModelName),
    "AlgoName": _one_of(AlgoName),
    "SdeType | None": _optional(_one_of(SdeType)),
    "dict[str, Any]": _as_mapping,
    "int": _as_int,
    "float": _as_float,
    "float | None": _optional(_as_float),
    "str": _as_str,
    "bool": _as_bool,
    "int | None": _optional(_as_int),
    "str | None": _optional(_as_str),
    "str | bool": lambda value, key: (
        str(value).lower() if isinstance(value, bool) else _as_str(value, key)
    ),
    "tuple[int, int] | None": _optional(_as_pair),
    "list[str] | None": _optional(_as_str_list),
    "Devices": _optional(_as_device_list),
}
_CHOICES: tuple[type[StrEnum], ...] = (
    Dtype, CpsLogprob, Solver, TimeInput, AdvNorm, AdvStd, KlType, RewardWeighting, LrSchedule,
    NonfinitePolicy, GradOrder, RewardErrorPolicy, Mode, TrainerParallel, ShardDeal,
    TrainerSampling,
    MicrobatchAxis, WeightSync, GeneratorLoss, StalenessSchedule, TagPolicyName,
)  # fmt: skip
"""The settings' sets of values: a field annotated with one (or with ``<it> | None``) takes
one of its values, which the loader turns into the member."""
_CONVERTERS.update({c.__name__: _member(c) for c in _CHOICES})
_CONVERTERS.update({f"{c.__name__} | None": _optional(_member(c)) for c in _CHOICES})
_CONVERTERS["RewardErrorPolicy"] = _member(RewardErrorPolicy, "use fail or drop")


def _validate_section(section: Any, prefix: str) -> None:
    """Coerce every field of one section to its declared type (a field that is a section of
    its own, as ``runtime.schedule``, is built and checked as one), then run its own checks."""
    for f in fields(section):
        key, value = _key(prefix, f.name), getattr(section, f.name)
        inner = _SUBSECTIONS.get(f.type)
        if inner is None:
            value = _CONVERTERS[f.type](value, key)
        elif value is None or isinstance(value, Mapping):  # an empty YAML section is None
            value = _make(inner, value or {}, key)
        elif isinstance(value, inner):
            _validate_section(value, key)
        else:
            raise _bad(key, value, f"it must be a mapping of {key} settings")
        setattr(section, f.name, value)
    section._check_values(prefix)


def _at_least(prefix: str, name: str, value: float, low: float, why: str = "") -> None:
    if value < low:
        raise _bad(_key(prefix, name), value, f"it must be at least {low}{why}")


def _positive(prefix: str, name: str, value: float, why: str = "") -> None:
    if value <= 0:
        raise _bad(_key(prefix, name), value, f"it must be greater than 0{why}")


# --------------------------------------------------------------------------- sections


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: ModelName = "flux"
    """Backbone: one of the registered ones (digen.registry.models: hunyuanvideo, wan, flux, qwenimage, sd3)."""
    path: str | None = None
    """Local diffusers-format directory with real weights; None runs the tiny random-init flavour."""
    dtype: Dtype = Dtype.FLOAT32
    """Weights / activations dtype: float32, bfloat16 or float16 (the RL math is always fp32)."""
    device: str = "cpu"
    """Torch device of the model (cpu, cuda, cuda:1, ...)."""
    height: int | None = None
    """Image height in pixels; None takes the flavour's default. Must divide by 16."""
    width: int | None = None
    """Image width in pixels; None takes the flavour's default. Must divide by 16."""
    num_frames: int | None = None
    """Video frames (video backbones only); None takes the flavour's default. Must be 4k+1."""
    max_sequence_length: int | None = None
    """Text tokens per prompt; None takes the pipeline's default."""
    flavour: str = "tiny"
    """Random-init architecture built from config when path is null: tiny (toy width, for tests and CPUs) or medium (about 1B parameters for image backbones, a small video model: for measuring on a GPU)."""
    vae_tiling: bool = False
    """Decode in slices (one sample at a time) and spatial tiles, bounding decode memory (long videos, large images)."""
    offload_text_encoders: bool = False
    """Keep the text encoders on the CPU and bring them to the model's device only to encode a prompt (embeddings are cached)."""

    def __post_init__(self) -> None:
        _validate_section(self, "model")

    def _check_values(self, p: str) -> None:
        if not isinstance(self.device, str) or not _DEVICE_RE.fullmatch(self.device):
            raise _bad(
                _key(p, "device"), self.device, "name a torch device such as cpu, cuda or cuda:1"
            )
        for side in ("height", "width"):
            value = getattr(self, side)
            if value is not None and (value < 16 or value % 16):
                raise _bad(_key(p, side), value, "it must be a positive multiple of 16 or null")
        frames = self.num_frames
        if frames is not None:
            if frames < 1 or (frames - 1) % 4:
                raise _bad(
                    _key(p, "num_frames"),
                    frames,
                    "it must be of the form 4k+1 (1, 5, 9, ...) or null",
                )
            if frames > 1 and not BACKBONES[self.name].video:
                raise _bad(
                    _key(p, "num_frames"),
                    frames,
                    f"{self.name} is an image backbone, so leave it null (or 1)",
                )
        if self.max_sequence_length is not None:
            _at_least(p, "max_sequence_length", self.max_sequence_length, 1)
        _choice(_key(p, "flavour"), self.flavour, FLAVOURS)


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    n: int = 4
    """Group size: samples per prompt. At least 2 (advantages are group-relative)."""
    num_inference_steps: int = 10
    """Denoising steps per sample."""
    sde_type: SdeType | None = None
    """Stochastic step: sde or cps (Flow-GRPO, MixGRPO: sde), dance (DanceGRPO); None takes the algorithm's own."""
    noise_level: float = 0.7
    """SDE noise: `a` for Flow-GRPO sde/cps, `eta` for DanceGRPO. Non-negative."""
    sde_window_size: int = 0
    """Steps in the SDE (trained) window; 0: the algorithm's plan without a window (Flow-GRPO: every step; DanceGRPO: every step but the last)."""
    sde_window_range: tuple[int, int] | None = None
    """[lo, hi): the window start is drawn per step from [lo, hi - sde_window_size]; None = [0, num_inference_steps)."""
    timestep_fraction: float = 1.0
    """Fraction of the window's steps trained per sample (DanceGRPO), in (0, 1]."""
    guidance_scale: float = 1.0
    """Classifier-free guidance scale; 1.0 turns CFG off."""
    negative_prompt: str = ""
    """Negative prompt used with CFG."""
    cps_logprob: CpsLogprob = CpsLogprob.PUBLISHED
    """Log-prob of the cps step: published (-mean((x' - mu)^2), what published clip ranges mean) or gaussian (the full density)."""
    same_initial_noise: bool = False
    """The samples of a group start from the same noise (DanceGRPO / MixGRPO) instead of each its own."""
    solver: Solver = Solver.EULER
    """How steps without noise move: euler; dpm2 (second-order multistep DPM-Solver++ on every step without noise: DiffusionNFT's sampler); or dpm2-post (Euler up to the end of the SDE window, DPM-Solver++ after it: MixGRPO-Flash's dpm_apply_strategy=post)."""
    post_compress: float = 1.0
    """With solver dpm2-post: the steps after the SDE window are redrawn as int((N - last window step) * post_compress) - 1 uniform steps down to 0 (at least 1); 1.0 keeps them (MixGRPO-Flash's dpm_post_compress_ratio, published 0.4). In (0, 1]."""
    shift: float | None = None
    """A fixed time shift s of the sigmas (s*t / (1 + (s - 1) t) on a uniform grid: MixGRPO's FLUX schedule uses 3); None keeps the backbone scheduler's own (FLUX: resolution-dependent)."""
    time_input: TimeInput = TimeInput.SIGMA
    """What the transformer is told the time is: sigma, or int1000 (int(1000 sigma) / 1000, as DanceGRPO's and MixGRPO's code feeds it); the step math always uses sigma."""

    def __post_init__(self) -> None:
        _validate_section(self, "rollout")

    def _check_values(self, p: str) -> None:
        if self.n < 2:
            raise _bad(
                _key(p, "n"),
                self.n,
                "the group size must be at least 2 (advantages are group-relative)",
            )
        _at_least(p, "num_inference_steps", self.num_inference_steps, 1)
        _at_least(p, "noise_level", self.noise_level, 0.0)
        if self.shift is not None:
            _positive(p, "shift", self.shift)
        steps = self.num_inference_steps
        size = self.sde_window_size
        if size < 0 or size > steps:
            raise _bad(
                _key(p, "sde_window_size"),
                size,
                f"it must be from 0 (every step) to {_key(p, 'num_inference_steps')} = {steps}",
            )
        if self.sde_window_range is not None:
            lo, hi = self.sde_window_range
            if not 0 <= lo <= hi <= steps:
                raise _bad(
                    _key(p, "sde_window_range"),
                    self.sde_window_range,
                    f"it must be [lo, hi] with 0 <= lo <= hi <= "
                    f"{_key(p, 'num_inference_steps')} = {steps}",
                )
            if size > 0 and hi - lo < size:
                raise _bad(
                    _key(p, "sde_window_range"),
                    self.sde_window_range,
                    f"it must span at least {_key(p, 'sde_window_size')} = {size} steps "
                    f"(hi - lo >= {size})",
                )
        if not 0 < self.timestep_fraction <= 1:
            raise _bad(_key(p, "timestep_fraction"), self.timestep_fraction, "it must be in (0, 1]")
        if not 0 < self.post_compress <= 1:
            raise _bad(_key(p, "post_compress"), self.post_compress, "it must be in (0, 1]")
        if self.post_compress < 1 and self.solver != "dpm2-post":
            raise _bad(
                _key(p, "post_compress"),
                self.post_compress,
                f"it compresses the steps after the SDE window, which only "
                f"{_key(p, 'solver')} = dpm2-post does (here {self.solver})",
            )
        _at_least(p, "guidance_scale", self.guidance_scale, 1.0, " (1.0 turns guidance off)")


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    name: AlgoName = "flowgrpo"
    """One of the registered algorithms (digen.registry.algos: flowgrpo, flowgrpo-fast, dancegrpo, mixgrpo, mixgrpo-flash, nft)."""
    adv_norm: AdvNorm = AdvNorm.GROUP
    """Advantage scaling: group (centre per prompt and divide by a std) or none (Dr.GRPO: centred only)."""
    adv_std: AdvStd = AdvStd.GROUP
    """Which std advantages divide by: group (each prompt's own) or global (one over the whole batch: Flow-GRPO's shipped configs; training then waits until the batch is scored)."""
    adv_std_unbiased: bool = False
    """Use the unbiased (n - 1) std (DanceGRPO, MixGRPO) instead of the population std (Flow-GRPO)."""
    adv_eps: float = 1e-4
    """Added to the std before dividing (Flow-GRPO 1e-4; DanceGRPO, MixGRPO 1e-8)."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-adv_clip_max, adv_clip_max]. Positive."""
    clip_ratio: float = 1e-4
    """PPO clip range eps: the ratio is clipped to [1 - eps, 1 + eps]. Positive."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference (the base model, LoRA off); 0 turns it off."""
    kl_type: KlType | None = None
    """KL convention: flowgrpo (divided by Flow-GRPO's std_dev_t^2, without the step's |dt|: what its published beta means) or exact (the Gaussian KL of the step); None takes the algorithm's."""
    best_of_n: int = 0
    """DanceGRPO best-of-N: train only the top and bottom k/2 samples of each group; 0 keeps all."""
    reward_weighting: RewardWeighting = RewardWeighting.SUM
    """Several rewards: sum (advantages of their weighted sum: Flow-GRPO's) or advantage (each reward's own group advantages, then their weighted sum: DanceGRPO's multi-reward form, which keeps a reward of small spread from being drowned)."""
    normalize_reward_weights: bool = False
    """With reward_weighting = advantage: divide the rewards' weights by their sum (MixGRPO's multi-reward script), so each reward's advantages mix as a weighted mean."""
    old_kl_coef: float = 0.0
    """Weight of 0.5 * mean((logp - logp_old)^2), the squared log-ratio to the sampling policy (MixGRPO's kl_coeff, published 0); 0 turns it off."""
    ratio_norm: bool = False
    """GRPO-Guard: the clipped ratio without its mean shift, scaled to the step's std, and each step's loss divided by its |dt| (sde steps; generators then keep each step's mean)."""
    params: dict[str, Any] = field(default_factory=dict)
    """The algorithm's own settings (algo.params.<key>; see `digen algos`); missing ones take its defaults."""

    def __post_init__(self) -> None:
        _validate_section(self, "algo")

    @property
    def resolved_kl_type(self) -> str:
        return self.kl_type or get_algorithm(self.name).kl_type

    def _check_values(self, p: str) -> None:
        declared = get_algorithm(self.name).params
        for key, value in self.params.items():
            if key not in declared:
                have = ", ".join(declared) or "none"
                raise ConfigError(
                    f"unknown config key '{_key(p, 'params.' + str(key))}'; "
                    f"{self.name} has these params: {have}."
                )
            problem = declared[key].check(value)
            if problem:
                raise _bad(_key(p, f"params.{key}"), value, problem)
        self.params = {k: self.params.get(k, param.default) for k, param in declared.items()}
        _at_least(p, "adv_eps", self.adv_eps, 0.0)
        _positive(p, "adv_clip_max", self.adv_clip_max)
        _positive(p, "clip_ratio", self.clip_ratio)
        _at_least(p, "kl_coef", self.kl_coef, 0.0, " (0 turns the KL term off)")
        _at_least(p, "old_kl_coef", self.old_kl_coef, 0.0, " (0 turns the term off)")
        # The upper bound (rollout.n) lives in another section: see _check_cross.
        if self.best_of_n != 0 and (self.best_of_n < 2 or self.best_of_n % 2):
            raise _bad(
                _key(p, "best_of_n"),
                self.best_of_n,
                "use 0 (keep every sample) or an even number from 2 to rollout.n",
            )


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    lr: float = 3e-4
    """AdamW learning rate; the default is Flow-GRPO's and DanceGRPO's published LoRA rate,
    which the real-weight presets keep (the tiny flavours' presets use a larger one)."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm; 0 turns clipping off."""
    lora_rank: int = 8
    """LoRA rank; 0 means full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA alpha."""
    lora_targets: list[str] | None = None
    """LoRA target modules (peft names); None uses the backbone's defaults."""
    lora_init: str | bool = "gaussian"
    """LoRA initialisation passed to peft (gaussian, true, ...)."""
    lora_dtype: Dtype | None = None
    """dtype the LoRA parameters are cast to (float32, bfloat16); None keeps the model dtype."""
    mini_batch_size: int | None = None
    """Prompts per optimizer step; None = train_batch_size (one optimizer step per train step)."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one device (gradient accumulation unit)."""
    num_devices: int = 1
    """Data-parallel training devices the mini-batch is split over."""
    lr_schedule: LrSchedule = LrSchedule.CONSTANT
    """Learning rate over the train steps: constant or cosine (down to lr_min_ratio x lr at the last step); either after a linear warm-up."""
    warmup_steps: int = 0
    """Train steps of linear warm-up from lr / (warmup_steps + 1) to lr."""
    lr_min_ratio: float = 0.0
    """cosine: the last step's learning rate as a fraction of lr."""
    on_nonfinite: NonfinitePolicy = NonfinitePolicy.FAIL
    """A NaN or infinite reward (or a reward hook returning the wrong count), loss or gradient: fail stops the run naming it; drop leaves it out of the update and counts it (dropped_groups, dropped_microbatches, skipped_steps in metrics)."""
    gradient_checkpointing: bool = False
    """Recompute the transformer's activations in the backward pass (less memory, about a third more compute)."""
    grad_order: GradOrder = GradOrder.AUTO
    """How a step's gradients are summed: fixed (per micro-batch, in micro-batch order: a seeded run repeats bit for bit whatever the timing; memory: one gradient copy per micro-batch a trainer holds), arrival (in place, as updates finish: one buffer, last bits vary with timing), auto (fixed with LoRA, arrival for full fine-tuning)."""

    def __post_init__(self) -> None:
        _validate_section(self, "train")

    def _check_values(self, p: str) -> None:
        _positive(p, "lr", self.lr)
        _at_least(p, "weight_decay", self.weight_decay, 0.0)
        _at_least(p, "max_grad_norm", self.max_grad_norm, 0.0, " (0 turns clipping off)")
        _at_least(p, "lora_rank", self.lora_rank, 0, " (0 means full fine-tuning)")
        _positive(p, "lora_alpha", self.lora_alpha)
        if not _LORA_INIT_RE.fullmatch(str(self.lora_init).lower()):
            raise _bad(
                _key(p, "lora_init"),
                self.lora_init,
                f"name one of peft's initialisations: {', '.join(LORA_INITS)}",
            )
        if self.mini_batch_size is not None:
            _at_least(p, "mini_batch_size", self.mini_batch_size, 1)
        _at_least(p, "micro_batch_size", self.micro_batch_size, 1)
        _at_least(p, "num_devices", self.num_devices, 1)
        _at_least(p, "warmup_steps", self.warmup_steps, 0)
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise _bad(_key(p, "lr_min_ratio"), self.lr_min_ratio, "it must be in [0, 1]")

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate of train step ``step`` of ``steps`` (a function of the step
        alone, so a resumed run picks it up from the step number)."""
        lr = self.lr
        if step < self.warmup_steps:
            return lr * (step + 1) / (self.warmup_steps + 1)
        if self.lr_schedule == "cosine":
            span = max(steps - 1 - self.warmup_steps, 1)
            done = min(step - self.warmup_steps, span) / span
            low = self.lr_min_ratio
            return lr * (low + (1 - low) * 0.5 * (1 + math.cos(math.pi * done)))
        return lr

    @property
    def ordered_grads(self) -> bool:
        """Whether gradients are summed per micro-batch in a fixed order (``grad_order``)."""
        if self.grad_order == "auto":
            return self.lora_rank > 0
        return self.grad_order == "fixed"


@dataclass(kw_only=True, slots=True)
class DataConfig:
    prompts: str | None = None
    """Prompt file (.txt one per line, or .jsonl with a "prompt" field), or a shipped set by name (default; ocr: text to render for the OCR reward; shapes, shapes-heldout: the shapes world's training and held-out captions); None: the default set."""
    train_batch_size: int = 2
    """Unique prompts per train step (each replicated n times)."""
    per_category: int | None = None
    """Shapes-world prompts only: train on each category's prompts this many times an epoch (cycled when it has fewer, evenly spaced when more), so every category is drawn alike (the shapes training set has 192 position captions and 2 single-object ones; 192 keeps every caption); None: every prompt once an epoch."""

    def __post_init__(self) -> None:
        _validate_section(self, "data")

    def _check_values(self, p: str) -> None:
        if self.prompts is not None and not self.prompts:
            raise _bad(_key(p, "prompts"), self.prompts, "give a prompt file path or null")
        _at_least(p, "train_batch_size", self.train_batch_size, 1)
        if self.per_category is not None:
            _at_least(p, "per_category", self.per_category, 1)


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    every: int = 0
    """Evaluate every this many train steps, and before the first and after the last; 0: never."""
    prompts: str | None = None
    """The evaluation's prompts (a file or a shipped set, as data.prompts); None: the held-out set of the training prompts when they have one (shapes: shapes-heldout), else the training prompts."""
    samples: int = 1
    """Images per prompt, each from its own fixed noise (the same at every evaluation)."""
    per_category: int | None = None
    """Shapes-world prompts only: each category's prompts are taken this many times (cycled when it has fewer, evenly spaced when more; each eval.samples images), so a category with one held-out prompt weighs as much as one with 96; None: every prompt once."""
    ema: float = 0.0
    """Evaluate a moving average of the trained weights with this decay instead of the weights that sample: after optimizer step s, ema += (1 - min((1 + s) / (10 + s), ema)) (theta - ema) (DiffusionNFT evaluates one at 0.9, its preset's value); 0: evaluate the sampling weights. In [0, 1)."""
    num_inference_steps: int | None = None
    """Denoising steps of the evaluation's ODE sampling; None: rollout.num_inference_steps. Flow-GRPO and DiffusionNFT evaluate SD3.5-M with 40, Flow-GRPO evaluates FLUX with 28 (their presets' values)."""
    solver: Solver | None = None
    """How the evaluation's steps move: euler or dpm2; None: the rollout's solver (euler where it is dpm2-post, which needs a window). DiffusionNFT samples with dpm2 and evaluates with euler."""

    def __post_init__(self) -> None:
        _validate_section(self, "eval")

    def _check_values(self, p: str) -> None:
        _at_least(p, "every", self.every, 0)
        if self.prompts is not None and not self.prompts:
            raise _bad(_key(p, "prompts"), self.prompts, "give a prompt file path or null")
        _at_least(p, "samples", self.samples, 1)
        if self.per_category is not None:
            _at_least(p, "per_category", self.per_category, 1)
        if not 0 <= self.ema < 1:
            raise _bad(_key(p, "ema"), self.ema, "it must be in [0, 1) (0 turns it off)")
        if self.num_inference_steps is not None:
            _at_least(p, "num_inference_steps", self.num_inference_steps, 1)
        if self.solver == "dpm2-post":
            raise _bad(
                _key(p, "solver"),
                self.solver,
                "use euler or dpm2 (dpm2-post switches solver after an SDE window, and "
                "evaluation samples without one)",
            )


@dataclass(kw_only=True, slots=True)
class RewardSpec:
    name: str = "jpeg_incompressibility"
    """A built-in reward (jpeg_compressibility, jpeg_incompressibility), `module:function`, or `path.py:function`."""
    weight: float = 1.0
    """Weight of this reward in the weighted sum."""
    timeout_s: float | None = None
    """Seconds one call of this reward may take before it counts as failed (then retried); None: no limit."""
    retries: int = 0
    """Further tries after a failed or timed-out call, waiting 0.5 s, 1 s, 2 s, ... between them."""
    on_error: RewardErrorPolicy = RewardErrorPolicy.FAIL
    """When the last try fails: fail stops the run naming the reward; drop leaves out the groups of that batch and counts them (dropped_groups). A failure is never a zero reward."""
    url: str | None = None
    """The reward server's URL (name http)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for a reward that is a class (it is built with them), or the http reward's settings."""

    def __post_init__(self) -> None:
        # Inside a DigenConfig the key gets its index (rewards.0.weight): see validate().
        _validate_section(self, "reward")

    def _check_values(self, p: str) -> None:
        if self.timeout_s is not None:
            _positive(p, "timeout_s", self.timeout_s)
        _at_least(p, "retries", self.retries, 0)
        name = self.name
        if name == "http" and not self.url:
            raise _bad(_key(p, "url"), self.url, "the http reward needs its server's URL")
        if self.url is not None and name != "http":
            raise _bad(_key(p, "url"), self.url, "only the http reward takes a URL")
        module, sep, attr = name.rpartition(":")
        if name not in BUILTIN_REWARDS and not (sep and module and attr):
            raise _bad(
                _key(p, "name"),
                name,
                "use a built-in (" + ", ".join(BUILTIN_REWARDS) + "), "
                "module:function or path/to/file.py:function",
            )


@dataclass(kw_only=True, slots=True)
class PlacementConfig:
    trainer_parallel: TrainerParallel = TrainerParallel.REPLICATE
    """How trainers (and colocated workers) share the model: replicate (each holds all of it; gradients all-reduced), fsdp (FSDP2: every transformer block sharded over all of them; the trainers act as one), hsdp (sharded inside groups of shard_size, replicated across)."""
    shard_size: int | None = None
    """hsdp: trainers per sharding group (the GPUs of a node); None = the visible GPUs, at most the trainers. Must divide the trainer count."""
    shard_deal: ShardDeal = ShardDeal.TERMS
    """fsdp / hsdp trainers of a disaggregated run: what an update deals over them: terms (each member trains (sample, timestep) pairs, as a timestep batch against the same gathered layers, so a micro-batch smaller than the group keeps every member busy), samples (each member trains whole samples, every trained timestep of each), or sequence (every member trains every term with its share of each sample's tokens: Ulysses sequence parallelism, for samples too long for one device; the group also samples so when it assists generation). Colocated workers train the samples they made."""
    trainer_sampling: TrainerSampling = TrainerSampling.ROWS
    """fsdp / hsdp trainers of a disaggregated run, sampling a TAG micro-batch: rows (dealt over the members, each sampling its own; a micro-batch of fewer samples than members leaves some idle) or sequence (every member samples every row with its share of the tokens: sequence parallelism, every member busy however small the micro-batch). shard_deal=sequence samples so too."""
    generator_sequence: int = 1
    """Devices each generator samples one micro-batch on together, each holding its share of every sample's tokens (Ulysses sequence parallelism: for samples too long, or too slow, for one device). A generator is then this many processes (times 2 with generator_cfg); the run has runtime.generators of them."""
    generator_cfg: bool = False
    """Each generator runs the two branches of classifier-free guidance on two devices at once (CFG parallelism; needs rollout.guidance_scale > 1), times generator_sequence devices each."""
    generator_devices: Devices = None
    """Devices of the generator pool (e.g. [cuda:0, cuda:1] or "cuda:0,cuda:1"; a bare cuda is cuda:0); worker i takes entry i mod len. None: model.device, and with model.device = cuda the visible GPUs split between the pools."""
    trainer_devices: Devices = None
    """Devices of the trainer pool, as generator_devices."""
    generator_dtype: Dtype | None = None
    """Weights dtype of the generator pool (float32, bfloat16, float16); None uses model.dtype."""
    trainer_dtype: Dtype | None = None
    """Weights dtype of the trainer pool; None uses model.dtype."""
    threads_per_worker: int = 1
    """CPU threads each worker process may use (torch.set_num_threads)."""

    def __post_init__(self) -> None:
        _validate_section(self, "runtime.placement")

    @property
    def sharded(self) -> bool:
        """The trainers shard one model (fsdp / hsdp): they move in lockstep, as one."""
        return self.trainer_parallel in SHARDED_PARALLEL

    @property
    def generator_group(self) -> int:
        """The processes (devices) of one generator: ``generator_sequence``, twice that
        with ``generator_cfg``."""
        return self.generator_sequence * (2 if self.generator_cfg else 1)

    def _check_values(self, p: str) -> None:
        if self.shard_size is not None:
            _at_least(p, "shard_size", self.shard_size, 1)
        for pool in ("generator", "trainer"):
            devices = getattr(self, f"{pool}_devices")
            for device in devices or ():
                if not _DEVICE_RE.fullmatch(device):
                    raise _bad(
                        _key(p, f"{pool}_devices"),
                        devices,
                        "name devices such as cpu, cuda or cuda:1, one per entry",
                    )
            if devices:  # a bare cuda in a device list is the first GPU, as torch reads it
                setattr(self, f"{pool}_devices", ["cuda:0" if d == "cuda" else d for d in devices])
        _at_least(p, "threads_per_worker", self.threads_per_worker, 1)
        _at_least(p, "generator_sequence", self.generator_sequence, 1)


@dataclass(kw_only=True, slots=True)
class ScheduleConfig:
    microbatch_axis: MicrobatchAxis = MicrobatchAxis.GENERATION
    """generation: a prompt's n samples are spread over the generators (GAP); prompt: whole groups per micro-batch."""
    samples_per_microbatch: int | None = None
    """Samples in one generation micro-batch; None = ceil(n / generators) on the generation axis, n on the prompt axis."""
    tsp_degree: int = 1
    """Timesteps a trainer evaluates in one batched forward/backward (TSP), in either mode; 1 = one timestep at a time."""
    pipeline: bool = True
    """Overlap generation and training; false = naive disaggregation (generate the whole batch, then train)."""
    score_overlap: bool = True
    """Score on each generator's own scoring thread (an actor beside the generator in its process), so a slow reward never holds up the next generation; false = a generator scores each micro-batch itself before generating the next."""
    tag: TagPolicyName = TagPolicyName.BTS
    """Trainer-assisted generation at trainer bubbles: bts (bubble-triggered search), static, or none."""
    tag_k: int = 1
    """With tag=static: TAG micro-batches per step, inserted at the first bubbles."""
    max_staleness: int = 0
    """TCSS: how many policy versions a generation may lag its train step; 0 = on-policy."""
    staleness_ratio: float = 0.5
    """TCSS: the fraction of a step's micro-batches that come from the previous version (at most, with the eager schedule)."""
    staleness_schedule: StalenessSchedule = StalenessSchedule.FIXED
    """TCSS: fixed (the first staleness_ratio of every step's micro-batches are made one version early, always the same ones, whatever max_staleness >= 1: seeded runs repeat) or eager (stale while a worker is free, up to max_staleness versions and the ratio: the paper's form; which ones depends on timing)."""
    max_inflight: int | None = None
    """C_gen: micro-batches generated but not yet trained, at most (back-pressure on generators, bounds what workers hold); None = one step's plus the TCSS share."""
    group_updates: bool = False
    """Sharded trainers (fsdp / hsdp, disaggregated) take a prompt group's micro-batches made by one version in one update, their terms dealt over the members together: fuller passes, so fewer gathers of the model for the same terms (passes still hold at most train.micro_batch_size x tsp_degree terms, so activation memory is as before). Which micro-batches go together is fixed by the group, so seeded runs repeat."""

    def __post_init__(self) -> None:
        _validate_section(self, "runtime.schedule")

    def _check_values(self, p: str) -> None:
        if self.samples_per_microbatch is not None:
            _at_least(p, "samples_per_microbatch", self.samples_per_microbatch, 1)
        _at_least(p, "tsp_degree", self.tsp_degree, 1)
        _at_least(p, "tag_k", self.tag_k, 0)
        _at_least(p, "max_staleness", self.max_staleness, 0, " (0 is on-policy)")
        if not 0.0 <= self.staleness_ratio <= 1.0:
            raise _bad(_key(p, "staleness_ratio"), self.staleness_ratio, "it must be in [0, 1]")
        if self.max_inflight is not None:
            _at_least(p, "max_inflight", self.max_inflight, 1)


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    weight_sync: WeightSync = WeightSync.RPC
    """How new weights reach the generators: rpc (each pulls them from trainer 0) or broadcast (one gloo/NCCL group)."""
    sync_bucket_mb: float = 256.0
    """Largest piece of the weights one sync message or broadcast carries, in MB."""
    address: str = "127.0.0.1"
    """Address the RPC and process groups listen on; loopback keeps everything on this machine."""
    port: int | None = None
    """Port of the RPC rendezvous on runtime.transport.address (where workers, and generators joining with digen join, find the run); None picks a free one, written to workers.json."""
    rpc_timeout_s: float = 600.0
    """Longest a single remote call may take before the run stops with an error."""
    heartbeat_s: float = 60.0
    """A worker that answers no ping for this long (hung, or its machine gone) counts as lost, named in the log; a worker process that exits is noticed within 0.1 s."""

    def __post_init__(self) -> None:
        _validate_section(self, "runtime.transport")

    def _check_values(self, p: str) -> None:
        _positive(p, "sync_bucket_mb", self.sync_bucket_mb)
        if not self.address:
            raise _bad(_key(p, "address"), self.address, "give an IP address such as 127.0.0.1")
        _positive(p, "rpc_timeout_s", self.rpc_timeout_s)
        _positive(p, "heartbeat_s", self.heartbeat_s)
        if self.port is not None and not 0 < self.port < 65536:
            raise _bad(
                _key(p, "port"), self.port, "give a port in 1..65535, or null for a free one"
            )


@dataclass(kw_only=True, slots=True)
class ElasticConfig:
    on_generator_loss: GeneratorLoss = GeneratorLoss.CONTINUE
    """A generator lost mid-run (its process killed, its machine gone): continue (the run goes on with the generators left, and what the lost one held is made again elsewhere from the same keys) or fail (the run stops, with a checkpoint and the command to resume). A lost trainer always stops the run."""
    min_generators: int = 1
    """With on_generator_loss=continue: the run stops when fewer generators than this are left (scoring runs beside the generators, so at least 1)."""
    respawn_generators: bool = False
    """With on_generator_loss=continue: start a lost local generator again (it joins at the next step boundary, with that step's weights). The workers then form a dynamic RPC world; not with an external launcher (torchrun)."""
    respawn_after_s: float = 2.0
    """Wait before a generator's restart; it doubles with each restart of the same generator."""
    max_respawns: int = 3
    """Restarts of one generator, at most; after that its place stays empty."""
    accept_generators: bool = False
    """Take generators that join the running run (digen join ADDRESS:PORT, on this machine or another): each joins at the next step boundary with that step's weights. The workers then form a dynamic RPC world; not with an external launcher (torchrun) nor runtime.transport.weight_sync=broadcast."""
    join_secret_file: str | None = None
    """With accept_generators: a file holding the run's join secret (at least 16 characters), which digen join must prove it knows and the run proves to it in turn; None: the run makes a new one at each start and writes it to join-secret in its output directory (readable by its owner only)."""

    def __post_init__(self) -> None:
        _validate_section(self, "runtime.elastic")

    def _check_values(self, p: str) -> None:
        _at_least(p, "min_generators", self.min_generators, 1, " (scoring runs beside a generator)")
        _at_least(p, "respawn_after_s", self.respawn_after_s, 0)
        _at_least(p, "max_respawns", self.max_respawns, 0)
        if self.respawn_generators and self.on_generator_loss == GeneratorLoss.FAIL:
            why = f"a lost generator ends the run with {_key(p, 'on_generator_loss')}=fail"
            raise _bad(_key(p, "respawn_generators"), self.respawn_generators, why)
        if self.join_secret_file is not None:
            if not self.accept_generators:
                why = (
                    "a join secret is for a run that takes joining generators "
                    f"({_key(p, 'accept_generators')}=true)"
                )
                raise _bad(_key(p, "join_secret_file"), self.join_secret_file, why)
            if not str(self.join_secret_file).strip():
                why = "name a file that holds the secret, or null for one the run makes"
                raise _bad(_key(p, "join_secret_file"), self.join_secret_file, why)


@dataclass(kw_only=True, slots=True)
class RuntimeConfig:
    mode: Mode = Mode.COLOCATED
    """colocated (every worker samples, then trains) or disaggregated (generator and trainer pools over RPC)."""
    generators: int = 1
    """Generator workers (disaggregated): sample and score."""
    trainers: int = 1
    """Trainer workers (disaggregated): data-parallel among themselves."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Where the workers run and how the trainers share the model."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """How a step's work is cut into micro-batches and ordered: GAP, TSP, pipelining, TAG, TCSS."""
    transport: TransportConfig = field(default_factory=TransportConfig)
    """How the processes reach each other and new weights reach the generators."""
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    """Generators lost, started again, or joining while the run goes on."""

    def __post_init__(self) -> None:
        _validate_section(self, "runtime")

    def _check_values(self, p: str) -> None:
        _at_least(p, "generators", self.generators, 1)
        _at_least(p, "trainers", self.trainers, 1)
        # the rules that span the sections
        elastic = self.elastic
        if elastic.accept_generators and self.mode != Mode.DISAGGREGATED:
            why = f"generators join a run in {_key(p, 'mode')}=disaggregated"
            raise _bad(_key(p, "elastic.accept_generators"), elastic.accept_generators, why)
        if elastic.accept_generators and self.transport.weight_sync == WeightSync.BROADCAST:
            why = (
                "the weight broadcast group has a fixed size "
                f"({_key(p, 'transport.weight_sync')}=rpc can grow)"
            )
            raise _bad(_key(p, "elastic.accept_generators"), elastic.accept_generators, why)
        if elastic.min_generators > self.generators:
            why = f"it cannot exceed {_key(p, 'generators')} ({self.generators})"
            raise _bad(_key(p, "elastic.min_generators"), elastic.min_generators, why)
        sharded = self.mode == Mode.DISAGGREGATED and self.trainers > 1 and self.placement.sharded
        if self.schedule.group_updates and not sharded:
            why = (
                "it groups the updates of sharded trainers: set "
                f"{_key(p, 'mode')}=disaggregated, {_key(p, 'trainers')} > 1 and "
                f"{_key(p, 'placement.trainer_parallel')}=fsdp or hsdp"
            )
            raise _bad(_key(p, "schedule.group_updates"), self.schedule.group_updates, why)
        if self.placement.generator_group > 1:
            grouped = "a generator of several devices"
            if self.mode != Mode.DISAGGREGATED:
                why = f"{grouped} is a disaggregated run's: set {_key(p, 'mode')}=disaggregated"
                raise _bad(
                    _key(p, "placement.generator_sequence"), self.placement.generator_sequence, why
                )
            if elastic.respawn_generators or elastic.accept_generators:
                why = f"{grouped} cannot be started again or join: set {_key(p, 'elastic.respawn_generators')} and {_key(p, 'elastic.accept_generators')} to false"
                raise _bad(
                    _key(p, "placement.generator_sequence"), self.placement.generator_sequence, why
                )
            if self.transport.weight_sync == WeightSync.BROADCAST:
                why = f"{grouped} pulls its weights: set {_key(p, 'transport.weight_sync')}=rpc"
                raise _bad(
                    _key(p, "placement.generator_sequence"), self.placement.generator_sequence, why
                )
        for key in ("trainer_sampling", "shard_deal"):  # sequence: for sharded trainers
            value = getattr(self.placement, key)
            if value == "sequence" and not sharded:
                why = (
                    "it splits the tokens over sharded trainers: set "
                    f"{_key(p, 'mode')}=disaggregated, {_key(p, 'trainers')} > 1 and "
                    f"{_key(p, 'placement.trainer_parallel')}=fsdp or hsdp"
                )
                raise _bad(_key(p, f"placement.{key}"), value, why)


_RUNTIME_SECTIONS: dict[str, type] = {
    "placement": PlacementConfig,
    "schedule": ScheduleConfig,
    "transport": TransportConfig,
    "elastic": ElasticConfig,
}
"""``runtime``'s sections, by field name."""

FORMER_RUNTIME_KEYS: dict[str, str] = {
    "trainer_parallel": "placement",
    "shard_size": "placement",
    "generator_devices": "placement",
    "trainer_devices": "placement",
    "generator_dtype": "placement",
    "trainer_dtype": "placement",
    "threads_per_worker": "placement",
    "microbatch_axis": "schedule",
    "samples_per_microbatch": "schedule",
    "tsp_degree": "schedule",
    "pipeline": "schedule",
    "score_overlap": "schedule",
    "tag": "schedule",
    "tag_k": "schedule",
    "max_staleness": "schedule",
    "staleness_ratio": "schedule",
    "staleness_schedule": "schedule",
    "max_inflight": "schedule",
    "weight_sync": "transport",
    "sync_bucket_mb": "transport",
    "address": "transport",
    "port": "transport",
    "rpc_timeout_s": "transport",
    "heartbeat_s": "transport",
    "on_generator_loss": "elastic",
    "min_generators": "elastic",
    "respawn_generators": "elastic",
    "respawn_after_s": "elastic",
    "max_respawns": "elastic",
    "accept_generators": "elastic",
    "join_secret_file": "elastic",
}
"""The flat ``runtime`` layout of older configs (and of every older run's ``config.yaml``):
each former key ``runtime.<key>`` -> the section that holds it now,
``runtime.<section>.<key>``. The loader still takes the former keys."""

_SUBSECTIONS: dict[str, type] = {cls.__name__: cls for cls in _RUNTIME_SECTIONS.values()}
"""A field annotated with one of these names is a section of its own."""


def _sectioned_runtime(values: Mapping[str, Any], prefix: str = "runtime") -> dict[str, Any]:
    """``runtime`` settings with each former flat key moved into its section
    (:data:`FORMER_RUNTIME_KEYS`); a setting given by both its keys, differently, is refused."""
    out = dict(values)
    for key in [k for k in values if k in FORMER_RUNTIME_KEYS]:
        name, value = FORMER_RUNTIME_KEYS[key], out.pop(key)
        inner = out.get(name)
        if isinstance(inner, _RUNTIME_SECTIONS[name]):
            inner = config_to_dict(inner)
        elif inner is None:
            inner = {}
        elif not isinstance(inner, Mapping):
            where = f"{prefix}.{name}"
            raise _bad(where, inner, f"it must be a mapping of {where} settings")
        if key in inner and inner[key] != value:
            raise _twice(f"{prefix}.{key}", value, f"{prefix}.{name}.{key}", inner[key])
        out[name] = {**inner, key: value}
    return out


def _twice(former: str, value: Any, new: str, new_value: Any) -> ConfigError:
    """One setting given by its former key and its new one, with different values."""
    why = f"it is the former name of {new}, which is given as {_show(new_value)}; give only {new}"
    return _bad(former, value, why)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "rollout": RolloutConfig,
    "algo": AlgoConfig,
    "train": TrainConfig,
    "data": DataConfig,
    "runtime": RuntimeConfig,
    "eval": EvalConfig,
}


@dataclass(kw_only=True, slots=True)
class DigenConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    seed: int = 0
    """Run seed: prompt order, initial noise, SDE noise and window choices all derive from it."""
    steps: int = 10
    """Training steps (each: sample, score, update)."""
    save_every: int | None = None
    """Write a checkpoint every this many steps (and at every clean stop); None: about ten per run, at least every 100 steps; 0: only at the end."""
    keep_checkpoints: int = 2
    """Checkpoints kept (the newest); older ones are deleted once a newer one is complete."""
    logger: list[str] = field(default_factory=list)
    """Experiment trackers the run also logs to, beside metrics.jsonl: tensorboard, wandb (each an extra, as in pip install 'digen[wandb]'; one may be given bare: logger=tensorboard); see docs/TRACKERS.md."""

    def __post_init__(self) -> None:
        # Sections may be given as plain mappings (the loader does): build them here, so
        # their keys carry the section name.
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if value is None:  # an empty YAML section (`rollout:` with nothing under it)
                value = {}
            if isinstance(value, Mapping):
                setattr(self, name, _make(cls, value, name))
            elif not isinstance(value, cls):
                raise _bad(name, value, f"it must be a mapping of {name} settings")
        self.rewards = _make_rewards(self.rewards)
        validate(self)


def _make(cls: type, values: Mapping[str, Any], prefix: str) -> Any:
    """Build section ``cls`` from a mapping, naming keys ``prefix.<field>`` in every error
    (``runtime`` takes its former flat keys too: :data:`FORMER_RUNTIME_KEYS`)."""
    if cls is RuntimeConfig:
        values = _sectioned_runtime(values, prefix)
    names = [f.name for f in fields(cls)]
    for key in values:
        if key not in names:
            owner = "a reward" if cls is RewardSpec else prefix
            raise ConfigError(
                f"unknown config key '{_key(prefix, str(key))}'; {owner} has: {', '.join(names)}."
            )
    section = cls()  # the defaults are valid; the user's values are checked below
    for key, value in values.items():
        setattr(section, key, value)
    _validate_section(section, prefix)
    return section


def _make_rewards(value: Any) -> list[RewardSpec]:
    if not isinstance(value, list | tuple):
        raise _bad("rewards", value, "it must be a list of {name, weight} entries")
    specs = []
    for i, item in enumerate(value):
        key = f"rewards.{i}"
        if isinstance(item, str):  # a bare name: weight 1
            item = {"name": item}
        if isinstance(item, Mapping):
            if "name" not in item:
                raise _bad(key, dict(item), "each reward needs a name")
            item = _make(RewardSpec, item, key)
        elif not isinstance(item, RewardSpec):
            raise _bad(key, item, "each reward must be a {name, weight} mapping")
        specs.append(item)
    return specs


def validate(cfg: DigenConfig) -> None:
    """Check every value of ``cfg`` and the rules that span sections; raise :class:`ConfigError`.

    Runs when a :class:`DigenConfig` is built; call it again after changing fields in place.
    """
    for name in _SECTIONS:
        _validate_section(getattr(cfg, name), name)
    for i, spec in enumerate(cfg.rewards):
        _validate_section(spec, f"rewards.{i}")
    cfg.seed = _as_int(cfg.seed, "seed")
    cfg.steps = _as_int(cfg.steps, "steps")
    if cfg.seed < 0:
        raise _bad("seed", cfg.seed, "it must be at least 0")
    _at_least("", "steps", cfg.steps, 1)
    if cfg.save_every is not None:
        cfg.save_every = _as_int(cfg.save_every, "save_every")
        _at_least("", "save_every", cfg.save_every, 0, " (0 saves only at the end)")
    cfg.keep_checkpoints = _as_int(cfg.keep_checkpoints, "keep_checkpoints")
    _at_least("", "keep_checkpoints", cfg.keep_checkpoints, 1)
    trackers = [cfg.logger] if isinstance(cfg.logger, str) else cfg.logger or []
    if not isinstance(trackers, list | tuple) or any(t not in TRACKERS for t in trackers):
        raise _bad(
            "logger",
            cfg.logger,
            f"list trackers from {', '.join(TRACKERS)}, as in logger=[tensorboard, wandb]",
        )
    cfg.logger = list(dict.fromkeys(trackers))
    _check_cross(cfg)


def _check_cross(cfg: DigenConfig) -> None:
    rollout, algo, train, data = cfg.rollout, cfg.algo, cfg.train, cfg.data

    algorithm = get_algorithm(algo.name)
    if rollout.sde_type is None:
        rollout.sde_type = algorithm.sde_types[0]
    if rollout.sde_type not in algorithm.sde_types:
        raise _bad(
            "rollout.sde_type",
            rollout.sde_type,
            f"algo.name = {algo.name!r} steps with "
            + " or ".join(repr(s) for s in algorithm.sde_types),
        )
    problem = algorithm.check(cfg)
    if problem:
        raise ConfigError(problem + ".")
    if algo.ratio_norm and (algorithm.trains_on != "transitions" or rollout.sde_type != "sde"):
        raise _bad(
            "algo.ratio_norm",
            True,
            "GRPO-Guard normalises the ratio of Flow-GRPO's sde step, so it needs an "
            f"algorithm that trains transitions and rollout.sde_type = 'sde' (not "
            f"{algo.name} with {rollout.sde_type!r})",
        )

    if cfg.runtime.placement.generator_cfg and rollout.guidance_scale <= 1.0:
        raise _bad(
            "runtime.placement.generator_cfg",
            True,
            "CFG parallelism runs the two branches of guidance: set rollout.guidance_scale > 1",
        )

    if algo.best_of_n > rollout.n:
        raise _bad(
            "algo.best_of_n",
            algo.best_of_n,
            f"use 0 (keep every sample) or an even number from 2 to rollout.n = {rollout.n}",
        )

    if not cfg.rewards:
        raise _bad(
            "rewards", cfg.rewards, "give at least one reward (a built-in, module:function or file)"
        )
    seen: dict[str, int] = {}
    for i, spec in enumerate(cfg.rewards):
        if spec.name in seen:
            raise _bad(
                f"rewards.{i}.name",
                spec.name,
                f"each reward may appear once and it is already rewards.{seen[spec.name]}",
            )
        seen[spec.name] = i

    # Nested batch sizes: train_batch_size prompts -> mini-batches of mini_batch_size prompts
    # (whole groups) -> split over num_devices -> micro-batches of micro_batch_size samples.
    prompts = data.train_batch_size
    mini = prompts if train.mini_batch_size is None else train.mini_batch_size
    if prompts % mini:
        raise _bad(
            "train.mini_batch_size",
            mini,
            f"it must divide data.train_batch_size = {prompts} (mini-batches hold whole groups)",
        )
    kept = algo.best_of_n or rollout.n  # samples per group that are trained
    per_group = (
        f"algo.best_of_n {kept} kept per group" if algo.best_of_n else f"rollout.n {rollout.n}"
    )
    samples = mini * kept
    if samples % train.num_devices:
        raise _bad(
            "train.num_devices",
            train.num_devices,
            f"it must divide the {samples} samples of a mini-batch "
            f"(train.mini_batch_size {mini} x {per_group})",
        )
    per_device = samples // train.num_devices
    if per_device % train.micro_batch_size:
        raise _bad(
            "train.micro_batch_size",
            train.micro_batch_size,
            f"it must divide the {per_device} samples each device trains per mini-batch "
            f"({samples} samples / train.num_devices {train.num_devices})",
        )
    if (prompts * rollout.n) % train.num_devices:
        raise _bad(
            "train.num_devices",
            train.num_devices,
            f"it must divide the {prompts * rollout.n} samples of a train step "
            f"(data.train_batch_size {prompts} x rollout.n {rollout.n}), which it shares out",
        )
    schedule_plan(cfg)  # its C_gen bound must let an update start (digen.sched.plan)


def schedule_plan(cfg: DigenConfig, *, first_step: int = 0) -> SchedulePlan:
    """The run's :class:`~digen.sched.plan.SchedulePlan`: its schedule settings, handed to
    the one place that derives from them (a resumed run starts at ``first_step``)."""
    rt = cfg.runtime
    return plan_schedule(
        prompts=cfg.data.train_batch_size,
        group_size=cfg.rollout.n,
        generators=rt.generators,
        trainers=rt.trainers,
        sharded_trainers=rt.placement.sharded,
        axis=rt.schedule.microbatch_axis,
        samples_per_microbatch=rt.schedule.samples_per_microbatch,
        pipeline=rt.schedule.pipeline,
        batch_advantages=cfg.algo.adv_std == "global",
        max_staleness=rt.schedule.max_staleness,
        staleness_ratio=rt.schedule.staleness_ratio,
        staleness_schedule=rt.schedule.staleness_schedule,
        max_inflight=rt.schedule.max_inflight,
        score_overlap=rt.schedule.score_overlap,
        tag=rt.schedule.tag,
        tag_k=rt.schedule.tag_k,
        group_updates=rt.schedule.group_updates,
        first_step=first_step,
        last_step=cfg.steps - 1,
    )


# --------------------------------------------------------------------------- loading


def load_config(
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    base: Mapping[str, Any] | None = None,
    *,
    model: str | None = None,
    algo: str | None = None,
    mode: str | None = None,
    preset: bool | None = None,
) -> DigenConfig:
    """Load a config: defaults <- preset <- YAML ``path`` <- ``base`` <- ``key=value`` overrides.

    The preset layer (:func:`digen.presets.preset`, the recipe of a model x algorithm x mode)
    is used when ``preset`` is True, or when it is None and ``model``, ``algo`` or ``mode`` is
    given. Those three name the preset and win over ``base`` and the file; an override of
    the same key that says otherwise is refused (:class:`ConfigError`). When not given, each
    is read from the overrides, ``base``, the file, then the defaults (flux, flowgrpo,
    colocated). A set ``model.path`` selects the real-weight recipe. ``base`` holds settings
    that win over the file (the CLI's own flags). Choosing a preset imports nothing heavy.

    The YAML file is a nested mapping matching the dataclasses (``rewards`` is a list of
    ``{name, weight}``). Override values are parsed as YAML (``rollout.n=8``,
    ``model.path=null``, ``rollout.sde_window_range=[0,5]``); ``rewards.0.weight=2`` sets one
    field of one reward, and the index one past the end appends a reward. With
    ``algo.name=dancegrpo`` and no ``rollout.sde_type`` given, the SDE type becomes ``dance``.
    """
    if isinstance(overrides, str):
        raise ConfigError(
            f"overrides must be a list of key=value strings, not one string ({overrides!r}); "
            "write [" + repr(overrides) + "]."
        )
    # each layer in the sectioned layout before merging, so a setting given in the flat
    # runtime layout of an older file is the same setting as its new key in a later layer
    data: dict[str, Any] = {} if path is None else _current_layout(_read_yaml(Path(path)))
    if base:
        data = _merge(data, _current_layout(base))
    said: dict[str, Any] = {}  # what the overrides alone set
    named: dict[str, tuple[str, Any]] = {}  # each key the overrides set -> (as given, value)
    for item in overrides:
        given, key, value = _apply_override(data, item)
        before = named.setdefault(key, (given, value))
        if before[0] != given and before[1] != value:  # said by its former key and its own
            old, new = (before, (given, value)) if given == key else ((given, value), before)
            raise _twice(*old, key, new[1])
        if item.partition("=")[0].strip() in ("model.name", "algo.name", "runtime.mode"):
            _apply_override(said, item)
    for section, key, given, flag in (
        ("model", "name", model, "--model"),
        ("algo", "name", algo, "--algo"),
        ("runtime", "mode", mode, "--mode"),
    ):
        told = said.get(section)
        if given is not None and isinstance(told, dict) and key in told and told[key] != given:
            raise ConfigError(
                f"{flag} {given} and the override {section}.{key}={told[key]} disagree; "
                "give one of them."
            )
        if given is not None:  # flags name the preset; an override saying the same is fine
            if not isinstance(data.get(section), dict):
                data[section] = {}
            data[section][key] = given
    if preset or (preset is None and (model, algo, mode) != (None, None, None)):
        data = _with_preset(data)
    names = [f.name for f in fields(DigenConfig)]
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key '{key}'; the top level has: {', '.join(names)}.")
    return DigenConfig(**data)


def _with_preset(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` over the preset it names (or the defaults: flux, flowgrpo, colocated)."""
    from digen.presets import preset

    def pick(section: str, key: str, default: str) -> str:
        sec = data.get(section)
        value = sec.get(key) if isinstance(sec, Mapping) else None
        return value if isinstance(value, str) else default

    model = data.get("model")
    real = isinstance(model, Mapping) and model.get("path") is not None
    layer = preset(
        pick("model", "name", "flux"),
        pick("algo", "name", "flowgrpo"),
        real_weights=real,
        mode=pick("runtime", "mode", "colocated"),
        flavour=pick("model", "flavour", "tiny"),
    )
    return _merge(layer, data)


def _current_layout(data: Mapping[str, Any]) -> dict[str, Any]:
    """A layer of settings with its ``runtime`` in sections (:func:`_sectioned_runtime`)."""
    out = dict(data)
    if isinstance(out.get("runtime"), Mapping):
        out["runtime"] = _sectioned_runtime(out["runtime"])
    return out


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise ConfigError(f"config file '{path}' does not exist.")
    if not path.is_file():
        raise ConfigError(f"config file '{path}' is not a file.")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "a syntax error"
        raise ConfigError(f"config file '{path}' is not valid YAML ({problem}{where}).") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file '{path}' must hold a mapping of sections "
            f"({', '.join(f.name for f in fields(DigenConfig))}) at the top level, "
            f"not a {type(data).__name__}."
        )
    return data


def _merge(low: Mapping[str, Any], high: Mapping[str, Any]) -> dict[str, Any]:
    """Deep-merge two nested mappings; ``high`` wins and lists are replaced, not merged."""
    out = copy.deepcopy(dict(low))
    for key, value in high.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _apply_override(data: dict[str, Any], item: str) -> tuple[str, str, Any]:
    """Set one dotted ``key=value`` into the nested ``data`` mapping; return the key as
    given, the key it sets (a former runtime key's new one) and the value."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} is malformed: write key=value, as in rollout.n=8.")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        raise ConfigError(
            f"override {item!r} has a value that is not valid YAML (quote it to pass a string)."
        ) from None
    if key == "reward.http.url":  # shorthand: score with one reward server, nothing else
        data["rewards"] = [{"name": "http", "url": value}]
        return key, key, value
    given, parts = key, key.split(".")
    if parts[0] == "runtime" and len(parts) > 1 and parts[1] in FORMER_RUNTIME_KEYS:
        parts.insert(1, FORMER_RUNTIME_KEYS[parts[1]])  # the flat layout's key
        key = ".".join(parts)
    top = parts[0]
    names = [f.name for f in fields(DigenConfig)]
    if top not in names:
        raise ConfigError(f"unknown config key '{key}'; the top level has: {', '.join(names)}.")
    if len(parts) == 1:
        data[top] = value
    elif top in _SECTIONS:
        cls, where, rest = _SECTIONS[top], top, parts[1:]
        section = data.setdefault(top, {})
        while isinstance(section, dict):  # down to the section that holds the setting
            allowed = [f.name for f in fields(cls)]
            if rest[0] not in allowed:
                raise ConfigError(
                    f"unknown config key '{given}'; {where} has: {', '.join(allowed)}."
                )
            inner_cls = _SUBSECTIONS.get(cls.__annotations__[rest[0]])
            if inner_cls is None or len(rest) == 1:
                break
            if section.get(rest[0]) is None:
                section[rest[0]] = {}
            cls, where, section, rest = inner_cls, f"{where}.{rest[0]}", section[rest[0]], rest[1:]
        mapping = len(rest) == 2 and cls.__annotations__[rest[0]] == "dict[str, Any]"
        if not isinstance(section, dict) or (len(rest) > 1 and not mapping):
            raise ConfigError(f"config key '{given}' does not exist: {where} holds plain settings.")
        if mapping:  # a setting of a mapping field, e.g. algo.params.stride=2
            inner = section.setdefault(rest[0], {})
            if not isinstance(inner, dict):
                raise ConfigError(
                    f"config key '{given}' does not exist: {rest[0]} is not a mapping."
                )
            inner[rest[1]] = value
        else:
            section[rest[0]] = value
    elif top == "rewards":
        _override_reward(data, key, parts[1:], value)
    else:
        raise ConfigError(f"config key '{key}' does not exist: {top} is a single value.")
    return given, key, value


def _override_reward(data: dict[str, Any], key: str, parts: list[str], value: Any) -> None:
    """``rewards.<i>=<mapping>`` or ``rewards.<i>.<field>=<value>``; index len(rewards) appends."""
    rewards = data.get("rewards")
    if rewards is None:  # start from the default reward list, so rewards.0.weight=2 edits it
        rewards = data["rewards"] = [config_to_dict(spec) for spec in DigenConfig().rewards]
    if not isinstance(rewards, list):
        raise ConfigError(f"config key '{key}' does not exist: rewards is not a list here.")
    if not parts[0].isdigit() or len(parts) > 2:
        raise ConfigError(
            f"unknown config key '{key}'; rewards entries are set by index, "
            "as in rewards.0.weight=2."
        )
    index = int(parts[0])
    if index > len(rewards):
        raise ConfigError(
            f"config key '{key}' is out of range: rewards has {len(rewards)} entries, "
            f"so use an index up to {len(rewards)} (that one appends)."
        )
    if index == len(rewards):
        rewards.append({})
    if len(parts) == 1:
        rewards[index] = value
        return
    allowed = [f.name for f in fields(RewardSpec)]
    if parts[1] not in allowed:
        raise ConfigError(f"unknown config key '{key}'; a reward has: {', '.join(allowed)}.")
    if isinstance(rewards[index], str):
        rewards[index] = {"name": rewards[index]}
    if not isinstance(rewards[index], dict):
        raise ConfigError(f"config key '{key}' does not exist: rewards.{index} is not a mapping.")
    rewards[index][parts[1]] = value


# --------------------------------------------------------------------------- saving


def config_to_dict(cfg: Any) -> Any:
    """A config (or one section) as plain YAML-safe types: dicts, lists, str, int, float, None."""
    if isinstance(cfg, list | tuple):
        return [config_to_dict(v) for v in cfg]
    if hasattr(cfg, "__dataclass_fields__"):
        return {f.name: config_to_dict(getattr(cfg, f.name)) for f in fields(cfg)}
    if isinstance(cfg, Enum):  # a choice's member: its plain string (YAML refuses str subclasses)
        return cfg.value
    return cfg


def field_docs(section: type) -> dict[str, str]:
    """Each field of a config section (a dataclass of this module) and the docstring under
    it, read from this module's source: the one place a key is described."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == section.__name__)
    docs, body = {}, cls.body
    for node, after in zip(body, [*body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def knobs_table(section: str) -> str:
    """The markdown table of a config section's keys (``runtime``, ``train``,
    ``runtime.schedule``, ...): key, default and meaning, from the fields and their
    docstrings (:func:`field_docs`); a section's own sections follow, each as its line and
    its table. ``docs/RUNTIME.md`` holds the ``runtime`` one; a test keeps it in step."""
    owner: Any = DigenConfig()
    for name in section.split("."):
        owner = getattr(owner, name)
    cls = type(owner)
    docs = field_docs(cls)
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    inner = []
    for f in fields(cls):
        if f.type in _SUBSECTIONS:
            key = f"{section}.{f.name}"
            inner.append(f"`{key}`: {docs.get(f.name, '')}\n\n{knobs_table(key)}")
            continue
        default = getattr(cls(), f.name)
        if default is None or isinstance(default, bool):
            shown = "null" if default is None else str(default).lower()  # as YAML writes it
        else:
            shown = default if isinstance(default, str) else _show(default)
        doc = docs.get(f.name, "").replace("|", "\\|")
        rows.append(f"| `{section}.{f.name}` | `{shown}` | {doc} |")
    return "\n\n".join(["\n".join(rows), *inner])


def dump_config(cfg: DigenConfig, path: str | Path) -> Path:
    """Write ``cfg`` as YAML that :func:`load_config` reads back to an equal config."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
    return path
