"""The HunyuanVideo adapter on its tiny flavour: round trip, conditioning, velocity, decoding."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE
from transformers import PreTrainedTokenizerFast

from digen.errors import DigenError
from digen.models import get_adapter_class
from digen.models.base import make_byte_tokenizer
from digen.models.hunyuanvideo import HunyuanVideoAdapter, template_crop_start

PROMPTS = ["a red fox runs through snow", "two boats at dusk"]


def _gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.fixture(scope="module")
def adapter() -> HunyuanVideoAdapter:
    return HunyuanVideoAdapter.tiny()


@pytest.fixture(scope="module")
def cond(adapter: HunyuanVideoAdapter):
    return adapter.encode_prompts(PROMPTS)


def test_registry_names_the_adapter() -> None:
    assert get_adapter_class("hunyuanvideo") is HunyuanVideoAdapter
    assert HunyuanVideoAdapter.is_video


def test_tiny_flavour_saves_and_reloads(adapter: HunyuanVideoAdapter) -> None:
    path = HunyuanVideoAdapter.tiny_path()
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideoPipeline"
    assert (path / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert (path / "tokenizer" / "tokenizer.json").is_file()
    assert isinstance(adapter.pipe.tokenizer, PreTrainedTokenizerFast)
    assert isinstance(adapter.pipe.tokenizer_2, PreTrainedTokenizerFast)
    # tiny text encoders cover their tokenizers
    assert adapter.pipe.text_encoder.config.vocab_size >= len(adapter.pipe.tokenizer)
    assert adapter.pipe.text_encoder_2.config.vocab_size >= len(adapter.pipe.tokenizer_2)

    again = HunyuanVideoAdapter.from_pretrained(path)
    loaded = adapter.transformer.state_dict()
    assert loaded.keys() == again.transformer.state_dict().keys()
    for k, v in again.transformer.state_dict().items():
        assert torch.equal(v, loaded[k]), k
    # what was saved is what a seeded build makes
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = HunyuanVideoAdapter.build_tiny_components()["transformer"].state_dict()
    for k, v in built.items():
        assert torch.equal(v, loaded[k]), k
    assert not any(p.requires_grad for p in adapter.transformer.parameters())


def test_latent_shape_and_geometry(adapter: HunyuanVideoAdapter) -> None:
    # 5 frames -> (5 - 1) / 4 + 1 = 2 latent frames; 32 px / 8 = 4
    assert adapter.latent_shape() == (16, 2, 4, 4)
    assert adapter.image_seq_len() == 2 * 2 * 2  # 2x2 spatial patches
    with pytest.raises(DigenError, match="num_frames"):
        HunyuanVideoAdapter(adapter.pipe, num_frames=6)
    with pytest.raises(DigenError, match="divisible by 16"):
        HunyuanVideoAdapter(adapter.pipe, height=40)


def test_scheduler_uses_shift_seven(adapter: HunyuanVideoAdapter) -> None:
    assert adapter.scheduler.config.shift == 7.0
    sig = adapter.sigmas(4)  # [5]
    base = torch.tensor([1.0, 0.75, 0.5, 0.25])
    want = torch.cat([7.0 * base / (1 + 6.0 * base), torch.zeros(1)])
    torch.testing.assert_close(sig, want)


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


def test_encode_prompts(adapter: HunyuanVideoAdapter, cond) -> None:
    crop = template_crop_start(adapter.pipe.tokenizer, DEFAULT_PROMPT_TEMPLATE["template"])
    assert adapter.prompt_template["crop_start"] == crop
    assert crop > 95  # bytes, not Llama-3 BPE tokens: the pipeline's 95 would be wrong here
    emb = cond.tensors["prompt_embeds"]
    pooled = cond.tensors["pooled_prompt_embeds"]
    mask = cond.tensors["prompt_attention_mask"]
    assert emb.shape == (2, 32, 16) and emb.dtype == torch.float32
    assert pooled.shape == (2, 8)
    assert mask.shape == (2, 32)
    # after the crop only the prompt's bytes and the closing <|eot_id|> remain
    assert mask.sum(1).tolist() == [len(p.encode()) + 1 for p in PROMPTS]
    assert not torch.equal(emb[0], emb[1])
    assert not torch.equal(pooled[0], pooled[1])
    same = adapter.encode_prompts([PROMPTS[1], PROMPTS[1]])
    for k, v in same.tensors.items():
        assert torch.equal(v[0], v[1]), k
        assert torch.equal(v[1], cond.tensors[k][1]), k
    empty = adapter.encode_prompts([""])
    assert empty.tensors["prompt_attention_mask"].sum().item() == 1
    assert adapter.encode_prompts(["x" * 100]).tensors["prompt_embeds"].shape == (1, 32, 16)


def test_predict_velocity_shape_and_determinism(adapter: HunyuanVideoAdapter, cond) -> None:
    x = adapter.initial_latents(_gens(1, 2))
    assert x.shape == (2, 16, 2, 4, 4) and x.dtype == torch.float32
    assert torch.equal(x, adapter.initial_latents(_gens(1, 2)))
    # a sample's noise does not depend on its batch
    assert torch.equal(x[1:], adapter.initial_latents(_gens(2)))
    with torch.no_grad():
        v = adapter.predict_velocity(x, torch.tensor([0.9, 0.4]), cond)
        assert v.shape == x.shape and v.dtype == torch.float32
        assert torch.isfinite(v).all() and v.abs().sum() > 0
        assert torch.equal(v, adapter.predict_velocity(x, torch.tensor([0.9, 0.4]), cond))
        one = adapter.predict_velocity(x[1:], 0.4, cond.select([1]))
    torch.testing.assert_close(one, v[1:], atol=1e-5, rtol=1e-5)


def test_forward_matches_the_pipeline_transformer_call(adapter: HunyuanVideoAdapter, cond) -> None:
    x = adapter.initial_latents(_gens(3, 4))
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    sched.set_timesteps(sigmas=[1.0, 0.5])
    t = sched.timesteps[1]  # the pipeline's timestep for sigma_1
    with torch.no_grad():
        ours = adapter.forward_velocity(x, sched.sigmas[1].expand(2), cond)
        theirs = adapter.transformer(
            hidden_states=x,
            timestep=t.expand(2),
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            encoder_attention_mask=cond.tensors["prompt_attention_mask"],
            pooled_projections=cond.tensors["pooled_prompt_embeds"],
            guidance=torch.full((2,), 6.0) * 1000.0,
            return_dict=False,
        )[0]
        other_guidance = HunyuanVideoAdapter(adapter.pipe, embedded_guidance=1.0)
        v1 = other_guidance.forward_velocity(x, sched.sigmas[1].expand(2), cond)
    assert torch.equal(ours, theirs)
    assert not torch.allclose(v1, ours)  # the distilled-guidance embedding is used


def test_sampling_loop_matches_the_pipeline(adapter: HunyuanVideoAdapter, cond) -> None:
    x = adapter.initial_latents(_gens(5, 6))
    with torch.no_grad():
        out = adapter.pipe(
            prompt_embeds=cond.tensors["prompt_embeds"],
            pooled_prompt_embeds=cond.tensors["pooled_prompt_embeds"],
            prompt_attention_mask=cond.tensors["prompt_attention_mask"],
            latents=x.clone(),
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=2,
            output_type="latent",
            return_dict=False,
        )[0]
        sig = adapter.sigmas(2)  # [3]
        y = x
        for i in range(2):
            v = adapter.predict_velocity(y, sig[i], cond)
            y = y + (sig[i + 1] - sig[i]) * v
    torch.testing.assert_close(y, out, atol=1e-5, rtol=1e-5)


def test_cfg_combines_two_calls(adapter: HunyuanVideoAdapter, cond) -> None:
    neg = adapter.encode_prompts(["", "blurry"])
    x = adapter.initial_latents(_gens(7, 8))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        v = adapter.predict_velocity(x, sigma, cond, neg_cond=neg, guidance_scale=4.5)
        v_pos = adapter.predict_velocity(x, sigma, cond)
        v_neg = adapter.predict_velocity(x, sigma, neg)
    torch.testing.assert_close(v, v_neg + 4.5 * (v_pos - v_neg), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v, v_pos)


def test_euler_step_equals_scheduler_step(adapter: HunyuanVideoAdapter, cond) -> None:
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    sched.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25])
    sig = adapter.sigmas(4)
    torch.testing.assert_close(sched.sigmas, sig)
    x = adapter.initial_latents(_gens(9, 10))
    i = 1
    with torch.no_grad():
        v = adapter.predict_velocity(x, sig[i], cond)
    ours = x + (sig[i + 1] - sig[i]) * v
    theirs = sched.step(v, sched.timesteps[i], x, return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_decode(adapter: HunyuanVideoAdapter) -> None:
    x = adapter.initial_latents(_gens(11, 12))
    frames = adapter.decode(x)
    assert frames.shape == (2, 5, 32, 32, 3) and frames.dtype == torch.uint8
    assert frames.float().std() > 0
    # the pipeline divides by the VAE's scaling factor before decoding
    with torch.no_grad():
        vae = adapter.pipe.vae
        raw = vae.decode(x / vae.config.scaling_factor, return_dict=False)[0]
    assert torch.equal(frames, adapter.to_uint8(raw))


def test_lora_attaches_trains_and_starts_as_base(cond) -> None:
    from peft import LoraConfig

    ad = HunyuanVideoAdapter.tiny()
    x = ad.initial_latents(_gens(13, 14))
    sigma = torch.tensor([0.7, 0.2])
    with torch.no_grad():
        base = ad.predict_velocity(x, sigma, cond)
    ad.transformer.add_adapter(
        LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=list(HunyuanVideoAdapter.lora_targets),
            init_lora_weights="gaussian",
        )
    )
    wrapped = {n for n, m in ad.transformer.named_modules() if hasattr(m, "lora_A")}
    for target in HunyuanVideoAdapter.lora_targets:
        assert any(n.endswith("." + target) for n in wrapped), target
    lora = {n: p for n, p in ad.transformer.named_parameters() if "lora_" in n}
    for p in lora.values():
        p.requires_grad_(True)
    v = ad.predict_velocity(x, sigma, cond)
    torch.testing.assert_close(v, base, atol=0, rtol=0)  # B starts at zero
    v.square().mean().backward()
    grads = {n: p.grad for n, p in lora.items()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # with B = 0 only the B matrices get gradient on the first step
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)
    assert sum(g.abs().sum() for g in grads.values()) > 0
