"""The FLUX.1 adapter on its tiny flavour: loading, conditioning, velocity, sampling, LoRA."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from peft import LoraConfig

from digen.errors import DigenError
from digen.models import get_adapter_class
from digen.models.flux import FluxAdapter, pack_latents, unpack_latents

PROMPTS = ["a red cube", "a blue sphere on grass"]


@pytest.fixture(scope="module")
def adapter() -> FluxAdapter:
    return FluxAdapter.tiny()


def _gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_registry() -> None:
    assert get_adapter_class("flux") is FluxAdapter


def test_tiny_saves_and_reloads(tmp_path) -> None:
    path = FluxAdapter.tiny_path(tmp_path)
    assert (path / "model_index.json").is_file()
    assert (path / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert FluxAdapter.tiny_path(tmp_path) == path  # cached, not rebuilt
    a, b = FluxAdapter.tiny(cache_dir=tmp_path), FluxAdapter.tiny(cache_dir=tmp_path)
    assert isinstance(a.pipe, FluxPipeline)
    assert a.transformer.config.guidance_embeds
    sa, sb = a.pipe.transformer.state_dict(), b.pipe.transformer.state_dict()
    assert sa.keys() == sb.keys() and len(sa) > 0
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    for name in ("vae", "text_encoder", "text_encoder_2"):
        pa = dict(getattr(a.pipe, name).named_parameters())
        pb = dict(getattr(b.pipe, name).named_parameters())
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    # the tiny text encoders cover their tokenizers
    assert a.pipe.text_encoder.config.vocab_size >= len(a.pipe.tokenizer)
    assert a.pipe.text_encoder_2.config.vocab_size >= len(a.pipe.tokenizer_2)
    assert a.pipe.text_encoder.config.eos_token_id == a.pipe.tokenizer.eos_token_id
    # only the transformer is meant to train
    for m in (a.transformer, *a.frozen_modules()):
        assert not any(p.requires_grad for p in m.parameters())


def test_latent_shape_and_geometry(adapter: FluxAdapter) -> None:
    assert adapter.vae_scale_factor == 8
    assert adapter.latent_shape() == (4, 4, 4)
    assert adapter.image_seq_len() == 4  # (4 / 2) * (4 / 2) packed tokens
    other = FluxAdapter(adapter.pipe, height=64, width=48)
    assert other.latent_shape() == (4, 8, 6)
    assert other.image_seq_len() == 12
    with pytest.raises(DigenError, match="divisible by 16"):
        FluxAdapter(adapter.pipe, height=40, width=32)


def test_sigmas_use_dynamic_shift(adapter: FluxAdapter) -> None:
    n = 6
    s = adapter.sigmas(n)
    assert s.shape == (n + 1,) and s.dtype == torch.float32
    assert s[0].item() == pytest.approx(1.0, abs=1e-6)
    assert s[-1].item() == 0.0
    assert torch.all(s[1:] < s[:-1])
    cfg = adapter.scheduler.config
    mu = calculate_shift(
        4, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift
    )
    base = np.linspace(1.0, 1.0 / n, n)
    expected = math.exp(mu) / (math.exp(mu) + (1.0 / base - 1.0))
    torch.testing.assert_close(s[:-1], torch.tensor(expected, dtype=torch.float32))
    assert s[1].item() > base[1] + 0.01  # shifted towards noise


def test_encode_prompts(adapter: FluxAdapter) -> None:
    c = adapter.encode_prompts(PROMPTS)
    pe, pooled = c.tensors["prompt_embeds"], c.tensors["pooled_prompt_embeds"]
    assert pe.shape == (2, 32, 32) and pooled.shape == (2, 32)
    assert not torch.allclose(pe[0], pe[1]) and not torch.allclose(pooled[0], pooled[1])
    again = adapter.encode_prompts(PROMPTS)
    assert all(torch.equal(again.tensors[k], c.tensors[k]) for k in c.tensors)
    alone = adapter.encode_prompts(PROMPTS[1:])  # a prompt does not depend on its batch
    for k in c.tensors:
        torch.testing.assert_close(alone.tensors[k][0], c.tensors[k][1], atol=1e-5, rtol=1e-5)
    short = FluxAdapter(adapter.pipe, max_sequence_length=8).encode_prompts(PROMPTS)
    assert short.tensors["prompt_embeds"].shape == (2, 8, 32)


def test_pack_matches_pipeline_helpers() -> None:
    x = torch.randn(2, 4, 6, 8)  # [B, C, H, W]
    packed = pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 4, 6, 8))
    assert torch.equal(unpack_latents(packed, 6, 8), x)
    assert torch.equal(FluxPipeline._unpack_latents(packed, 48, 64, 8), x)


def test_velocity_shape_guidance_and_cfg(adapter: FluxAdapter) -> None:
    cond = adapter.encode_prompts(PROMPTS)
    neg = adapter.encode_prompts(["", ""])
    x = adapter.initial_latents(_gens(0, 1))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v = adapter.predict_velocity(x, sigma, cond)
        assert v.shape == x.shape == (2, 4, 4, 4) and v.dtype == torch.float32
        assert torch.isfinite(v).all() and v.abs().sum() > 0
        # the distilled guidance value reaches the transformer
        adapter.embedded_guidance = 1.0
        v_low = adapter.predict_velocity(x, sigma, cond)
        adapter.embedded_guidance = 3.5
        assert not torch.allclose(v, v_low)
        # classifier-free guidance = two separate calls combined
        v_neg = adapter.predict_velocity(x, sigma, neg)
        v_cfg = adapter.predict_velocity(x, sigma, cond, neg_cond=neg, guidance_scale=4.0)
    torch.testing.assert_close(v_cfg, v_neg + 4.0 * (v - v_neg), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v_cfg, v)


def test_schnell_variant_without_guidance_embedding(adapter: FluxAdapter) -> None:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        pipe = FluxPipeline(**FluxAdapter.build_tiny_components(guidance_embeds=False))
    schnell = FluxAdapter(pipe, embedded_guidance=1.0)
    cond = schnell.encode_prompts(PROMPTS)
    x = schnell.initial_latents(_gens(0, 1))
    with torch.no_grad():
        v = schnell.predict_velocity(x, 0.5, cond)
        schnell.embedded_guidance = 7.0
        assert torch.equal(v, schnell.predict_velocity(x, 0.5, cond))
    assert v.shape == x.shape and torch.isfinite(v).all()


def test_euler_step_equals_scheduler_and_pipeline(adapter: FluxAdapter) -> None:
    n, scale = 3, 2.0
    cond = adapter.encode_prompts(PROMPTS[:1])
    neg = adapter.encode_prompts([""])
    x0 = adapter.initial_latents(_gens(7))
    sigmas = adapter.sigmas(n)
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    cfg = sched.config
    mu = calculate_shift(
        4, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift
    )
    sched.set_timesteps(sigmas=np.linspace(1.0, 1.0 / n, n), mu=mu)
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
            true_cfg_scale=scale,
            guidance_scale=adapter.embedded_guidance,
            latents=pack_latents(x0),
            height=adapter.height,
            width=adapter.width,
            num_inference_steps=n,
            output_type="latent",
        ).images  # [1, N, 4C]
    torch.testing.assert_close(unpack_latents(out, 4, 4), x, atol=1e-4, rtol=1e-4)


def test_decode(adapter: FluxAdapter) -> None:
    x = adapter.initial_latents(_gens(0, 1))
    img = adapter.decode(x)
    assert img.shape == (2, 1, 32, 32, 3) and img.dtype == torch.uint8
    vae = adapter.pipe.vae
    with torch.no_grad():
        ref = vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor).sample
    ref = adapter.pipe.image_processor.postprocess(ref, output_type="pt")  # [B, 3, H, W] in [0, 1]
    diff = (img[:, 0].permute(0, 3, 1, 2).float() / 255.0 - ref).abs().max().item()
    assert diff <= 1.0 / 255.0 + 1e-6


def test_same_generators_same_samples(adapter: FluxAdapter) -> None:
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
    ad = FluxAdapter.tiny()  # own copy: LoRA changes the module
    cond = ad.encode_prompts(PROMPTS)
    x = ad.initial_latents(_gens(0, 1))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        base = ad.predict_velocity(x, sigma, cond)
    ad.transformer.add_adapter(
        LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=list(FluxAdapter.lora_targets),
            init_lora_weights="gaussian",
        )
    )
    lora = {n: p for n, p in ad.transformer.named_parameters() if "lora_" in n}
    hit = {n.split(".lora_")[0] for n in lora}
    assert any(".attn.to_q" in n for n in hit) and any(".attn.add_q_proj" in n for n in hit)
    assert any("single_transformer_blocks" in n for n in hit)
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
