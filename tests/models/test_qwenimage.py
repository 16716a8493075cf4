"""The Qwen-Image adapter on its tiny flavour: loading, prompts, velocity, CFG, decode, LoRA."""

from __future__ import annotations

import json

import numpy as np
import peft
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

from digen.errors import DigenError
from digen.models import get_adapter_class
from digen.models.qwenimage import QwenImageAdapter

PROMPTS = ["a red cube", "two cats on a long wooden bench"]


@pytest.fixture(scope="module")
def adapter() -> QwenImageAdapter:
    return QwenImageAdapter.tiny()


def _gens(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(s) for s in seeds]


def _template_parts(pipe: QwenImagePipeline) -> tuple[str, str]:
    prefix, suffix = pipe.prompt_template_encode.split("{}")
    return prefix, suffix


def test_registry_names_the_adapter() -> None:
    assert get_adapter_class("qwenimage") is QwenImageAdapter


def test_tiny_saves_and_reloads_through_from_pretrained(adapter: QwenImageAdapter) -> None:
    path = QwenImageAdapter.tiny_path()
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    for sub in ("transformer", "vae", "text_encoder"):
        assert list((path / sub).glob("*.safetensors")), sub
    assert (path / "tokenizer" / "tokenizer.json").is_file()

    other = QwenImageAdapter.from_pretrained(path)
    for name in ("transformer", "vae", "text_encoder"):
        a, b = getattr(adapter.pipe, name).state_dict(), getattr(other.pipe, name).state_dict()
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    assert adapter.transformer.config.joint_attention_dim == 32
    assert adapter.pipe.text_encoder.config.text_config.hidden_size == 32
    assert adapter.pipe.text_encoder.config.text_config.vocab_size == len(adapter.pipe.tokenizer)
    n_params = sum(p.numel() for p in adapter.transformer.parameters())
    assert n_params < 200_000


def test_latent_shape_and_geometry(adapter: QwenImageAdapter) -> None:
    assert adapter.pipe.vae_scale_factor == 4
    assert adapter.latent_shape() == (4, 8, 8)
    assert adapter.image_seq_len() == 16  # 4x4 packed tokens
    wide = QwenImageAdapter(adapter.pipe, height=48, width=64)
    assert wide.latent_shape() == (4, 12, 16)
    assert wide.image_seq_len() == 6 * 8
    with pytest.raises(DigenError, match="divisible by 8"):
        QwenImageAdapter(adapter.pipe, height=36, width=32)


def test_sigmas_match_the_pipeline_schedule(adapter: QwenImageAdapter) -> None:
    n = 6
    sigmas = adapter.sigmas(n)
    assert sigmas.shape == (n + 1,) and sigmas.dtype == torch.float32
    assert sigmas[0] == 1.0 and sigmas[-1] == 0.0
    assert bool((sigmas[1:] < sigmas[:-1]).all())
    assert sigmas[-2].item() == pytest.approx(0.02, abs=1e-6)  # shift_terminal
    cfg = adapter.scheduler.config
    assert cfg.use_dynamic_shifting and cfg.time_shift_type == "exponential"
    # what QwenImagePipeline.__call__ does, with its packed token count as image_seq_len
    mu = calculate_shift(
        16, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift
    )
    sched = FlowMatchEulerDiscreteScheduler.from_config(cfg)
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
    torch.testing.assert_close(sigmas, sched.sigmas.float(), rtol=0, atol=1e-6)


