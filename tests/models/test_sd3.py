"""The SD3 adapter on its tiny flavour: loading, conditioning, velocity, sampling, LoRA."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
from peft import LoraConfig

from digen.errors import DigenError
from digen.models import get_adapter_class
from digen.models.sd3 import SD3Adapter

PROMPTS = ["a red cube", "a blue sphere on grass"]


@pytest.fixture(scope="module")
def adapter() -> SD3Adapter:
    return SD3Adapter.tiny()


def _gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_registry() -> None:
    assert get_adapter_class("sd3") is SD3Adapter


def test_tiny_saves_and_reloads(tmp_path) -> None:
    path = SD3Adapter.tiny_path(tmp_path)
    assert (path / "model_index.json").is_file()
    assert (path / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert SD3Adapter.tiny_path(tmp_path) == path  # cached, not rebuilt
    a, b = SD3Adapter.tiny(cache_dir=tmp_path), SD3Adapter.tiny(cache_dir=tmp_path)
    assert isinstance(a.pipe, StableDiffusion3Pipeline)
    sa, sb = a.pipe.transformer.state_dict(), b.pipe.transformer.state_dict()
    assert sa.keys() == sb.keys() and len(sa) > 0
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for name in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        pa = dict(getattr(a.pipe, name).named_parameters())
        pb = dict(getattr(b.pipe, name).named_parameters())
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    for enc, tok in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
        encoder, tokenizer = getattr(a.pipe, enc), getattr(a.pipe, tok)
        assert encoder.config.vocab_size >= len(tokenizer)
        assert encoder.config.eos_token_id == tokenizer.eos_token_id
    assert a.pipe.text_encoder_3.config.vocab_size >= len(a.pipe.tokenizer_3)
    assert a.scheduler.config.shift == 3.0 and not a.scheduler.config.use_dynamic_shifting
    for m in (a.transformer, *a.frozen_modules()):
        assert not any(p.requires_grad for p in m.parameters())


def test_latent_shape_and_geometry(adapter: SD3Adapter) -> None:
    assert adapter.vae_scale_factor == 8
    assert adapter.latent_shape() == (4, 4, 4)
    assert adapter.image_seq_len() == 4
    assert SD3Adapter(adapter.pipe, height=64, width=48).latent_shape() == (4, 8, 6)
    with pytest.raises(DigenError, match="divisible by 16"):
        SD3Adapter(adapter.pipe, height=40, width=32)


def test_sigmas_follow_the_pipeline_default(adapter: SD3Adapter) -> None:
    n = 4
    s = adapter.sigmas(n)
    assert s.shape == (n + 1,) and s.dtype == torch.float32
    assert s[0].item() == pytest.approx(1.0, abs=1e-6)
    assert s[-1].item() == 0.0
    assert torch.all(s[1:] < s[:-1])

    def shift(u):  # shift 3: s' = 3 s / (1 + 2 s)
        return 3.0 * u / (1.0 + 2.0 * u)

    # timesteps evenly spaced between the shifted ends of the training schedule, shifted again
    base = np.linspace(1.0, shift(1.0 / 1000), n)
    torch.testing.assert_close(s[:-1], torch.tensor(shift(base), dtype=torch.float32))
    assert s[-2].item() < 0.05  # the last step starts near the data end


def test_encode_prompts(adapter: SD3Adapter) -> None:
    c = adapter.encode_prompts(PROMPTS)
    pe, pooled = c.tensors["prompt_embeds"], c.tensors["pooled_prompt_embeds"]
    assert pe.shape == (2, 32 + 32, 48)  # CLIP tokens (16 + 24 wide, padded) then T5 tokens
    assert pooled.shape == (2, 16 + 24)
    assert torch.all(pe[:, :32, 40:] == 0)  # CLIP states padded up to the T5 width
    assert not torch.allclose(pe[0], pe[1]) and not torch.allclose(pooled[0], pooled[1])
    again = adapter.encode_prompts(PROMPTS)
    assert all(torch.equal(again.tensors[k], c.tensors[k]) for k in c.tensors)
    alone = adapter.encode_prompts(PROMPTS[1:])  # a prompt does not depend on its batch
    for k in c.tensors:
        torch.testing.assert_close(alone.tensors[k][0], c.tensors[k][1], atol=1e-5, rtol=1e-5)
    short = SD3Adapter(adapter.pipe, max_sequence_length=8).encode_prompts(PROMPTS)
    assert short.tensors["prompt_embeds"].shape == (2, 32 + 8, 48)


def test_velocity_shape_and_cfg(adapter: SD3Adapter) -> None:
    cond = adapter.encode_prompts(PROMPTS)
    neg = adapter.encode_prompts(["", ""])
    x = adapter.initial_latents(_gens(0, 1))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v = adapter.predict_velocity(x, sigma, cond)
        assert v.shape == x.shape == (2, 4, 4, 4) and v.dtype == torch.float32
        assert torch.isfinite(v).all() and v.abs().sum() > 0
        assert not torch.allclose(v, adapter.predict_velocity(x, torch.tensor([0.5, 0.4]), cond))
        v_neg = adapter.predict_velocity(x, sigma, neg)
        v_cfg = adapter.predict_velocity(x, sigma, cond, neg_cond=neg, guidance_scale=4.5)
    torch.testing.assert_close(v_cfg, v_neg + 4.5 * (v - v_neg), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v_cfg, v)


def test_euler_step_equals_scheduler_and_pipeline(adapter: SD3Adapter) -> None:
    n, scale = 3, 4.5
    cond = adapter.encode_prompts(PROMPTS[:1])
    neg = adapter.encode_prompts([""])
    x0 = adapter.initial_latents(_gens(7))
    sigmas = adapter.sigmas(n)
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    sched.set_timesteps(num_inference_steps=n)  # the pipeline's default schedule
    torch.testing.assert_close(sched.sigmas, sigmas, atol=1e-7, rtol=0)
    x = x0
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            v = adapter.predict_velocity(x, sigmas[i], cond, neg_cond=neg, guidance_scale=scale)
            x_next = x + (sigmas[i + 1] - sigmas[i]) * v
            torch.testing.assert_close(
                x_next, sched.step(v, t, x, return_dict=False)[0], atol=1e-6, rtol=0
            )
            x = x_next
        # the diffusers pipeline, fed the same noise and embeddings, lands on the same latents
        out = adapter.pipe(
            prompt_embeds=cond.tensors["prompt_embeds"],
            pooled_prompt_embeds=cond.tensors["pooled_prompt_embeds"],
            negative_prompt_embeds=neg.tensors["prompt_embeds"],
            negative_pooled_prompt_embeds=neg.tensors["pooled_prompt_embeds"],
            guidance_scale=scale,
            latents=x0,
            height=adapter.height,
            width=adapter.width,
            num_inference_steps=n,
            output_type="latent",
        ).images  # [1, C, H, W]
    torch.testing.assert_close(out, x, atol=1e-4, rtol=1e-4)


def test_decode(adapter: SD3Adapter) -> None:
    x = adapter.initial_latents(_gens(0, 1))
    img = adapter.decode(x)
    assert img.shape == (2, 1, 32, 32, 3) and img.dtype == torch.uint8
    vae = adapter.pipe.vae
    with torch.no_grad():
        ref = vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor).sample
    ref = adapter.pipe.image_processor.postprocess(ref, output_type="pt")  # [B, 3, H, W] in [0, 1]
    diff = (img[:, 0].permute(0, 3, 1, 2).float() / 255.0 - ref).abs().max().item()
    assert diff <= 1.0 / 255.0 + 1e-6


def test_same_generators_same_samples(adapter: SD3Adapter) -> None:
    a, b = adapter.initial_latents(_gens(3, 4)), adapter.initial_latents(_gens(3, 4))
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])
    assert torch.equal(adapter.initial_latents(_gens(4))[0], a[1])  # batch-independent
    cond = adapter.encode_prompts(PROMPTS)
    with torch.no_grad():
        va = adapter.predict_velocity(a, 0.7, cond)
        vb = adapter.predict_velocity(b, 0.7, cond)
        v1 = adapter.predict_velocity(a[1:], 0.7, cond.select([1]))
    assert torch.equal(va, vb)
    torch.testing.assert_close(v1[0], va[1], atol=1e-5, rtol=1e-5)


def test_lora_attaches_and_trains() -> None:
    ad = SD3Adapter.tiny()  # own copy: LoRA changes the module
    cond = ad.encode_prompts(PROMPTS)
    x = ad.initial_latents(_gens(0, 1))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        base = ad.predict_velocity(x, sigma, cond)
    ad.transformer.add_adapter(
        LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=list(SD3Adapter.lora_targets),
            init_lora_weights="gaussian",
        )
    )
    lora = {n: p for n, p in ad.transformer.named_parameters() if "lora_" in n}
    hit = {n.split(".lora_")[0] for n in lora}
    assert any(".attn.to_q" in n for n in hit) and any(".attn.add_q_proj" in n for n in hit)
    assert any(".attn2.to_q" in n for n in hit)  # the dual-attention branch
    assert all(p.requires_grad for p in lora.values())
    assert all(not p.requires_grad for n, p in ad.transformer.named_parameters() if n not in lora)
    v = ad.predict_velocity(x, sigma, cond)
    torch.testing.assert_close(v, base, atol=1e-6, rtol=0)  # B starts at zero
    (v * torch.randn_like(v)).sum().backward()
    grads = {n: p.grad for n, p in lora.items()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    b_nonzero = [n for n, g in grads.items() if "lora_B" in n and g.abs().sum() > 0]
    assert len(b_nonzero) >= 0.8 * sum("lora_B" in n for n in grads)
    with torch.no_grad():
        for n, p in lora.items():
            p -= 0.1 * grads[n]
        moved = ad.predict_velocity(x, sigma, cond)
        assert not torch.allclose(moved, base)
        ad.transformer.disable_adapters()
        torch.testing.assert_close(ad.predict_velocity(x, sigma, cond), base, atol=1e-6, rtol=0)
        ad.transformer.enable_adapters()
