"""What only HunyuanVideo does: the Llama chat template and its crop, the scaled guidance
embedding in its pipeline's transformer call, and its pipeline's sampling.

The adapter protocol (loading, shapes, schedule, CFG, decode, LoRA) is in ``test_protocol.py``.
"""

from __future__ import annotations

import pytest
import torch
from backbone_helpers import PROMPTS, euler_sample, generators, run_pipeline
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

from digen.errors import DigenError
from digen.models.base import make_byte_tokenizer
from digen.models.hunyuanvideo import HunyuanVideoAdapter, template_crop_start


@pytest.fixture(scope="module")
def adapter(tiny_adapter) -> HunyuanVideoAdapter:
    return tiny_adapter("hunyuanvideo")


def test_crop_start_counts_template_and_leading_specials() -> None:
    template = "<|x|>sys: {}<|eot|>"
    tok = make_byte_tokenizer(
        model_max_length=64,
        bos_token="<s>",
        eos_token="</s>",
        extra_special_tokens=("<|x|>", "<|eot|>"),
        add_bos=True,
        add_eos=True,
    )
    # BOS + <|x|> + "sys: " (5 bytes); the EOS appended at the end is not counted
    assert template_crop_start(tok, template) == 1 + 1 + 5
    no_bos = make_byte_tokenizer(model_max_length=64, add_eos=True)
    assert template_crop_start(no_bos, "ab{}") == 2
    with pytest.raises(DigenError, match="slot"):
        template_crop_start(tok, "no slot")


def test_the_template_is_cropped_for_the_loaded_tokenizer(adapter: HunyuanVideoAdapter) -> None:
    crop = template_crop_start(adapter.pipe.tokenizer, DEFAULT_PROMPT_TEMPLATE["template"])
    assert adapter.prompt_template["crop_start"] == crop
    assert crop > 95  # bytes, not Llama-3 BPE tokens: the pipeline's 95 would be wrong here
    mask = adapter.encode_prompts(PROMPTS).tensors["prompt_attention_mask"]
    # after the crop only the prompt's bytes and the closing <|eot_id|> remain
    assert mask.sum(1).tolist() == [len(p.encode()) + 1 for p in PROMPTS]
    empty = adapter.encode_prompts([""])
    assert empty.tensors["prompt_attention_mask"].sum().item() == 1


def test_forward_is_the_pipelines_transformer_call(adapter: HunyuanVideoAdapter) -> None:
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.initial_latents(generators(3, 4))
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    sched.set_timesteps(sigmas=[1.0, 0.5])
    sigma = sched.sigmas[1].expand(2)
    with torch.no_grad():
        ours = adapter.forward_velocity(x, sigma, cond)
        theirs = adapter.transformer(
            hidden_states=x,
            timestep=sched.timesteps[1].expand(2),  # the pipeline's timestep for sigma_1
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            encoder_attention_mask=cond.tensors["prompt_attention_mask"],
            pooled_projections=cond.tensors["pooled_prompt_embeds"],
            guidance=torch.full((2,), 6.0) * 1000.0,  # the distilled guidance, scaled
            return_dict=False,
        )[0]
    assert torch.equal(ours, theirs)


def test_sampling_reproduces_the_pipeline(adapter: HunyuanVideoAdapter) -> None:
    """Euler sampling lands where ``HunyuanVideoPipeline`` does on the same noise."""
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.initial_latents(generators(5, 6))
    out = run_pipeline(adapter, 2, **cond.tensors, latents=x.clone(), output_type="latent")
    torch.testing.assert_close(
        euler_sample(adapter, x, adapter.sigmas(2), cond), out, atol=1e-5, rtol=1e-5
    )