def test_template_prefix_is_cropped(adapter: QwenImageAdapter) -> None:
    pipe, tok = adapter.pipe, adapter.pipe.tokenizer
    prefix, suffix = _template_parts(pipe)
    prefix_ids = tok(prefix).input_ids
    assert (
        pipe.prompt_template_encode_start_idx != 34
    )  # the pipeline's value for the real tokenizer
    assert pipe.prompt_template_encode_start_idx == len(prefix_ids) == 149
    assert tok.convert_ids_to_tokens(prefix_ids[:1]) == ["<|im_start|>"]  # one id, not 12 bytes

    emb = adapter.encode_prompts(["a red cube"])
    n_kept = len(tok("a red cube" + suffix).input_ids)
    assert emb.tensors["prompt_embeds"].shape == (1, n_kept, 32)
    # the kept rows are the encoder's last hidden states right after the prefix
    ids = tok([pipe.prompt_template_encode.format("a red cube")], return_tensors="pt")
    with torch.no_grad():
        hidden = pipe.text_encoder(**ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(emb.tensors["prompt_embeds"][0], hidden[0, len(prefix_ids) :])


def test_encode_prompts_pads_within_a_batch(adapter: QwenImageAdapter) -> None:
    tok = adapter.pipe.tokenizer
    _, suffix = _template_parts(adapter.pipe)
    emb = adapter.encode_prompts(PROMPTS)
    lengths = [len(tok(p + suffix).input_ids) for p in PROMPTS]
    embeds, mask = emb.tensors["prompt_embeds"], emb.tensors["prompt_embeds_mask"]
    assert embeds.shape == (2, max(lengths), 32) and mask.shape == (2, max(lengths))
    assert mask.sum(dim=1).tolist() == lengths
    assert bool((embeds[0, lengths[0] :] == 0).all())
    # a prompt's embedding does not depend on the batch it is padded in
    alone = adapter.encode_prompts(PROMPTS[:1]).tensors["prompt_embeds"][0]
    torch.testing.assert_close(embeds[0, : lengths[0]], alone, rtol=1e-5, atol=1e-5)
    same = adapter.encode_prompts(["a red cube", "a red cube"]).tensors["prompt_embeds"]
    assert torch.equal(same[0], same[1])
    assert torch.equal(same[0], alone)
    assert not torch.allclose(embeds[1, : lengths[0]], alone)
    short = QwenImageAdapter(adapter.pipe, max_sequence_length=5).encode_prompts(PROMPTS)
    assert short.tensors["prompt_embeds"].shape == (2, 5, 32)


def test_predict_velocity_is_fp32_and_deterministic(adapter: QwenImageAdapter) -> None:
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.initial_latents(_gens(1, 2))
    assert x.shape == (2, 4, 8, 8) and x.dtype == torch.float32
    assert torch.equal(x, adapter.initial_latents(_gens(1, 2)))
    assert torch.equal(x[1], adapter.initial_latents(_gens(2))[0])  # batch-independent noise
    with torch.no_grad():
        v = adapter.predict_velocity(x, torch.tensor([0.9, 0.4]), cond)
        again = adapter.predict_velocity(x.clone(), torch.tensor([0.9, 0.4]), cond)
        other_t = adapter.predict_velocity(x, torch.tensor([0.5, 0.4]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and bool(v.isfinite().all())
    assert torch.equal(v, again)
    assert not torch.allclose(v[0], other_t[0]) and torch.allclose(v[1], other_t[1], atol=1e-6)


def test_forward_matches_the_pipeline_token_layout(adapter: QwenImageAdapter) -> None:
    """One transformer call exactly as QwenImagePipeline makes it, on packed latents."""
    pipe = adapter.pipe
    cond = adapter.encode_prompts(PROMPTS[:1])
    x = adapter.initial_latents(_gens(3))  # [1, 4, 8, 8]
    packed = pipe._pack_latents(x.unsqueeze(2), 1, 4, 8, 8)  # the pipeline's [1, 16, 16]
    t = torch.tensor([700.0])
    with torch.no_grad():
        ref = pipe.transformer(
            hidden_states=packed,
            timestep=t / 1000,
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            encoder_hidden_states_mask=None,
            img_shapes=[[(1, 4, 4)]],
            return_dict=False,
        )[0]
        v = adapter.predict_velocity(x, 0.7, cond)
    assert torch.equal(v, pipe._unpack_latents(ref, 32, 32, 4)[:, :, 0])


def test_cfg_is_the_pipelines_renormalised_formula(adapter: QwenImageAdapter) -> None:
    pipe = adapter.pipe
    cond, neg = adapter.encode_prompts(PROMPTS), adapter.encode_prompts(["", " "])
    x = adapter.initial_latents(_gens(4, 5))
    sigma, scale = torch.tensor([0.8, 0.3]), 4.0
    with torch.no_grad():
        guided = adapter.predict_velocity(x, sigma, cond, neg, guidance_scale=scale)
        v_pos = adapter.predict_velocity(x, sigma, cond)
        v_neg = adapter.predict_velocity(x, sigma, neg)
    pos, negp = (pipe._pack_latents(v.unsqueeze(2), 2, 4, 8, 8) for v in (v_pos, v_neg))
    comb = negp + scale * (pos - negp)
    comb = comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    expected = pipe._unpack_latents(comb, 32, 32, 4)[:, :, 0]
    assert guided.dtype == torch.float32 and guided.shape == x.shape
    torch.testing.assert_close(guided, expected, rtol=1e-5, atol=1e-5)
    plain = v_neg + scale * (v_pos - v_neg)
    assert not torch.allclose(guided, plain, atol=1e-3)  # the rescale changes the result
    with torch.no_grad():
        assert torch.equal(adapter.predict_velocity(x, sigma, cond, neg, guidance_scale=1.0), v_pos)


def test_ode_step_equals_scheduler_step(adapter: QwenImageAdapter) -> None:
    n = 4
    sigmas = adapter.sigmas(n)
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.initial_latents(_gens(6, 7))
    for i in (0, 2, n - 1):
        sched.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), mu=adapter._dynamic_shift_mu(sched))
        sched.set_begin_index(i)
        with torch.no_grad():
            v = adapter.predict_velocity(x, sigmas[i], cond)
        ours = x + (sigmas[i + 1] - sigmas[i]) * v
        theirs = sched.step(v, sched.timesteps[i], x, return_dict=False)[0]
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        x = ours


def test_decode_gives_uint8_frames(adapter: QwenImageAdapter) -> None:
    x = adapter.initial_latents(_gens(8, 9))
    img = adapter.decode(x)
    assert img.shape == (2, 1, 32, 32, 3) and img.dtype == torch.uint8
    assert img.float().std() > 0
    assert torch.equal(img, adapter.decode(x))
    assert not torch.equal(img[0], img[1])


def test_sampling_loop_reproduces_the_pipeline(adapter: QwenImageAdapter) -> None:
    """Two steps of true-CFG Euler sampling + decode equal ``QwenImagePipeline.__call__``."""
    pipe, n, scale = adapter.pipe, 2, 4.0
    x = adapter.initial_latents(_gens(10, 11))
    with torch.no_grad():
        ref = pipe(
            prompt=PROMPTS,
            negative_prompt=["", ""],
            true_cfg_scale=scale,
            height=32,
            width=32,
            num_inference_steps=n,
            latents=pipe._pack_latents(x.unsqueeze(2), 2, 4, 8, 8),
            output_type="pt",
        ).images  # [2, 3, 32, 32] in [0, 1]
    cond, neg = adapter.encode_prompts(PROMPTS), adapter.encode_prompts(["", ""])
    sigmas = adapter.sigmas(n)
    with torch.no_grad():
        for i in range(n):
            v = adapter.predict_velocity(x, sigmas[i], cond, neg, guidance_scale=scale)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    ours = adapter.decode(x)[:, 0].permute(0, 3, 1, 2).float() / 255  # [2, 3, 32, 32]
    # only uint8 rounding apart (plain CFG without the rescale is ~1.6 levels off, a wrong
    # template crop ~7)
    assert (ours - ref).abs().max() <= 0.51 / 255


def _add_lora(model: QwenImageAdapter, targets: list[str]) -> dict[str, torch.nn.Parameter]:
    model.transformer.add_adapter(
        peft.LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights="gaussian")
    )
    return {n: p for n, p in model.transformer.named_parameters() if "lora_" in n}


