"""The Wan adapter on its tiny flavour: round trip, conditioning, velocity, decoding."""

from __future__ import annotations

import json

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from transformers import PreTrainedTokenizerFast

from digen.errors import DigenError
from digen.models import get_adapter_class
from digen.models.wan import WanAdapter

PROMPTS = ["a red fox runs through snow", "two boats at dusk"]


def _gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


@pytest.fixture(scope="module")
def adapter() -> WanAdapter:
    return WanAdapter.tiny()


@pytest.fixture(scope="module")
def cond(adapter: WanAdapter):
    return adapter.encode_prompts(PROMPTS)


def test_registry_names_the_adapter() -> None:
    assert get_adapter_class("wan") is WanAdapter
    assert WanAdapter.is_video


def test_tiny_flavour_saves_and_reloads(adapter: WanAdapter) -> None:
    path = WanAdapter.tiny_path()
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "WanPipeline"
    assert (path / "transformer" / "diffusion_pytorch_model.safetensors").is_file()
    assert (path / "tokenizer" / "tokenizer.json").is_file()
    assert isinstance(adapter.pipe.tokenizer, PreTrainedTokenizerFast)
    assert adapter.pipe.transformer_2 is None
    assert adapter.pipe.text_encoder.config.vocab_size >= len(adapter.pipe.tokenizer)

    again = WanAdapter.from_pretrained(path)
    loaded = adapter.transformer.state_dict()
    assert loaded.keys() == again.transformer.state_dict().keys()
    for k, v in again.transformer.state_dict().items():
        assert torch.equal(v, loaded[k]), k
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = WanAdapter.build_tiny_components()["transformer"].state_dict()
    for k, v in built.items():
        assert torch.equal(v, loaded[k]), k
    assert not any(p.requires_grad for p in adapter.transformer.parameters())


def test_latent_shape_and_geometry(adapter: WanAdapter) -> None:
    # 5 frames -> (5 - 1) / 4 + 1 = 2 latent frames; 32 px / 8 = 4
    assert adapter.latent_shape() == (16, 2, 4, 4)
    assert adapter.image_seq_len() == 2 * 2 * 2  # (1, 2, 2) patches
    with pytest.raises(DigenError, match="num_frames"):
        WanAdapter(adapter.pipe, num_frames=4)
    with pytest.raises(DigenError, match="divisible by 16"):
        WanAdapter(adapter.pipe, width=24)


def test_scheduler_uses_flow_shift_three(adapter: WanAdapter) -> None:
    assert isinstance(adapter.scheduler, FlowMatchEulerDiscreteScheduler)
    assert adapter.scheduler.config.shift == 3.0
    sig = adapter.sigmas(4)  # [5]
    base = torch.tensor([1.0, 0.75, 0.5, 0.25])
    want = torch.cat([3.0 * base / (1 + 2.0 * base), torch.zeros(1)])
    torch.testing.assert_close(sig, want)


def test_unipc_checkpoint_scheduler_becomes_euler_with_its_flow_shift() -> None:
    # released Wan2.1 checkpoints ship UniPC with flow_shift (5.0 for 720p)
    pipe = WanAdapter.tiny().pipe
    pipe.scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0
    )
    ad = WanAdapter(pipe)
    assert isinstance(ad.scheduler, FlowMatchEulerDiscreteScheduler)
    assert ad.scheduler.config.shift == 5.0
    assert ad.sigmas(2)[1].item() == pytest.approx(5.0 * 0.5 / (1 + 4.0 * 0.5))


def test_two_expert_checkpoints_are_refused() -> None:
    pipe = WanAdapter.tiny().pipe
    pipe.transformer_2 = pipe.transformer
    with pytest.raises(DigenError, match="transformer_2"):
        WanAdapter(pipe)


def test_encode_prompts(adapter: WanAdapter, cond) -> None:
    emb = cond.tensors["prompt_embeds"]
    assert list(cond.tensors) == ["prompt_embeds"]
    assert emb.shape == (2, 32, 16) and emb.dtype == torch.float32
    # zero past each prompt's bytes + EOS, as the pipeline pads
    nonzero = emb.abs().sum(-1).gt(0).sum(1).tolist()
    assert nonzero == [len(p.encode()) + 1 for p in PROMPTS]
    assert not torch.equal(emb[0], emb[1])
    same = adapter.encode_prompts([PROMPTS[1], PROMPTS[1]]).tensors["prompt_embeds"]
    assert torch.equal(same[0], same[1])
    assert torch.equal(same[1], emb[1])
    assert adapter.encode_prompts(["x" * 100]).tensors["prompt_embeds"].shape == (1, 32, 16)
    short = WanAdapter(adapter.pipe, max_sequence_length=8).encode_prompts(PROMPTS)
    assert short.tensors["prompt_embeds"].shape == (2, 8, 16)


