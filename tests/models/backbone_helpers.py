"""What the backbone tests share: prompts, per-sample generators, private copies, Euler sampling."""

from __future__ import annotations

import copy
from typing import Any

import torch

from digen.models.base import DiffusionAdapter, PromptEmbeds

#: two prompts of different lengths (the second longer, so variable-length encoders pad the first)
PROMPTS = ("a red cube", "a blue sphere on grass")


def generators(*seeds: int) -> list[torch.Generator]:
    """One seeded CPU generator per sample."""
    return [torch.Generator().manual_seed(s) for s in seeds]


def private_copy(adapter: DiffusionAdapter) -> DiffusionAdapter:
    """The same weights in modules of its own, for a test that changes them (LoRA)."""
    return type(adapter)(copy.deepcopy(adapter.pipe))


def negative(neg: PromptEmbeds) -> dict[str, torch.Tensor]:
    """``neg`` under the ``negative_*`` names the diffusers pipelines take."""
    return {f"negative_{k}": v for k, v in neg.tensors.items()}


@torch.no_grad()
def guidance_parts(
    adapter: DiffusionAdapter,
    latents: torch.Tensor,
    sigma: torch.Tensor,
    cond: PromptEmbeds,
    neg: PromptEmbeds,
    guidance_scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The guided velocity and its two parts: ``(guided, conditional, unconditional)``."""
    guided = adapter.predict_velocity(latents, sigma, cond, neg, guidance_scale=guidance_scale)
    return (
        guided,
        adapter.predict_velocity(latents, sigma, cond),
        adapter.predict_velocity(latents, sigma, neg),
    )


@torch.no_grad()
def run_pipeline(adapter: DiffusionAdapter, num_inference_steps: int, **kwargs: Any) -> Any:
    """The diffusers pipeline itself at the adapter's geometry; its first output."""
    geometry = {"height": adapter.height, "width": adapter.width}
    if adapter.is_video:
        geometry["num_frames"] = adapter.num_frames
    out = adapter.pipe(
        **geometry, num_inference_steps=num_inference_steps, return_dict=False, **kwargs
    )
    return out[0]


@torch.no_grad()
def euler_sample(
    adapter: DiffusionAdapter,
    latents: torch.Tensor,
    sigmas: torch.Tensor,
    cond: PromptEmbeds,
    neg: PromptEmbeds | None = None,
    guidance_scale: float = 1.0,
) -> torch.Tensor:
    """Deterministic Euler from ``latents`` over ``sigmas [N + 1]``, as a flow pipeline samples."""
    x = latents
    for i in range(len(sigmas) - 1):
        v = adapter.predict_velocity(x, sigmas[i], cond, neg, guidance_scale=guidance_scale)
        x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


def cfg_sampled(
    adapter: DiffusionAdapter, steps: int, guidance_scale: float
) -> tuple[torch.Tensor, PromptEmbeds, PromptEmbeds, torch.Tensor]:
    """``PROMPTS[0]`` sampled with CFG against the empty prompt on the adapter's sigmas:
    ``(noise, cond, neg, final latents)``, to hold against the diffusers pipeline's own."""
    cond, neg = adapter.encode_prompts(PROMPTS[:1]), adapter.encode_prompts([""])
    noise = adapter.initial_latents(generators(7))
    final = euler_sample(adapter, noise, adapter.sigmas(steps), cond, neg, guidance_scale)
    return noise, cond, neg, final