def test_lora_attaches_trains_and_starts_at_the_base(adapter: QwenImageAdapter) -> None:
    model = QwenImageAdapter.tiny()  # a private copy: LoRA must not leak into other tests
    cond = model.encode_prompts(PROMPTS)
    x = model.initial_latents(_gens(12, 13))
    sigma = torch.tensor([0.9, 0.5])
    with torch.no_grad():
        base = model.predict_velocity(x, sigma, cond)
    lora = _add_lora(model, list(QwenImageAdapter.lora_targets))
    n_layers = model.transformer.config.num_layers
    assert len(lora) == 2 * len(QwenImageAdapter.lora_targets) * n_layers  # A and B everywhere
    assert all(p.requires_grad for p in lora.values())
    frozen = [p for n, p in model.transformer.named_parameters() if "lora_" not in n]
    assert not any(p.requires_grad for p in frozen)

    v = model.predict_velocity(x, sigma, cond)
    assert torch.equal(v.detach(), base)  # lora_B starts at zero
    v.pow(2).mean().backward()
    grads = {n: p.grad for n, p in lora.items()}
    assert all(g is not None and bool(g.isfinite().all()) for g in grads.values())
    assert sum(float(g.abs().sum()) for n, g in grads.items() if "lora_B" in n) > 0
    for name in ("0.attn.to_q", "0.img_mlp.net.2", "1.attn.add_k_proj"):
        assert grads[f"transformer_blocks.{name}.lora_B.default.weight"].abs().sum() > 0, name

    # why the text-stream outputs are not default targets: the last block's get no gradient
    model.transformer.delete_adapters("default")
    lora = _add_lora(model, ["attn.to_add_out", "txt_mlp.net.2"])
    model.predict_velocity(x, sigma, cond).pow(2).mean().backward()
    dead = {n.split(".")[1] for n, p in lora.items() if p.grad is None}
    assert dead == {str(n_layers - 1)}
