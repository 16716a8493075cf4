"""What only FLUX.1 does: 2x2 latent packing, the guidance embedding, true CFG in its pipeline.

The adapter protocol (loading, shapes, schedule, CFG, decode, LoRA) is in ``test_protocol.py``.
"""

from __future__ import annotations

import pytest
import torch
from backbone_helpers import PROMPTS, cfg_sampled, generators, negative, run_pipeline
from diffusers import FluxPipeline

from digen.models.flux import FluxAdapter, pack_latents, unpack_latents


@pytest.fixture(scope="module")
def adapter(tiny_adapter) -> FluxAdapter:
    return tiny_adapter("flux")


def test_pack_matches_pipeline_helpers() -> None:
    x = torch.randn(2, 4, 6, 8)  # [B, C, H, W]
    packed = pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, 6, 8))
    assert torch.equal(unpack_latents(packed, 6, 8), x)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 48, 64, 8), x)


def test_guidance_embedding_is_dev_only(adapter: FluxAdapter) -> None:
    """The tiny flavour is FLUX.1-dev (the protocol checks its guidance value is used); the
    schnell variant has no guidance embedding, and its value is ignored."""
    assert adapter.transformer.config.guidance_embeds
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe = FluxPipeline(**FluxAdapter.build_tiny_components(guidance_embeds=False))
    schnell = FluxAdapter(pipe, embedded_guidance=1.0)
    other = FluxAdapter(pipe, embedded_guidance=7.0)
    cond = schnell.encode_prompts(PROMPTS)
    x = schnell.initial_latents(generators(0, 1))
    with torch.no_grad():
        v = schnell.predict_velocity(x, 0.5, cond)
        assert torch.equal(v, other.predict_velocity(x, 0.5, cond))
    assert v.shape == x.shape and torch.isfinite(v).all()


def test_sampling_with_true_cfg_reproduces_the_pipeline(adapter: FluxAdapter) -> None:
    """Euler sampling with true CFG lands where ``FluxPipeline`` does on the same noise."""
    n, scale = 3, 2.0
    x0, cond, neg, ours = cfg_sampled(adapter, n, scale)
    out = run_pipeline(
        adapter,
        n,
        **cond.tensors,
        **negative(neg),
        true_cfg_scale=scale,
        guidance_scale=adapter.embedded_guidance,
        latents=pack_latents(x0),
        output_type="latent",
    )  # [1, N, 4C]
    torch.testing.assert_close(unpack_latents(out, 4, 4), ours, atol=1e-4, rtol=1e-4)