def test_predict_velocity_shape_and_determinism(adapter: WanAdapter, cond) -> None:
    x = adapter.initial_latents(_gens(1, 2))
    assert x.shape == (2, 16, 2, 4, 4) and x.dtype == torch.float32
    assert torch.equal(x, adapter.initial_latents(_gens(1, 2)))
    assert torch.equal(x[1:], adapter.initial_latents(_gens(2)))
    with torch.no_grad():
        v = adapter.predict_velocity(x, torch.tensor([0.9, 0.4]), cond)
        assert v.shape == x.shape and v.dtype == torch.float32
        assert torch.isfinite(v).all() and v.abs().sum() > 0
        assert torch.equal(v, adapter.predict_velocity(x, torch.tensor([0.9, 0.4]), cond))
        one = adapter.predict_velocity(x[1:], 0.4, cond.select([1]))
    torch.testing.assert_close(one, v[1:], atol=1e-5, rtol=1e-5)


def test_forward_matches_the_pipeline_transformer_call(adapter: WanAdapter, cond) -> None:
    x = adapter.initial_latents(_gens(3, 4))
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    sched.set_timesteps(sigmas=[1.0, 0.5])
    with torch.no_grad():
        ours = adapter.forward_velocity(x, sched.sigmas[1].expand(2), cond)
        theirs = adapter.transformer(
            hidden_states=x,
            timestep=sched.timesteps[1].expand(2),
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            return_dict=False,
        )[0]
    assert torch.equal(ours, theirs)


def test_sampling_loop_with_cfg_matches_the_pipeline(adapter: WanAdapter, cond) -> None:
    neg = adapter.encode_prompts(["", "blurry"])
    x = adapter.initial_latents(_gens(5, 6))
    with torch.no_grad():
        out = adapter.pipe(
            prompt_embeds=cond.tensors["prompt_embeds"],
            negative_prompt_embeds=neg.tensors["prompt_embeds"],
            guidance_scale=5.0,
            latents=x.clone(),
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=2,
            output_type="latent",
            return_dict=False,
        )[0]
        # the pipeline's own schedule (it sets the shared scheduler's sigmas)
        sig = adapter.scheduler.sigmas.clone()  # [3]
        y = x
        for i in range(2):
            v = adapter.predict_velocity(y, sig[i], cond, neg_cond=neg, guidance_scale=5.0)
            y = y + (sig[i + 1] - sig[i]) * v
    torch.testing.assert_close(y, out, atol=1e-5, rtol=1e-5)


def test_cfg_combines_two_calls(adapter: WanAdapter, cond) -> None:
    neg = adapter.encode_prompts(["", "blurry"])
    x = adapter.initial_latents(_gens(7, 8))
    sigma = torch.tensor([0.8, 0.3])
    with torch.no_grad():
        v = adapter.predict_velocity(x, sigma, cond, neg_cond=neg, guidance_scale=4.5)
        v_pos = adapter.predict_velocity(x, sigma, cond)
        v_neg = adapter.predict_velocity(x, sigma, neg)
    torch.testing.assert_close(v, v_neg + 4.5 * (v_pos - v_neg), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(v, v_pos)


def test_euler_step_equals_scheduler_step(adapter: WanAdapter, cond) -> None:
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    sched.set_timesteps(sigmas=[1.0, 0.75, 0.5, 0.25])
    sig = adapter.sigmas(4)
    torch.testing.assert_close(sched.sigmas, sig)
    x = adapter.initial_latents(_gens(9, 10))
    i = 2
    with torch.no_grad():
        v = adapter.predict_velocity(x, sig[i], cond)
    ours = x + (sig[i + 1] - sig[i]) * v
    theirs = sched.step(v, sched.timesteps[i], x, return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)


def test_decode(adapter: WanAdapter) -> None:
    x = adapter.initial_latents(_gens(11, 12))
    frames = adapter.decode(x)
    assert frames.shape == (2, 5, 32, 32, 3) and frames.dtype == torch.uint8
    assert frames.float().std() > 0
    # the pipeline maps latents back with the VAE's per-channel mean / std
    vae = adapter.pipe.vae
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    with torch.no_grad():
        raw = vae.decode(x / (1.0 / std) + mean, return_dict=False)[0]
    assert torch.equal(frames, adapter.to_uint8(raw))


def test_lora_attaches_trains_and_starts_as_base(cond) -> None:
    from peft import LoraConfig

    ad = WanAdapter.tiny()
    x = ad.initial_latents(_gens(13, 14))
    sigma = torch.tensor([0.7, 0.2])
    with torch.no_grad():
        base = ad.predict_velocity(x, sigma, cond)
    ad.transformer.add_adapter(
        LoraConfig(
            r=4,
            lora_alpha=4,
            target_modules=list(WanAdapter.lora_targets),
            init_lora_weights="gaussian",
        )
    )
    wrapped = {n for n, m in ad.transformer.named_modules() if hasattr(m, "lora_A")}
    for target in WanAdapter.lora_targets:
        for attn in ("attn1", "attn2"):  # self- and cross-attention of every block
            assert any(n.endswith(f"{attn}.{target}") for n in wrapped), (attn, target)
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
