"""What only SD3 does: CLIP-L + CLIP-G + T5 conditioning, and its pipeline's sampling.

The adapter protocol (loading, shapes, schedule, CFG, decode, LoRA) is in ``test_protocol.py``.
"""

from __future__ import annotations

import pytest
import torch
from backbone_helpers import PROMPTS, cfg_sampled, negative, run_pipeline

from digen.models.sd3 import SD3Adapter


@pytest.fixture(scope="module")
def adapter(tiny_adapter) -> SD3Adapter:
    return tiny_adapter("sd3")


def test_clip_states_are_padded_to_the_t5_width_ahead_of_t5(adapter: SD3Adapter) -> None:
    c = adapter.encode_prompts(PROMPTS)
    pe, pooled = c.tensors["prompt_embeds"], c.tensors["pooled_prompt_embeds"]
    clip = (
        adapter.pipe.text_encoder.config.hidden_size
        + adapter.pipe.text_encoder_2.config.hidden_size
    )
    assert clip == 16 + 24 and pooled.shape == (2, clip)  # both CLIPs' projections, joined
    assert pe.shape == (2, 32 + 32, 48)  # 32 CLIP tokens (16 + 24 wide), then 32 T5 tokens
    assert torch.all(pe[:, :32, clip:] == 0)  # CLIP states padded up to the T5 width
    assert pe[:, 32:, clip:].abs().sum() > 0  # T5 states fill it
    capped = SD3Adapter(adapter.pipe, max_sequence_length=8).encode_prompts(PROMPTS)
    # the cap applies to T5 only
    assert torch.equal(capped.tensors["prompt_embeds"][:, :32], pe[:, :32])


def test_sampling_with_cfg_reproduces_the_pipeline(adapter: SD3Adapter) -> None:
    """Euler sampling with CFG on SD3's own schedule lands where ``StableDiffusion3Pipeline``
    does on the same noise."""
    n, scale = 3, 4.5
    x0, cond, neg, ours = cfg_sampled(adapter, n, scale)
    out = run_pipeline(
        adapter,
        n,
        **cond.tensors,
        **negative(neg),
        guidance_scale=scale,
        latents=x0,
        output_type="latent",
    )  # [1, C, H, W]
    torch.testing.assert_close(out, ours, atol=1e-4, rtol=1e-4)
