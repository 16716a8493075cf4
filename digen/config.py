"""Run configuration: dataclasses with their checks, loaded from YAML plus dotted overrides.

Every field has a docstring comment; every bad value fails at load time with one sentence
naming the key, the value and what is allowed (a :class:`digen.errors.ConfigError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from digen.errors import ConfigError

__all__ = [
    "AlgoConfig",
    "ConfigError",
    "DataConfig",
    "DigenConfig",
    "ModelConfig",
    "RewardSpec",
    "RolloutConfig",
    "TrainConfig",
]


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    name: str = "flux"
    """Backbone: one of hunyuanvideo, wan, flux, qwenimage, sd3."""
    path: str | None = None
    """Local diffusers-format directory with real weights; None runs the tiny random-init flavour."""
    dtype: str = "float32"
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


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    n: int = 4
    """Group size: samples per prompt. At least 2 (advantages are group-relative)."""
    num_inference_steps: int = 10
    """Denoising steps per sample."""
    sde_type: str = "sde"
    """Stochastic step: sde or cps (Flow-GRPO), dance (DanceGRPO)."""
    noise_level: float = 0.7
    """SDE noise: `a` for Flow-GRPO sde/cps, `eta` for DanceGRPO. Non-negative."""
    sde_window_size: int = 0
    """Steps in the SDE (trained) window; 0 makes every step stochastic."""
    sde_window_range: tuple[int, int] | None = None
    """[lo, hi): the window start is drawn per step from [lo, hi - sde_window_size]; None = [0, num_inference_steps)."""
    timestep_fraction: float = 1.0
    """Fraction of the window's steps trained per sample (DanceGRPO), in (0, 1]."""
    guidance_scale: float = 1.0
    """Classifier-free guidance scale; 1.0 turns CFG off."""
    negative_prompt: str = ""
    """Negative prompt used with CFG."""


@dataclass(kw_only=True, slots=True)
class AlgoConfig:
    name: str = "flowgrpo"
    """flowgrpo or dancegrpo."""
    adv_norm: str = "group"
    """Advantage scaling: group (divide by the group's std) or none (Dr.GRPO: mean-centred only)."""
    adv_eps: float = 1e-4
    """Added to the std before dividing."""
    adv_clip_max: float = 5.0
    """Advantages are clipped to [-adv_clip_max, adv_clip_max]. Positive."""
    clip_ratio: float = 1e-4
    """PPO clip range eps: the ratio is clipped to [1 - eps, 1 + eps]. Positive."""
    kl_coef: float = 0.0
    """Weight of the KL to the reference (the base model, LoRA off); 0 turns it off."""
    best_of_n: int = 0
    """DanceGRPO best-of-N: train only the top and bottom k/2 samples of each group; 0 keeps all."""


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    lr: float = 1e-4
    """AdamW learning rate."""
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
    lora_init: str = "gaussian"
    """LoRA initialisation passed to peft (gaussian, true, ...)."""
    lora_dtype: str | None = None
    """dtype the LoRA parameters are cast to (float32, bfloat16); None keeps the model dtype."""
    mini_batch_size: int | None = None
    """Prompts per optimizer step; None = train_batch_size (one optimizer step per train step)."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one device (gradient accumulation unit)."""
    num_devices: int = 1
    """Data-parallel training devices the mini-batch is split over."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    prompts: str | None = None
    """Prompt file (.txt one per line, or .jsonl with a "prompt" field); None uses the shipped set."""
    train_batch_size: int = 2
    """Unique prompts per train step (each replicated n times)."""


@dataclass(kw_only=True, slots=True)
class RewardSpec:
    name: str = "jpeg_incompressibility"
    """A built-in reward (jpeg_compressibility, jpeg_incompressibility), `module:function`, or `path.py:function`."""
    weight: float = 1.0
    """Weight of this reward in the weighted sum."""


@dataclass(kw_only=True, slots=True)
class DigenConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rewards: list[RewardSpec] = field(default_factory=lambda: [RewardSpec()])
    seed: int = 0
    """Run seed: prompt order, initial noise, SDE noise and window choices all derive from it."""
    steps: int = 10
    """Training steps (each: sample, score, update)."""
