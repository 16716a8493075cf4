"""What only Wan does: released UniPC schedulers, single-expert checkpoints, UMT5 padding,
and its pipeline's transformer call and sampling.

The adapter protocol (loading, shapes, schedule, CFG, decode, LoRA) is in ``test_protocol.py``.
"""

from __future__ import annotations

import pytest
import torch
from backbone_helpers import PROMPTS, euler_sample, generators, run_pipeline
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler, WanPipeline

from digen.errors import DigenError
from digen.models.wan import WanAdapter


@pytest.fixture(scope="module")
def adapter(tiny_adapter) -> WanAdapter:
    return tiny_adapter("wan")


def test_unipc_checkpoint_scheduler_becomes_euler_with_its_flow_shift(
    adapter: WanAdapter,
) -> None:
    # released Wan2.1 checkpoints ship UniPC with flow_shift (5.0 for 720p)
    unipc = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
    )
    ad = WanAdapter(WanPipeline(**{**adapter.pipe.components, "scheduler": unipc}))
    assert isinstance(ad.scheduler, FlowMatchEulerDiscreteScheduler)
    assert ad.scheduler.config.shift == 5.0
    assert ad.sigmas(2)[1].item() == pytest.approx(5.0 * 0.5 / (1 + 4.0 * 0.5))


def test_two_expert_checkpoints_are_refused(adapter: WanAdapter) -> None:
    assert adapter.pipe.transformer_2 is None
    two = WanPipeline(**{**adapter.pipe.components, "transformer_2": adapter.transformer})
    with pytest.raises(DigenError, match="transformer_2"):
        WanAdapter(two)


def test_prompt_embeds_are_zero_past_each_prompt(adapter: WanAdapter) -> None:
    emb = adapter.encode_prompts(PROMPTS).tensors["prompt_embeds"]  # [B, 32, D]
    # zero past each prompt's bytes + EOS, as the pipeline pads (the transformer takes no mask)
    nonzero = emb.abs().sum(-1).gt(0).sum(1).tolist()
    assert nonzero == [len(p.encode()) + 1 for p in PROMPTS]


def test_forward_is_the_pipelines_transformer_call(adapter: WanAdapter) -> None:
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.initial_latents(generators(3, 4))
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    sched.set_timesteps(sigmas=[1.0, 0.5])
    with torch.no_grad():
        ours = adapter.forward_velocity(x, sched.sigmas[1].expand(2), cond)
        theirs = adapter.transformer(
            hidden_states=x,
            timestep=sched.timesteps[1].expand(2),  # the pipeline's timestep for sigma_1
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            return_dict=False,
        )[0]
    assert torch.equal(ours, theirs)


def test_sampling_with_cfg_reproduces_the_pipeline(adapter: WanAdapter) -> None:
    """On ``WanPipeline``'s own schedule (not digen's), Euler sampling with CFG lands where
    the pipeline does on the same noise."""
    cond, neg = adapter.encode_prompts(PROMPTS), adapter.encode_prompts(["", "blurry"])
    x = adapter.initial_latents(generators(5, 6))
    out = run_pipeline(
        adapter,
        2,
        prompt_embeds=cond.tensors["prompt_embeds"],
        negative_prompt_embeds=neg.tensors["prompt_embeds"],
        guidance_scale=5.0,
        latents=x.clone(),
        output_type="latent",
    )
    sigmas = adapter.scheduler.sigmas.clone()  # [3], as the pipeline just set them
    ours = euler_sample(adapter, x, sigmas, cond, neg, guidance_scale=5.0)
    torch.testing.assert_close(ours, out, atol=1e-5, rtol=1e-5)
